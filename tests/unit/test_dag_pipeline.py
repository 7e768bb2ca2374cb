"""The pipeline DAG: loads, parses light, and refuses bad run forms at trigger time."""

from __future__ import annotations

import copy
import json
import os
import re
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
        "train",
        "evaluate",
        "export",
        "gate",
        "record",
    ]
    record = dag.get_task("record")
    assert record.trigger_rule == "all_done"
    assert [t.task_id for t in dag.leaves] == ["record"]
    assert record.upstream_task_ids == {"evaluate", "export", "gate"}
    assert dag.schedule == "@weekly"  # time-based: backfill needs it


def test_the_gate_sits_between_evaluate_and_record_with_the_models_alias(dag):
    from airflow.sdk import AssetAlias

    from operators.gate import GateOperator

    gate = dag.get_task("gate")
    assert isinstance(gate, GateOperator)
    assert gate.upstream_task_ids == {"evaluate", "export"}
    assert gate.downstream_task_ids == {"record"}
    # Runs only after a successful evaluation: nothing to judge otherwise.
    assert gate.trigger_rule == "all_success"
    # The asset's name is the form's model_name, known at run time: an alias as the outlet.
    assert gate.outlets == [AssetAlias("slipway-models")]


def test_dag_file_parses_without_heavy_modules():
    # Airflow itself is imported first: the dag processor has it loaded already.
    code = f"""
import sys, json, importlib.util
import airflow.sdk
spec = importlib.util.spec_from_file_location("slipway_pipeline", {str(DAG_FILE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "apache_beam", "tensorstore",
    "pipelines", "sentencepiece", "equinox", "optax"}})
# Of the trainer, only its JAX-free contract: the preset table, the run directory's layout,
# the benchmark task names (the form's eval_tasks and gate_min_accuracy list them) and the
# names of an export folder's files.
light = {{"trainer.shapes", "trainer.rundir", "trainer.tasks", "trainer.export_files"}}
heavy += sorted(m for m in sys.modules if m.startswith("trainer.") and m not in light)
print(json.dumps({{"heavy": heavy,
    "backend": module.dag.params["backend"]}}))
"""
    env = {**os.environ, **PLATFORM}  # a platform deploy: defaults read at parse time
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, env=env
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    assert report["backend"] == "gke"


def _validate(dag, **conf):
    # A deep copy: ParamsDict.update would otherwise set the values on the DAG's own Param
    # objects, and each case would start from the previous case's form.
    params = copy.deepcopy(dag.params)
    params.update(conf)
    return params.validate()


def test_validate_starts_from_the_dags_defaults_each_time(dag):
    assert _validate(dag, steps=7, backend="gke")["steps"] == 7
    values = _validate(dag)
    assert (values["steps"], values["backend"]) == (200, "local")
    assert dag.params["steps"] == 200


def test_default_params_are_valid(dag):
    from operators.pipeline.form import check_run_config

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
        ({"model_name": "Slipway"}, "model_name"),
        ({"model_name": "-demo"}, "model_name"),
        ({"model_name": "demo/../x"}, "model_name"),
        ({"model_name": "demo\n"}, "model_name"),
        ({"model_name": "x" * 64}, "model_name"),
        ({"gate_max_bits_per_byte": 0}, "gate_max_bits_per_byte"),
        ({"gate_max_bits_per_byte": "low"}, "gate_max_bits_per_byte"),
        ({"gate_min_accuracy": {"squad": 0.5}}, "gate_min_accuracy"),
        ({"gate_min_accuracy": {"piqa": 1.5}}, "gate_min_accuracy"),
        ({"gate_min_accuracy": {"piqa": -0.1}}, "gate_min_accuracy"),
        ({"gate_min_accuracy": ["piqa"]}, "gate_min_accuracy"),
        ({"gate_max_regression": -0.01}, "gate_max_regression"),
        ({"eval_tasks": ["squad"]}, "eval_tasks"),
        ({"eval_tasks": ["piqa", "piqa"]}, "eval_tasks"),
        ({"eval_task_limit": 0}, "eval_task_limit"),
        ({"export_dtype": "float16"}, "export_dtype"),
        ({"export_dtype": "bfloat16 --out /tmp"}, "export_dtype"),
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
        ({"backend": "gke", "gke": {"namespace": "t"}}, "image: slipway-trainer:dev"),
        ({"warmup_steps": 500, "steps": 100}, "warmup_steps"),
        ({"fail_at_step": 300, "steps": 200}, "fail_at_step"),
        ({"runner": "DataflowRunner"}, "dataflow.project_id is not set"),
        (
            {"sources": [{"name": "brown", "weight": 1}, {"name": "brown", "weight": 2}]},
            "listed twice",
        ),
        (  # the gate would fail on "no result": refused before any data is read instead
            {"eval_tasks": ["piqa"], "gate_min_accuracy": {"piqa": 0.5, "arc_easy": 0.3}},
            re.escape(
                "gate_min_accuracy.arc_easy: the gate needs its result, but arc_easy is "
                "not in eval_tasks (piqa)"
            ),
        ),
    ],
)
def test_cross_field_checks(dag, conf, message):
    from operators.pipeline.form import RunConfigError, check_run_config

    values = _validate(dag, **conf)
    with pytest.raises(RunConfigError, match=message):
        check_run_config(values)


