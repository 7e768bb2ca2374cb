"""The e2e tests' Airflow: one real ``airflow standalone``, shared by every e2e test.

Started as a user starts it (``make airflow``, which runs ``airflow standalone``: scheduler,
dag-processor, API server, triggerer; LocalExecutor on SQLite) on a free loopback port, in a
throwaway ``OUT`` (its ``AIRFLOW_HOME``), with the repo's ``dags/`` and ``plugins/`` (the
lineage listener) and tiny synthetic corpora as the platform's data dir. Shared by the REST
tests and the browser tests (start-up is about a minute on two cores); stopped, its whole
process group, after the last test that uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.tiny_pipeline import make_corpora, tiny_sweep_conf

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
DAG_ID = "slipway_pipeline"
SWEEP_DAG_ID = "slipway_scaling_sweep"
SWEEP_FAILING_CELL = 1  # the grid index the platform's nightly sweep pre-empts
HEARTBEAT_TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Airflow:
    """A running ``airflow standalone`` and an authenticated REST client for it."""

    def __init__(self, base: Path) -> None:
        import httpx

        self.base = base
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # `make airflow OUT=base DATA=...`: Airflow home base/airflow, steps and lineage in base.
        self.home = base / "airflow"
        self.slipway_home = base
        self.data = make_corpora(base / "data")
        # The platform's nightly sweep (scheduled nights run the form's defaults): tiny, with
        # one cell pre-empted (tests/e2e/test_sweep_standalone.py).
        self.sweep_conf = tiny_sweep_conf(self.data, fail_cells=[SWEEP_FAILING_CELL])
        (base / "nightly-sweep.json").write_text(json.dumps(self.sweep_conf))
        settings = {
            "AIRFLOW__API__WORKERS": "1",
            # slipway_pipeline is @weekly without catchup: unpausing it would start the latest
            # scheduled run (the full default form) ahead of ours (max_active_runs=1). Manual
            # runs only; the sweep keeps its nightly schedule (its test unpauses it).
            "SLIPWAY_PIPELINE_SCHEDULE": "none",
            "SLIPWAY_SWEEP_CONF": str(base / "nightly-sweep.json"),
            # A task whose worker died is failed by the scheduler this long after its last
            # heartbeat (default 300 s; the supervisor beats every few seconds).
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
            # The OpenLineage provider's real file transport: one JSON event per line.
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "slipway-e2e",
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(base / "openlineage.jsonl"), "append": True}
            ),
        }
        # Nothing of the caller's Airflow or Slipway settings.
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SLIPWAY_"))},
            **settings,
        }
        self.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        self.log_path = base / "standalone.log"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30)

    # -- process ------------------------------------------------------------------------------

    def start(self, timeout: float = 240) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            # What the README tells a user to run (it runs `airflow standalone`).
            [
                "make",
                "airflow",
                f"AIRFLOW_PORT={self.port}",
                f"OUT={self.base}",
                f"DATA={self.data}",
            ],
            env=self.env,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends all of it
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"standalone exited:\n{self.log_tail()}"
            try:
                health = self.client.get("/api/v2/monitor/health").json()
                if health["scheduler"]["status"] == "healthy" and self.password():
                    break
            except Exception:
                pass
            time.sleep(2)
        else:
            raise AssertionError(f"standalone not healthy in {timeout}s:\n{self.log_tail()}")
        token = self.client.post(
            "/auth/token", json={"username": "admin", "password": self.password()}
        )
        assert token.status_code in (200, 201), token.text
        self.client.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

    def password(self) -> str | None:
        path = self.home / "simple_auth_manager_passwords.json.generated"
        try:
            return json.loads(path.read_text())["admin"]
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pgid = os.getpgid(self.proc.pid)
            os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            # anything of the group still alive (tasks, API server workers)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.client.close()
        if hasattr(self, "_log"):
            self._log.close()

    def openlineage_events(self, run_id: str, task_id: str, event_type: str) -> list[dict]:
        """The OpenLineage events the provider wrote for one task of one DAG run."""
        path = self.base / "openlineage.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        events = [json.loads(line) for line in lines if line.strip()]
        return [
            e
            for e in events
            if e["job"]["name"] == f"{DAG_ID}.{task_id}"
            and e["eventType"] == event_type
            and e["run"]["facets"].get("airflow", {}).get("dagRun", {}).get("run_id") == run_id
        ]

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- REST ---------------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs) -> dict:
        r = self.client.request(method, f"/api/v2{path}", **kwargs)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def wait_for_dag(self, timeout: float = 120, dag_id: str = DAG_ID) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.client.get(f"/api/v2/dags/{dag_id}")
            if r.status_code == 200:
                return
            time.sleep(2)
        errors = self.client.get("/api/v2/importErrors").text
        raise AssertionError(f"{dag_id} not parsed in {timeout}s: {errors}\n{self.log_tail()}")

    def trigger(self, run_id: str, conf: dict) -> None:
        self.api(
            "POST",
            f"/dags/{DAG_ID}/dagRuns",
            json={"dag_run_id": run_id, "logical_date": None, "conf": conf},
        )

    def wait_run(self, run_id: str, timeout: float = 420, dag_id: str = DAG_ID) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(3)
        states = self.task_states(run_id, dag_id)
        raise AssertionError(f"run {run_id} not done in {timeout}s: {states}")

    def task_states(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, str]:
        """Task id -> state; a mapped task's instances as ``task_id[map_index]``."""
        tis = self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100}
        )
        return {
            ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""): ti["state"]
            for ti in tis["task_instances"]
        }

    def task_log(self, run_id: str, task_id: str, try_number: int = 1, dag_id: str = DAG_ID) -> str:
        run = quote(run_id, safe="")  # a scheduled run's id has ':' and '+'
        r = self.client.get(
            f"/api/v2/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}/logs/{try_number}",
            headers={"Accept": "application/json"},
        )
        return r.text  # JSON: the log lines' text is in there

    # -- lineage ------------------------------------------------------------------------------

    def lineage(self, run_id: str) -> tuple[dict[str, str], dict, list]:
        """Latest state per step, the latest node per step, and every execution of the run."""
        from operators.lineage import LineageStore

        with LineageStore(f"sqlite:///{self.slipway_home}/lineage.db", create=False) as store:
            graph = store.run_graph(run_id)
        latest = {}
        for node in graph.steps:  # start order: the last attempt of each step wins
            latest[node.execution.name] = node
        states = {name: str(node.execution.state) for name, node in latest.items()}
        return states, latest, [node.execution for node in graph.steps]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(f"signal {signum}")  # runs the fixture's finally: no orphaned Airflow


