"""The pipeline DAG: loads, parses light, and refuses bad run forms at trigger time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "dags" / "slipway_pipeline.py"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags["slipway_pipeline"]


def test_dagbag_loads_the_pipeline(dag):
    assert dag.task_ids == [
        "fetch",
        "ingest",
        "quality",
        "exact_dedup",
        "fuzzy_dedup",
        "decontaminate",
        "split",
        "train_tokenizer",
        "tokenize",
        "train",
        "evaluate",
        "record",
    ]
    record = dag.get_task("record")
    assert record.trigger_rule == "all_done"
    assert [t.task_id for t in dag.leaves] == ["record"]
    assert dag.schedule == "@weekly"  # time-based: backfill needs it


def test_dag_file_imports_fast_without_heavy_modules():
    # Airflow itself is imported first: the dag processor has it loaded already.
    code = f"""
import sys, time, json, importlib.util
import airflow.sdk
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("slipway_pipeline", {str(DAG_FILE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
elapsed = time.perf_counter() - t
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "apache_beam", "tensorstore",
    "trainer", "pipelines", "sentencepiece", "equinox", "optax"}})
print(json.dumps({{"seconds": elapsed, "heavy": heavy}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    # ~0.2 s measured on a busy machine; generous for two shared cores.
    assert report["seconds"] < 1.5, report


def _validate(dag, **conf):
    from airflow.sdk.definitions.param import ParamsDict

    params = ParamsDict()
    params.update(dag.params)
    params.update(conf)
    return params.validate()


def test_default_params_are_valid(dag):
    from operators.params import check_run_config

    values = _validate(dag)
    assert values["model_preset"] == "nano"
    check_run_config(values)


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"model_preset": "7b"}, "model_preset"),
        ({"steps": 0}, "steps"),
        ({"steps": "ten"}, "steps"),
        ({"batch_size": -4}, "batch_size"),
        ({"learning_rate": 0}, "learning_rate"),
        ({"learning_rate": 5}, "learning_rate"),
        ({"seed": -1}, "seed"),
        ({"backend": "aws"}, "backend"),
        ({"accelerator": "h100"}, "accelerator"),
        ({"topology": "2x2;rm"}, "topology"),
        ({"slices": 0}, "slices"),
        ({"sources": []}, "sources"),
        ({"sources": [{"name": "wikipedia", "weight": 1}]}, "sources"),
        ({"sources": [{"name": "brown", "weight": -1}]}, "sources"),
        ({"sources": [{"name": "brown"}]}, "sources"),
        ({"runner": "SparkRunner"}, "runner"),
        ({"dataflow": {"region": "us"}}, "dataflow"),
    ],
)
def test_bad_values_are_refused_by_airflow_param_validation(dag, conf, field):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError) as err:
        _validate(dag, **conf)
    assert field in str(err.value)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"sources": [{"name": "brown", "weight": 0}]}, "must not all be 0"),
        ({"accelerator": "v5p", "topology": "3x3"}, "accelerator/topology/slices"),
        ({"accelerator": "v5e", "topology": "2x2x2"}, "accelerator/topology/slices"),
        ({"backend": "gke"}, "gke.namespace: backend=gke needs the training namespace"),
        ({"backend": "gke", "gke": {"namespace": "Train"}}, "gke.namespace 'Train'"),
        (
            {"backend": "gke", "gke": {"namespace": "t", "cluster_name": "c", "in_cluster": True}},
            "choose one source",
        ),
        ({"backend": "gke", "gke": {"namespace": "t", "cluster_name": "c"}}, "gke.location"),
        ({"backend": "gke", "gke": {"namespace": "t"}}, "image: slipway/trainer:dev"),
        ({"warmup_steps": 500, "steps": 100}, "warmup_steps"),
        ({"fail_at_step": 300, "steps": 200}, "fail_at_step"),
        ({"runner": "DataflowRunner"}, "DataflowRunner needs project_id"),
        (
            {"sources": [{"name": "brown", "weight": 1}, {"name": "brown", "weight": 2}]},
            "listed twice",
        ),
    ],
)
def test_cross_field_checks(dag, conf, message):
    from operators.params import RunConfigError, check_run_config

    values = _validate(dag, **conf)
    with pytest.raises(RunConfigError, match=message):
        check_run_config(values)


def test_gke_run_form_is_accepted():
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import check_run_config, pipeline_params

    params = ParamsDict()
    params.update(pipeline_params())  # fresh Params: the cases above leave values in dag.params
    params.update(
        backend="gke",
        gke={"namespace": "train", "cluster_name": "tpu-cluster", "location": "us-east5"},
        image="us-docker.pkg.dev/proj/slipway/trainer:1",
    )
    check_run_config(params.validate())


def test_enums_match_the_trainer_and_the_catalogue():
    from operators.jobset import CATALOGUE
    from operators.params import ACCELERATORS, MODEL_PRESETS
    from trainer.model import PRESETS

    assert set(MODEL_PRESETS) == set(PRESETS)
    assert set(ACCELERATORS) == set(CATALOGUE)


def test_sources_match_the_corpora():
    from operators.params import SOURCES
    from pipelines.corpora.fetch import raw_paths

    assert set(SOURCES) == set(raw_paths(check=False))