def test_gate_criteria_are_accepted(dag):
    from operators.pipeline.form import check_run_config

    values = _validate(
        dag,
        model_name="nano-2",
        gate_max_bits_per_byte=2.5,
        gate_min_accuracy={"arc_easy": 0.3, "piqa": 0},
        gate_max_regression=0,
        eval_tasks=["arc_easy", "piqa"],
        eval_task_limit=50,
    )
    check_run_config(values)
    # The defaults: every criterion off (the gate passes and promotes), the zero-shot suite.
    defaults = _validate(dag)
    assert (defaults["gate_max_bits_per_byte"], defaults["gate_max_regression"]) == (None, None)
    assert defaults["gate_min_accuracy"] == {} and defaults["model_name"] == "slipway-demo"
    assert "mmlu_5shot" not in defaults["eval_tasks"] and defaults["eval_task_limit"] == 200


def test_eval_task_names_are_the_trainers():
    from operators.pipeline.form import DEFAULT_EVAL_TASKS, form_fields
    from trainer.tasks import TASK_NAMES

    fields = form_fields()
    assert fields["eval_tasks"]["items"]["enum"] == list(TASK_NAMES)
    assert set(fields["gate_min_accuracy"]["properties"]) == set(TASK_NAMES)
    assert set(DEFAULT_EVAL_TASKS) <= set(TASK_NAMES)


def test_export_dtypes_are_the_exports():
    from operators.pipeline.form import EXPORT_DTYPES, form_fields
    from trainer.export import WEIGHT_DTYPES

    assert sorted(EXPORT_DTYPES) == sorted(WEIGHT_DTYPES)
    assert form_fields()["export_dtype"]["enum"] == list(EXPORT_DTYPES)
    assert form_fields()["export_dtype"]["default"] == "float32"  # exact, as trained


def test_gke_run_form_is_accepted(dag, monkeypatch):
    from operators.pipeline.form import check_run_config

    # The platform allows this namespace and the images of this repository path.
    monkeypatch.setenv("SLIPWAY_ALLOWED_NAMESPACES", "train")
    monkeypatch.setenv("SLIPWAY_ALLOWED_IMAGES", "us-docker.pkg.dev/proj/slipway/")
    monkeypatch.setenv("SLIPWAY_ALLOWED_GKE_CLUSTERS", "us-east5/tpu-cluster")
    values = _validate(
        dag,
        backend="gke",
        gke={"namespace": "train", "cluster_name": "tpu-cluster", "location": "us-east5"},
        image="us-docker.pkg.dev/proj/slipway/slipway-trainer:1",
    )
    check_run_config(values)


# -- DataflowRunner: the settings the Beam stages will use, checked at the first task ---------

BUCKET = "gs://slipway-test-bucket"
BEAM_IMAGE = "us-docker.pkg.dev/slipway-test/slipway/slipway-beam:0.1.0"