_RUNNING: list[Airflow] = []  # the session's standalone while it runs


@pytest.fixture(scope="session")
def airflow(tmp_path_factory):
    af = Airflow(tmp_path_factory.mktemp("standalone"))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        t0 = time.monotonic()
        _RUNNING.append(af)
        af.start()
        af.wait_for_dag()
        print(f"standalone up and {DAG_ID} parsed in {time.monotonic() - t0:.0f}s")
        yield af
    finally:
        if af in _RUNNING:
            _RUNNING.remove(af)
        af.stop()
        signal.signal(signal.SIGTERM, previous)


def pytest_runtest_teardown(item, nextitem):
    """Stop the standalone after the last test that uses it, not at the session's end.

    The e2e tests are collected first; a session fixture would keep the scheduler,
    dag-processor, API server and triggerer busy on the 2 cores through every integration and
    unit test after them. (Package scope would need ``tests/e2e`` to be a package.)
    """
    if not _RUNNING or nextitem is None:
        return  # nothing running, or the session's end tears the fixture down anyway
    items = item.session.items
    later = items[items.index(item) + 1 :]
    if not any("airflow" in getattr(other, "fixturenames", ()) for other in later):
        _RUNNING.pop().stop()


@pytest.fixture
def page():
    """A fresh headless Chromium page (tests/e2e/browser.py), closed after the test."""
    from tests.e2e.browser import open_page

    yield from open_page()
