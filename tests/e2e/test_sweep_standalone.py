"""The scaling sweep on a real ``airflow standalone``: a scheduled night that loses a cell, and
the Airflow backfill that repairs it.

The standalone is the e2e tests' shared one (``tests/e2e/conftest.py``), set up as a platform
would set it: ``$SLIPWAY_SWEEP_CONF`` is the nightly sweep (a tiny one: two budgets x three
sizes and a forecast at 10x, with one cell pre-empted by fault injection) and the schedule is
the DAG's own, 02:00 daily without catchup.

1. Unpausing the DAG lets the scheduler start the most recent night it missed (a
   ``scheduled`` run at the last 02:00), with the platform's form. One cell fails; the fit
   goes through the other five, the forecast is pre-registered, trained and checked, and the
   night fails at its leaf, naming the cell. Its record, report, run summary and run page say
   so (``_the_night_failed_at_its_cell``).
2. ``POST /api/v2/backfills`` over that night with ``reprocess_behavior=failed``: Airflow
   clears the failed run and runs it again. Every step that succeeded is a cache hit; only
   the failed cell trains (resuming from the checkpoint its pre-emption left, so the fault
   does not fire again) and is evaluated; the forecast keeps its first pre-registration; the
   night succeeds.
3. The sweep page in the Airflow UI, in a real browser: the night's grid, its IsoFLOP plot, and
   the forecast with its outcome as the night's report recorded them.

~5 min on two shared cores.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.e2e.browser import SCREENSHOTS, sign_in, step
from tests.e2e.conftest import SWEEP_DAG_ID, SWEEP_FAILING_CELL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _last_night(now: datetime) -> datetime:
    """The most recent 02:00 UTC: the night the scheduler runs on unpausing."""
    night = now.replace(hour=2, minute=0, second=0, microsecond=0)
    return night if night <= now else night - timedelta(days=1)


def _scheduled_run(af, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = af.api("GET", f"/dags/{SWEEP_DAG_ID}/dagRuns")["dag_runs"]
        if runs:
            return runs[0]
        time.sleep(2)
    raise AssertionError(f"no scheduled run in {timeout}s:\n{af.log_tail()}")


def _steps(af, run_id: str) -> dict[str, list[object]]:
    """Each ``sweep/...`` step's executions in this run, in start order."""
    _, _, executions = af.lineage(run_id)
    steps: dict[str, list[object]] = {}
    for e in executions:
        if e.name.startswith("sweep/"):
            steps.setdefault(e.name, []).append(e)
    return steps


