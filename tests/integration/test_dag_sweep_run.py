"""`airflow dags test slipway_scaling_sweep` on tiny synthetic corpora: a night with a failing
cell (fault injection).

The data plane, six mapped cells (two budgets x three sizes), one of them pre-empted at its
first step; the fit still runs through the five others and says why it left the sixth out;
the forecast is pre-registered (an immutable, hashed file and a lineage artifact) before its
run trains; the check records the outcome against it and redraws the report; and the night
fails at its leaf, naming the cell. The repair of such a night (an Airflow backfill that
reruns only the failed cell) is `tests/e2e/test_sweep_standalone.py`, on a real standalone.

Costs: ~2.5 min on two shared cores (a JAX compile per cell shape).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.support.tiny_pipeline import make_corpora, tiny_sweep_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
FAILING = 1  # the grid index pre-empted on the first night


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweep")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(base / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "SLIPWAY_HOME": str(base / "home"),
    }
    env.pop("SLIPWAY_LINEAGE_DB", None)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    env["_DATA"] = str(make_corpora(base / "data"))
    return env


def sweep_conf(env, **overrides) -> dict:
    return tiny_sweep_conf(Path(env["_DATA"]), **overrides)


def night(env, **overrides) -> tuple[str, str]:
    out = subprocess.run(
        [
            AIRFLOW,
            "dags",
            "test",
            "slipway_scaling_sweep",
            "-c",
            json.dumps(sweep_conf(env, **overrides)),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        run_id = store.runs()[0].run_id  # newest first
    return run_id, out.stdout + out.stderr


def executions(env, run_id: str) -> dict[str, object]:
    """The run's executions by name (the last of each name)."""
    from operators.lineage import LineageStore

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        graph = store.run_graph(run_id)
    return {node.execution.name: node for node in graph.steps}


def run_file(env, run_id: str, name: str) -> object:
    from operators.settings import run_folder

    with mock.patch.dict(os.environ, {"SLIPWAY_HOME": env["SLIPWAY_HOME"]}):
        folder = Path(run_folder(run_id))
    return json.loads((folder / name).read_text())


def test_a_night_with_a_failing_cell_fits_forecasts_and_checks(env):
    run1, log1 = night(env, fail_cells=[FAILING])
    nodes = executions(env, run1)
    cells = {n: x for n, x in nodes.items() if n.startswith("sweep/train/")}
    assert len(cells) == 6 + 1, sorted(nodes)  # six grid cells and the forecast run
    states = {n: str(x.execution.state) for n, x in cells.items()}
    assert sorted(states.values()).count("FAILED") == 1, (states, log1[-4000:])
    # each cell's execution names its mapped task instance: the listener and the check close
    # one cell's leftovers without touching its siblings'
    tasks = sorted(
        (x.execution.properties["task_id"], x.execution.properties.get("map_index"))
        for x in cells.values()
    )
    assert tasks == [("train_cell", i) for i in range(6)] + [("train_forecast", 0)], tasks

    record = run_file(env, run1, "sweep.json")
    left_out = [c for c in record["cells"] if c["reason"]]
    assert [c["index"] for c in left_out] == [FAILING]
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
    registered = json.loads(Path(forecast["path"]).read_text())
    assert registered["budget"] == 3e11 and registered["run_id"] == run1
    assert {c["label"] for c in registered["fit_inputs"]} == set(parametric["cells"])
    predicted = registered["predicted"]["metric"]
    assert predicted["low"] <= predicted["estimate"] <= predicted["high"]
    fit = nodes["fit"]
    outputs = {o.role: o.artifact.content_hash for o in fit.outputs}
    assert outputs.pop("forecast:3e+11") == forecast["sha256"]
    report_roles = {
        f"report:{name}.{ext}" for name in ("isoflop", "scaling") for ext in ("png", "svg")
    }
    assert set(outputs) == report_roles | {"report:report.json"}  # the night's report, before

    (check,) = run_file(env, run1, "forecast_checks.json")
    assert check["checked"] and check["sha256"] == forecast["sha256"]
    assert check["relative_error"] == pytest.approx(
        (check["outcome"] - check["predicted"]) / check["outcome"]
    )
    report = run_file(env, run1, "report/report.json")
    assert report["forecasts"][0]["outcome"] == check["outcome"]  # check redrew it with the outcome
    checked = {o.role: o.artifact.content_hash for o in nodes["check"].outputs}
    assert {r: checked[r] for r in report_roles} == {
        f"report:{name}": digest for name, digest in report["files"].items()
    }
    assert str(nodes["check"].execution.state) == "FAILED"  # the night fails at its leaf
    assert f"[{FAILING}]" in nodes["check"].execution.error and "backfill" in log1

    # The night's run summary, as record writes a pipeline run's: written before the night
    # fails, it names the failed cell first and says what a backfill reruns (that cell's train
    # and evaluate steps, the training from its checkpoint) and what it skips (the rest).
    summary = run_file(env, run1, "summary.json")
    failing = next(c for c in record["cells"] if c["index"] == FAILING)
    train_name = next(n for n, s in states.items() if s == "FAILED")
    assert summary["state"] == "FAILED" and summary["pipeline"] == "slipway_scaling_sweep"
    assert summary["failed"][0]["step"] == train_name, summary["failed"]
    assert "fault injection" in summary["failed"][0]["error"]
    assert (
        summary["failed"][-1]["step"] == "check"
        and f"[{FAILING}]" in summary["failed"][-1]["error"]
    )
    rows = {r["step"].rsplit("-", 1)[0]: r for r in summary["steps"]}
    evaluate_name = train_name.replace("/train/", "/evaluate/")
    assert rows[train_name]["state"] == "FAILED" and rows[train_name]["marker"] != "SUCCESS"
    # its evaluation refused to score a failed training before it started a step
    assert rows[evaluate_name]["state"] == "NOT_RUN" and rows[evaluate_name]["marker"] is None
    resume = summary["resume"]
    assert sorted(k.rsplit("-", 1)[0] for k in resume["rerun"]) == [evaluate_name, train_name]
    # every other step, the data plane's and the other cells', is a cache hit on the rerun
    assert len(resume["skipped_on_rerun"]) == len(summary["steps"]) - 2
    skipped = {k.rsplit("-", 1)[0] for k in resume["skipped_on_rerun"]}
    assert {"ingest", "split"} <= skipped and any(n.startswith("tokens/") for n in skipped)
    ((cell_resume),) = resume["cells_resume_from"]
    assert cell_resume["cell"] == failing["label"] and cell_resume["step"] >= 1, cell_resume
    summaries = [o for o in nodes["check"].outputs if o.artifact.type == "run_summary"]
    assert [o.artifact.properties["state"] for o in summaries] == ["FAILED"]
    # ... and the run page shows it, as it does a pipeline run's
    from operators.lineage import LineageStore
    from operators.reports import pages

    with LineageStore(f"sqlite:///{env['SLIPWAY_HOME']}/lineage.db") as store:
        page = pages.run_page(store, run1, "/slipway", loss_src="x.png")
    text = " ".join(page.split())
    assert f'Failed at <span id="failed-step">{train_name}</span>' in text, text[:3000]
    assert "2 run again" in text and f"{failing['label']}</span> at step" in text
