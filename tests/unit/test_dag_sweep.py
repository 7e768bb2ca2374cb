"""The sweep DAG as Airflow loads it: its tasks and mapping, its leaf, its schedule, its form,
and a parse that loads nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "dags" / "slipway_scaling_sweep.py"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags["slipway_scaling_sweep"]


def test_the_sweep_is_the_data_plane_then_mapped_cells_then_fit_forecast_check(dag):
    assert dag.task_ids[:10] == [
        "validate",
        "fetch",
        "ingest",
        "quality",
        "exact_dedup",
        "fuzzy_dedup",
        "decontaminate",
        "split",
        "train_tokenizer",
        "tokenize",
    ]
    assert dag.task_ids[10:] == [
        "grid",
        "train_cell",
        "evaluate_cell",
        "fit",
        "train_forecast",
        "evaluate_forecast",
        "check",
    ]
    assert [t.task_id for t in dag.leaves] == ["check"]  # its state is the night's
    for task_id in ("train_cell", "evaluate_cell", "train_forecast", "evaluate_forecast"):
        task = dag.get_task(task_id)
        assert task.is_mapped and task.map_index_template == "{{ task.cell['label'] }}"
    assert dag.get_task("train_cell").max_active_tis_per_dagrun == 2
    for task_id in ("evaluate_cell", "fit", "evaluate_forecast", "check"):
        assert dag.get_task(task_id).trigger_rule == "all_done"  # a failed cell stops nothing
    assert dag.schedule == "0 2 * * *" and not dag.catchup


def test_the_form_is_the_sweeps(dag):
    from operators.sweep.form import REPLACED_BY_RECIPE, sweep_form_fields

    assert set(dag.params) == set(sweep_form_fields())
    assert not set(REPLACED_BY_RECIPE) & set(dag.params)
    params = dag.params.validate()  # the defaults are valid
    assert params["recipe"] == "marin-2025" and params["budgets"] == [3e11, 1e12, 3e12]


def test_the_dag_file_parses_without_heavy_modules():
    code = f"""
import sys, json, importlib.util
import airflow.sdk
spec = importlib.util.spec_from_file_location("sweep", {str(DAG_FILE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "apache_beam", "tensorstore",
    "pipelines", "sentencepiece", "equinox", "optax", "scipy"}})
light = {{"trainer.shapes", "trainer.rundir", "trainer.tasks", "trainer.export_files"}}
heavy += sorted(m for m in sys.modules if m.startswith("trainer.") and m not in light)
print(json.dumps(heavy))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_conf_keys_the_form_does_not_declare_are_refused(dag):
    """Airflow keeps a trigger's undeclared conf keys as params without a schema: the
    pipeline fields the sweep's form leaves out (steps, model_name) would pass unchecked."""
    from operators.pipeline.form import RunConfigError

    validate = dag.get_task("validate")
    declared = dict(dag.params)
    validate.refuse_undeclared(declared)  # the form's own fields
    with pytest.raises(RunConfigError) as err:
        validate.refuse_undeclared({**declared, "steps": 10**18, "model_name": "x\n../y"})
    message = str(err.value)
    assert "steps: not a field of slipway_scaling_sweep's form" in message
    assert "model_name: not a field of slipway_scaling_sweep's form" in message


def test_check_fails_a_night_whose_data_plane_or_grid_did_not_succeed_this_try(dag):
    # A backfill clears the whole night; if validate now fails, grid never runs, and the
    # all_done cells and fit read the earlier try's grid: every cell a cache hit, check once
    # passed the night though its own summary said FAILED.
    check = dag.get_task("check")
    states = {"validate": "failed", "fetch": "upstream_failed", "grid": "upstream_failed"}
    reason = check._incomplete({}, {"forecasts": [{}]}, [], [], states)
    assert reason == (
        "the night's data plane or grid did not succeed: validate failed, fetch upstream_failed,"
        " grid upstream_failed"
    )
    # the grid and the data plane succeeded: the night is judged by its fit and cells
    done = {t: "success" for t in ("validate", "fetch", "grid")}
    assert check._incomplete({}, {}, [], [], done).startswith("no forecast this night")