@pytest.fixture
def dataflow_platform(monkeypatch):
    """What the Helm chart's ConfigMap sets: Dataflow defaults and a gs:// storage root."""
    monkeypatch.setenv("SLIPWAY_HOME", f"{BUCKET}/slipway")
    monkeypatch.setenv("SLIPWAY_DATA_DIR", f"{BUCKET}/corpora")
    env = {
        "SLIPWAY_DATAFLOW_PROJECT_ID": "slipway-test",
        "SLIPWAY_DATAFLOW_LOCATION": "us-central1",
        "SLIPWAY_DATAFLOW_TEMP_LOCATION": f"{BUCKET}/dataflow/tmp",
        "SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE": BEAM_IMAGE,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def _dataflow_run(dag, **conf):
    return _validate(dag, runner="DataflowRunner", data_dir=f"{BUCKET}/corpora", **conf)


def test_dataflow_run_with_only_platform_settings_is_accepted(dag, dataflow_platform):
    from operators.pipeline.form import check_run_config

    check_run_config(_dataflow_run(dag))  # the form's `dataflow` object left empty


def test_dataflow_project_falls_back_to_the_connection(dag, dataflow_platform):
    from operators.pipeline.form import RunConfigError, check_run_config

    dataflow_platform.delenv("SLIPWAY_DATAFLOW_PROJECT_ID")
    values = _dataflow_run(dag)
    check_run_config(values, connection_project=lambda: "slipway-conn")
    with pytest.raises(RunConfigError, match=re.escape("dataflow.project_id is not set")):
        check_run_config(values, connection_project=lambda: None)
    asked: list[bool] = []
    dataflow_platform.setenv("SLIPWAY_ALLOWED_DATAFLOW_PROJECTS", "slipway-run")
    check_run_config(  # the run names one (one the platform allows): the connection is not asked
        _dataflow_run(dag, dataflow={"project_id": "slipway-run"}),
        connection_project=lambda: asked.append(True),
    )
    assert asked == []


def test_dataflow_run_without_the_sdk_image_is_refused(dag, dataflow_platform):
    from operators.pipeline.form import RunConfigError, check_run_config

    dataflow_platform.delenv("SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE")
    dataflow_platform.setenv("SLIPWAY_ALLOWED_IMAGES", "us-docker.pkg.dev/slipway-test/slipway/")
    with pytest.raises(RunConfigError, match=re.escape("dataflow.sdk_container_image is not set")):
        check_run_config(_dataflow_run(dag))
    # The run's own value counts too.
    check_run_config(_dataflow_run(dag, dataflow={"sdk_container_image": BEAM_IMAGE}))


def test_every_bad_dataflow_value_is_listed(dag, dataflow_platform):
    from operators.pipeline.form import RunConfigError, check_run_config

    dataflow_platform.setenv("SLIPWAY_ALLOWED_DATA_ROOTS", "/srv")
    values = _validate(
        dag,
        runner="DataflowRunner",
        data_dir="/srv/corpora",
        dataflow={
            "project_id": "Bad Project",
            "location": "US",
            "sdk_container_image": "slipway-beam:latest",
            "service_account": "alice@example.com",
            "max_num_workers": 5000,
        },
    )
    with pytest.raises(RunConfigError) as err:
        check_run_config(values)
    lines = str(err.value).splitlines()[1:]
    for expected in (
        "dataflow.project_id 'Bad Project' is not a GCP project id",
        "dataflow.location 'US' is not a Dataflow region",
        "dataflow.sdk_container_image 'slipway-beam:latest'",
        "dataflow.service_account 'alice@example.com'",
        "dataflow.max_num_workers 5000",
        "data_dir (the corpora; default $SLIPWAY_DATA_DIR) /srv/corpora",
    ):
        assert any(expected in line for line in lines), (expected, lines)


# -- platform defaults: the chart's ConfigMap pre-fills the form -------------------------------

PLATFORM = {
    "SLIPWAY_TRAINING_BACKEND": "gke",
    "SLIPWAY_TRAINING_NAMESPACE": "slipway-training",
    "SLIPWAY_TRAINER_SERVICE_ACCOUNT": "slipway-trainer",
    "SLIPWAY_TRAINER_IMAGE": "us-central1-docker.pkg.dev/p-1234/slipway/slipway-trainer:0.1.0",
    "SLIPWAY_TPU_ACCELERATOR": "v5e",
    "SLIPWAY_TPU_TOPOLOGY": "4x4",
    "SLIPWAY_TPU_SLICES": "2",
    "SLIPWAY_KUEUE_QUEUE": "slipway-tpu",
}


def test_platform_environment_prefills_the_form(monkeypatch):
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params
    from operators.pipeline.form import DEV_IMAGE, check_run_config

    for name, value in PLATFORM.items():  # the ConfigMap, in every Airflow container
        monkeypatch.setenv(name, value)
    params = ParamsDict(pipeline_params())
    values = params.validate()
    assert (values["backend"], values["image"]) == ("gke", PLATFORM["SLIPWAY_TRAINER_IMAGE"])
    assert (values["accelerator"], values["topology"], values["slices"]) == ("v5e", "4x4", 2)
    assert values["batch_size"] == 32  # 16, rounded up to what 2 x 16 chips split evenly
    assert values["gke"] == {
        "namespace": "slipway-training",
        "service_account": "slipway-trainer",
        "queue": "slipway-tpu",
    }
    check_run_config(values)  # a platform's pre-filled form is a valid gke run as it stands
    # Unset or empty variables leave the local defaults.
    local = ParamsDict(pipeline_params(environ={"SLIPWAY_TPU_SLICES": ""})).validate()
    assert (local["backend"], local["image"], local["gke"]) == ("local", DEV_IMAGE, {})
    assert local["batch_size"] == 16


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SLIPWAY_TPU_ACCELERATOR": "v9"}, "SLIPWAY_TPU_ACCELERATOR (form field accelerator)"),
        ({"SLIPWAY_TPU_SLICES": "two"}, "SLIPWAY_TPU_SLICES (form field slices)"),
        ({"SLIPWAY_TRAINING_BACKEND": "ray"}, "SLIPWAY_TRAINING_BACKEND (form field backend)"),
    ],
)
def test_bad_platform_defaults_are_refused_naming_the_variable(env, named):
    from operators.params import pipeline_params
    from operators.pipeline.form import PlatformDefaultsError

    with pytest.raises(PlatformDefaultsError, match=re.escape(named)):
        pipeline_params(environ=env)


def test_accelerators_match_the_catalogue():
    from operators.jobset import CATALOGUE
    from operators.pipeline.form import ACCELERATORS

    assert set(ACCELERATORS) == set(CATALOGUE)


def test_sources_match_the_corpora():
    from operators.pipeline.form import SOURCES
    from pipelines.corpora.fetch import raw_paths

    assert set(SOURCES) == set(raw_paths(check=False))
