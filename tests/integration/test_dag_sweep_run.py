"""`airflow dags test slipway_scaling_sweep` on tiny synthetic corpora: two nights.

1. A night with a failing cell (fault injection): the data plane, six mapped cells (two
   budgets x three sizes), one of them pre-empted at its first step; the fit still runs
   through the five others and says why it left the sixth out; the forecast is pre-registered
   (an immutable, hashed file and a lineage artifact) before its run trains; the check records
   the outcome against it; and the night fails at its leaf, naming the cell.
2. The same form without the fault (what a backfill of the failed night runs): the failed cell
   trains again (its step is unchanged: fault injection is how, not what) and completes, every
   other cell and the forecast run are cache hits, the night succeeds, and the forecast is
   still the first night's pre-registration, untouched (its run had trained since).

Costs: ~4 min on two shared cores for both nights (a JAX compile per cell shape).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from operators.sweep.form import REPLACED_BY_RECIPE
from tests.support.tiny_pipeline import make_corpora, tiny_conf

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
    conf = {k: v for k, v in tiny_conf(Path(env["_DATA"])).items() if k not in REPLACED_BY_RECIPE}
    conf.update(
        {
            "budgets": [1e10, 3e10],
            "points": 3,
            "forecast_budgets": [3e11],
            "seq_len": 128,
            "steps_per_run": 50,
            "metric_stores": ["heldout-brown", "heldout-fortunes"],
        }
    )
    conf.update(overrides)
    return conf


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

    os.environ["SLIPWAY_HOME"] = env["SLIPWAY_HOME"]
    return json.loads((Path(run_folder(run_id)) / name).read_text())


def test_a_night_with_a_failing_cell_fits_forecasts_checks_and_a_rerun_completes_it(env):
    run1, log1 = night(env, fail_cells=[FAILING])
    nodes = executions(env, run1)
    cells = {n: x for n, x in nodes.items() if n.startswith("sweep/train/")}
    assert len(cells) == 6 + 1, sorted(nodes)  # six grid cells and the forecast run
    states = {n: str(x.execution.state) for n, x in cells.items()}
    assert sorted(states.values()).count("FAILED") == 1, (states, log1[-4000:])

    record = run_file(env, run1, "sweep.json")
    left_out = [c for c in record["cells"] if c["reason"]]
    assert [c["index"] for c in left_out] == [FAILING]
    assert "training FAILED" in left_out[0]["reason"], left_out
    assert "fault injection" in left_out[0]["reason"]
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

    # The repair: the same sweep without the fault. Only the failed cell trains.
    first_bytes = Path(forecast["path"]).read_bytes()
    run2, log2 = night(env)
    nodes2 = executions(env, run2)
    states2 = {n: str(x.execution.state) for n, x in nodes2.items() if n.startswith("sweep/")}
    trained = [n for n, s in states2.items() if n.startswith("sweep/train/") and s == "COMPLETE"]
    failed_cell = next(n for n, s in states.items() if s == "FAILED")
    assert trained == [failed_cell], (states2, log2[-4000:])
    assert sum(s == "CACHED" for n, s in states2.items() if n.startswith("sweep/train/")) == 6
    assert str(nodes2["check"].execution.state) == "COMPLETE", log2[-4000:]
    record2 = run_file(env, run2, "sweep.json")
    assert not [c for c in record2["cells"] if c["reason"]]
    # The forecast run was forecast on the first night: that registration stands, untouched.
    assert Path(forecast["path"]).read_bytes() == first_bytes
    assert record2["forecasts"][0]["path"] == forecast["path"]
    assert not record2["forecasts"][0]["new"]