def _run_file(af, run_id: str, name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    from operators.settings import HOME_ENV, run_folder

    monkeypatch.setenv(HOME_ENV, str(af.slipway_home))  # the standalone's storage root
    return json.loads((Path(run_folder(run_id)) / name).read_text())


def _the_night_failed_at_its_cell(af, run_id: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """What the failed night recorded: the cell left out with its reason, the fits through
    the other five, the forecast pre-registered and checked, the report drawn by ``fit`` and
    redrawn by ``check``, the summary naming the cell and what a backfill reruns, and the run
    page saying so. Returns the sweep record, its forecast, the registration's bytes and the
    failed training step's name."""
    _, nodes, _ = af.lineage(run_id)
    cells = {n: x for n, x in nodes.items() if n.startswith("sweep/train/")}
    assert len(cells) == 6 + 1, sorted(nodes)  # six grid cells and the forecast run
    states = {n: str(x.execution.state) for n, x in cells.items()}
    assert sorted(states.values()).count("FAILED") == 1, states
    failed_step = next(n for n, s in states.items() if s == "FAILED")
    # each cell's execution names its mapped task instance: the listener and the check close
    # one cell's leftovers without touching its siblings'
    mapped = sorted(
        (x.execution.properties["task_id"], x.execution.properties.get("map_index"))
        for x in cells.values()
    )
    assert mapped == [("train_cell", i) for i in range(6)] + [("train_forecast", 0)], mapped

    record = _run_file(af, run_id, "sweep.json", monkeypatch)
    left_out = [c for c in record["cells"] if c["reason"]]
    assert [c["index"] for c in left_out] == [SWEEP_FAILING_CELL], left_out
    assert "training FAILED" in left_out[0]["reason"], left_out
    assert "fault injection" in left_out[0]["reason"]
    # each trained cell's time, from its step marker and the trainer's result, beside the
    # estimate (FLOPs only on CPU: no chip peak to estimate seconds from)
    for c in record["cells"]:
        if c["reason"]:
            assert c["actual"] is None
        else:
            assert 0 < c["actual"]["train_seconds"] <= c["actual"]["wall_seconds"], c
            assert c["estimate"]["flops"] > 0 and "seconds" not in c["estimate"]
    # Approach 2 lost a budget's curve with that cell and says so; approach 3 fitted the rest.
    assert "at least 2 budgets" in record["fits"]["isoflop"]["error"]
    parametric = record["fits"]["parametric"]
    assert len(parametric["cells"]) == 5 and left_out[0]["label"] in {
        e["cell"] for e in parametric["excluded"]
    }
    (forecast,) = record["forecasts"]
    registered = Path(forecast["path"]).read_bytes()
    registration = json.loads(registered)
    assert registration["budget"] == 3e11 and registration["run_id"] == run_id
    assert {c["label"] for c in registration["fit_inputs"]} == set(parametric["cells"])
    predicted = registration["predicted"]["metric"]
    assert predicted["low"] <= predicted["estimate"] <= predicted["high"]
    outputs = {o.role: o.artifact.content_hash for o in nodes["fit"].outputs}
    assert outputs.pop("forecast:3e+11") == forecast["sha256"]
    report_roles = {
        f"report:{name}.{ext}" for name in ("isoflop", "scaling") for ext in ("png", "svg")
    }
    assert set(outputs) == report_roles | {"report:report.json"}  # the night's report, before

    (check,) = _run_file(af, run_id, "forecast_checks.json", monkeypatch)
    assert check["checked"] and check["sha256"] == forecast["sha256"]
    assert check["relative_error"] == pytest.approx(
        (check["outcome"] - check["predicted"]) / check["outcome"]
    )
    report = _run_file(af, run_id, "report/report.json", monkeypatch)
    assert report["forecasts"][0]["outcome"] == check["outcome"]  # check redrew it
    checked = {o.role: o.artifact.content_hash for o in nodes["check"].outputs}
    assert {r: checked[r] for r in report_roles} == {
        f"report:{name}": digest for name, digest in report["files"].items()
    }
    assert str(nodes["check"].execution.state) == "FAILED"  # the night fails at its leaf
    error = nodes["check"].execution.error
    assert f"[{SWEEP_FAILING_CELL}]" in error and "backfill" in error, error
    assert "backfill a scheduled night with reprocess_behavior=failed" in af.task_log(
        run_id, "check", dag_id=SWEEP_DAG_ID
    )

    # The night's run summary, as record writes a pipeline run's: written before the night
    # fails, it names the failed cell first and says what a backfill reruns (that cell's train
    # and evaluate steps, the training from its checkpoint) and what it skips (the rest).
    summary = _run_file(af, run_id, "summary.json", monkeypatch)
    assert summary["state"] == "FAILED" and summary["pipeline"] == SWEEP_DAG_ID
    assert summary["failed"][0]["step"] == failed_step, summary["failed"]
    assert "fault injection" in summary["failed"][0]["error"]
    assert summary["failed"][-1]["step"] == "check"
    assert f"[{SWEEP_FAILING_CELL}]" in summary["failed"][-1]["error"]
    rows = {r["step"].rsplit("-", 1)[0]: r for r in summary["steps"]}
    evaluate_step = failed_step.replace("/train/", "/evaluate/")
    assert rows[failed_step]["state"] == "FAILED" and rows[failed_step]["marker"] != "SUCCESS"
    # its evaluation refused to score a failed training before it started a step
    assert rows[evaluate_step]["state"] == "NOT_RUN" and rows[evaluate_step]["marker"] is None
    resume = summary["resume"]
    assert sorted(k.rsplit("-", 1)[0] for k in resume["rerun"]) == [evaluate_step, failed_step]
    # every other step, the data plane's and the other cells', is a cache hit on the rerun
    assert len(resume["skipped_on_rerun"]) == len(summary["steps"]) - 2
    skipped = {k.rsplit("-", 1)[0] for k in resume["skipped_on_rerun"]}
    assert {"ingest", "split"} <= skipped and any(n.startswith("tokens/") for n in skipped)
    (cell_resume,) = resume["cells_resume_from"]
    assert cell_resume["cell"] == left_out[0]["label"] and cell_resume["step"] >= 1, resume
    summaries = [o for o in nodes["check"].outputs if o.artifact.type == "run_summary"]
    assert [o.artifact.properties["state"] for o in summaries] == ["FAILED"]
    # ... and the run page in the Airflow UI shows it, as it does a pipeline run's
    page = af.client.get(f"/slipway/runs/{quote(run_id, safe='')}")
    assert page.status_code == 200, page.text[:3000]
    text = " ".join(page.text.split())
    assert f'Failed at <span id="failed-step">{failed_step}</span>' in text, text[:3000]
    assert "2 run again" in text and f"{left_out[0]['label']}</span> at step" in text
    # with their downstream: the fit, then the night's last task, run again after the steps
    assert "Clear the failed cells' tasks with their downstream" in text
    assert "), then the fit and check." in text
    return record, forecast, registered, failed_step


def test_a_scheduled_night_loses_a_cell_and_a_backfill_reruns_only_that_cell(
    airflow, monkeypatch, page
):
    af = airflow
    af.wait_for_dag(dag_id=SWEEP_DAG_ID)
    assert af.api("GET", f"/dags/{SWEEP_DAG_ID}")["is_paused"], "new DAGs start paused"
    unpaused_at = datetime.now(UTC)
    af.api("PATCH", f"/dags/{SWEEP_DAG_ID}", json={"is_paused": False})

    # -- 1. the scheduled night -----------------------------------------------------------------
    run = _scheduled_run(af)
    run_id, logical = run["dag_run_id"], datetime.fromisoformat(run["logical_date"])
    assert run["run_type"] == "scheduled", run
    # the night before unpausing, or the one that began while the scheduler created the run
    assert logical in {_last_night(unpaused_at), _last_night(datetime.now(UTC))}, run
    assert run["conf"] in ({}, None)  # a scheduled night: the platform's form, no conf
    t0 = time.monotonic()
    state = af.wait_run(run_id, timeout=900, dag_id=SWEEP_DAG_ID)
    print(f"scheduled night {run_id}: {state} in {time.monotonic() - t0:.0f}s")
    tasks = af.task_states(run_id, SWEEP_DAG_ID)
    assert state == "failed", tasks
    cells = sorted(t for t in tasks if t.startswith("train_cell["))
    assert len(cells) == 6, tasks
    failing = f"train_cell[{SWEEP_FAILING_CELL}]"
    assert {t: tasks[t] for t in cells if tasks[t] != "success"} == {failing: "failed"}, tasks
    assert tasks["fit"] == "success" and tasks["train_forecast[0]"] == "success", tasks
    assert tasks["check"] == "failed", tasks

    record, forecast, registered, failed_step = _the_night_failed_at_its_cell(
        af, run_id, monkeypatch
    )

    # -- 2. the backfill: Airflow reruns the failed night --------------------------------------
    night = logical.isoformat()
    backfill = af.api(
        "POST",
        "/backfills",
        json={
            "dag_id": SWEEP_DAG_ID,
            "from_date": night,
            "to_date": night,
            "reprocess_behavior": "failed",
            "max_active_runs": 1,
        },
    )
    t0 = time.monotonic()
    time.sleep(3)  # the cleared run is queued for the scheduler
    state = af.wait_run(run_id, timeout=900, dag_id=SWEEP_DAG_ID)
    print(f"backfill {backfill['id']} of {run_id}: {state} in {time.monotonic() - t0:.0f}s")
    tasks = af.task_states(run_id, SWEEP_DAG_ID)
    assert state == "success", (tasks, af.log_tail())
    assert set(tasks.values()) == {"success"}, tasks
    rerun = af.api("GET", f"/dags/{SWEEP_DAG_ID}/dagRuns/{run_id}")
    assert rerun["run_type"] == "backfill", rerun  # the same night, now the backfill's

    steps = _steps(af, run_id)
    evaluate_step = failed_step.replace("/train/", "/evaluate/")
    # The first night did not evaluate the failed cell (its training had failed): the
    # backfill's evaluation is its first. Every other step ran on both, the second a cache hit.
    assert [str(e.state) for e in steps.pop(evaluate_step)] == ["COMPLETE"]
    assert {n: len(x) for n, x in steps.items() if len(x) != 2} == {}
    again = {n: str(x[-1].state) for n, x in steps.items()}
    assert {n: s for n, s in again.items() if s != "CACHED"} == {failed_step: "COMPLETE"}, again
    resumed = steps[failed_step][-1].properties
    assert resumed["resumed_from_step"] >= 1, resumed  # from the pre-emption's checkpoint
    record = _run_file(af, run_id, "sweep.json", monkeypatch)
    assert not [c for c in record["cells"] if c["reason"]]
    (forecast2,) = record["forecasts"]
    assert forecast2["path"] == forecast["path"] and not forecast2["new"]
    assert Path(forecast["path"]).read_bytes() == registered  # the first registration stands
    summary = _run_file(af, run_id, "summary.json", monkeypatch)  # rewritten by the rerun check
    assert summary["state"] == "SUCCESS" and summary["resume"]["rerun"] == [], summary
    af.api("PATCH", f"/dags/{SWEEP_DAG_ID}", json={"is_paused": True})

    # -- 3. the sweep page in the Airflow UI (the Slipway plugin), in a real browser ------------
    report = _run_file(af, run_id, "report/report.json", monkeypatch)
    shots = SCREENSHOTS / "sweep-page"
    shutil.rmtree(shots, ignore_errors=True)
    with step(page, "sweep-page", shots):
        sign_in(page, af, f"{af.url}/slipway/sweeps?night={quote(run_id, safe='')}")
        page.wait_for_url("**/slipway/sweeps?night=**")
        assert page.locator("table#grid tbody tr").count() == len(report["cells"]) == 6
        (shown,) = page.locator("table#forecasts tbody tr").all()
        (f,) = report["forecasts"]
        assert f["checked"], f
        field = {
            k: shown.locator(f'td[data-field="{k}"]').inner_text()
            for k in ("predicted", "outcome", "relative-error")
        }
        assert field == {
            "predicted": f"{f['predicted']:.4f}",
            "outcome": f"{f['outcome']:.4f}",
            "relative-error": f"{100 * f['relative_error']:+.2f}%",
        }, (field, f)
        plot = page.locator("img#plot-isoflop")
        page.wait_for_function(
            "img => img.complete && img.naturalWidth > 0", arg=plot.element_handle()
        )

    # -- 4. tonight's night, queued behind the paused DAG: listed before it records anything ----
    queued = "sweep_queued"
    af.api(
        "POST",
        f"/dags/{SWEEP_DAG_ID}/dagRuns",
        json={"dag_run_id": queued, "logical_date": None, "conf": {}},
    )
    try:
        with step(page, "sweep-page-queued-night", shots):
            page.goto(f"{af.url}/slipway/sweeps")
            rows = page.locator("table#nights tbody tr")
            first = [c.inner_text().strip() for c in rows.nth(0).locator("td").all()]
            assert first[:2] == [queued, "QUEUED"] and first[2].startswith("queued "), first
            # the page still opens on the night with a report, not the empty queued one
            assert page.locator("table#grid tbody tr").count() == len(report["cells"])
            assert rows.nth(1).locator("td").first.inner_text().strip() == f"{run_id} ◀"
            page.get_by_role("link", name=queued, exact=True).click()
            page.wait_for_url("**/slipway/sweeps?night=**")
            said = page.locator("#no-report").inner_text()
            assert said.startswith("Airflow has queued this night"), said
    finally:
        af.client.delete(f"/api/v2/dags/{SWEEP_DAG_ID}/dagRuns/{queued}")
