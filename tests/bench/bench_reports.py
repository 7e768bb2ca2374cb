"""Benchmark of the Slipway pages with many recorded runs: the runs list must stay under a second.

    .venv/bin/python -m tests.bench.bench_reports [--runs 500] [--repeat 7]

Records ``--runs`` pipeline runs (half of every tenth failing at train) in a fresh SQLite
lineage store through the operators' own API (``tests/support/report_runs.py``: ten executions
and about fifteen artifacts each), then times, median of ``--repeat``, through the plugin's app
(``operators/ui.py`` with Airflow's authentication dependency overridden, FastAPI's test client):

* ``GET /`` -- the runs list's first page (``pages.RUNS_PER_PAGE`` rows), over all of them: the
  number that must stay under 1 s;
* ``GET /runs/<id>`` and ``/runs/<id>/loss.png`` for one run among them (the plot drawn, kept
  from an earlier request, and revalidated by its ETag: 304);
* ``GET /trace`` of that run's checkpoint.

Baselines from the same run: the store's ``runs()`` query alone (what the list cannot be faster
than), and the list page at 10 runs (how it scales).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.report_runs import record_run  # noqa: E402


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _client(store):
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from operators import ui

    ui._store = store
    ui.app.dependency_overrides[get_user] = lambda: object()
    # A user who may read every DAG, and no Airflow metadata database (its DagRun states and
    # queued runs are indexed queries on the API server's; here the pages show lineage's):
    # the time is the pages'.
    ui.app.dependency_overrides[ui.readable_dags] = lambda: set
    ui.dag_runs = lambda run_ids: {}
    ui.waiting_dag_runs = lambda dag_ids: {}
    return TestClient(ui.app, root_path="/slipway")


def _drawn(client, path: str) -> Callable[[], None]:
    """The loss plot drawn: the app's kept drawings emptied before each request."""
    from operators import ui

    get = _get(client, path)

    def fn() -> None:
        ui._LOSS_PNGS.clear()
        get()

    return fn


def _revalidated(client, path: str) -> Callable[[], None]:
    """A browser's revalidation of the plot it has: If-None-Match, answered 304."""
    etag = client.get(path).headers["etag"]

    def fn() -> None:
        r = client.get(path, headers={"If-None-Match": etag})
        assert r.status_code == 304, (path, r.status_code)

    return fn


def _get(client, path: str, **params) -> Callable[[], None]:
    def fn() -> None:
        r = client.get(path, params=params)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from operators.lineage import LineageStore
    from operators.reports.view import RESULT_STEPS, RESULT_TYPES, run_view

    logging.disable(logging.INFO)  # the test client logs one line per request otherwise

    scratch = tempfile.TemporaryDirectory(prefix="bench-reports-")
    tmp = Path(scratch.name)
    os.environ["SLIPWAY_HOME"] = str(tmp)
    # The app imports Airflow, which makes its home on import: a throwaway one, not ~/airflow
    # (the pages need none of it; a caller's own, as the tests', is kept).
    os.environ.setdefault("AIRFLOW_HOME", str(tmp / "airflow"))
    store = LineageStore(f"sqlite:///{tmp}/lineage.db")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    t0 = time.perf_counter()
    for i in range(args.runs):
        record_run(
            store,
            f"run-{i:04d}",
            tmp,
            fail_train=i % 20 == 7,
            started_at=start + timedelta(hours=i),
        )
        if i == 9:
            small = _median(_get(_client(store), "/"), args.repeat)
    print(f"recorded {args.runs} runs in {time.perf_counter() - t0:.1f} s (a temporary SQLite)")

    client = _client(store)
    one = f"run-{args.runs // 2:04d}"
    ckpt = run_view(store.run_graph(one)).training
    results = {
        "store.runs() alone": _median(store.runs, args.repeat),
        "store.run_outputs() alone": _median(
            lambda: store.run_outputs(RESULT_STEPS, RESULT_TYPES), args.repeat
        ),
        "GET / (10 runs)": small,
        f"GET / ({args.runs} runs)": _median(_get(client, "/"), args.repeat),
        "GET /runs/<id>": _median(_get(client, f"/runs/{one}"), args.repeat),
        "GET /runs/<id>/loss.png, drawn": _median(
            _drawn(client, f"/runs/{one}/loss.png"), args.repeat
        ),
        "GET /runs/<id>/loss.png, kept": _median(
            _get(client, f"/runs/{one}/loss.png"), args.repeat
        ),
        "GET /runs/<id>/loss.png, 304": _median(
            _revalidated(client, f"/runs/{one}/loss.png"), args.repeat
        ),
        "GET /trace (checkpoint)": _median(
            _get(client, "/trace", uri=ckpt.checkpoint, version=ckpt.checkpoint_version),
            args.repeat,
        ),
    }
    listed = results[f"GET / ({args.runs} runs)"]
    for name, seconds in results.items():
        print(f"{name:<34} {seconds * 1000:8.1f} ms")
    print(
        f"runs list with {args.runs} runs: {listed:.3f} s = {listed / 1.0:.2f}x the 1 s budget; "
        f"{listed / results['store.runs() alone']:.1f}x the store query alone; "
        f"{listed / small:.1f}x the list at 10 runs"
    )
    store.close()
    scratch.cleanup()


if __name__ == "__main__":
    main()
