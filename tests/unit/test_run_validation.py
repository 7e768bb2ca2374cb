"""Every user-supplied value is checked before it reaches a command line, a path or a manifest.

- every name validator matches the whole string: a trailing newline, a tab, a NUL or a unicode
  look-alike is refused wherever it is put;
- ``data_dir`` only below the data roots the platform allows (symlinks resolved);
- credentials, identities and images only as the platform allows (:mod:`operators.policy`);
- NaN and infinities refused anywhere in the form;
- every stage config checked (unknown keys, types, ranges) by the first task, ``validate``,
  which records the refusal in lineage before any data is read.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from operators import naming
from operators.jobset import TrainingLaunch
from operators.jobset import names as k8s
from operators.jobset.catalogue import ShapeError, resolve
from operators.jobset.gke import ClusterSettings
from operators.jobset.names import ManifestError
from operators.pipeline.form import (
    DATA_DIR_PATTERN,
    MODEL_NAME_PATTERN,
    TOPOLOGY_PATTERN,
    RunConfigError,
)
from operators.steps import Step

REPO = Path(__file__).resolve().parents[2]


def _raises(fn: Callable[[str], object]) -> Callable[[str], bool]:
    def accepts(value: str) -> bool:
        try:
            fn(value)
        except (ManifestError, ShapeError, ValueError):
            return False
        return True

    return accepts


def _pattern(pattern: str) -> Callable[[str], bool]:
    import re

    # What jsonschema (Airflow's Param validation) does with a "pattern".
    return lambda value: re.search(pattern, value) is not None


def _full(pattern) -> Callable[[str], bool]:
    return lambda value: naming.full(pattern, value)


# (name, accepts(value) -> bool, a valid value)
VALIDATORS = [
    ("dns1123 label", _raises(lambda v: k8s.check_dns1123_label(v, "name")), "run-1"),
    ("dns1123 subdomain", _raises(lambda v: k8s.check_dns1123_subdomain(v, "sa")), "slipway.tpu"),
    ("label key", _raises(k8s.check_label_key), "example.com/team"),
    ("label value", _raises(k8s.check_label_value), "team-a"),
    ("env name", _raises(k8s.check_env_name), "MY_VAR"),
    ("image", _raises(k8s.check_image), "us-docker.pkg.dev/proj/repo/trainer:v1"),
    ("gcp project", _full(naming.PROJECT), "my-project-1"),
    ("gcp region", _full(naming.REGION), "us-central1"),
    ("gcp zone", _full(naming.ZONE), "us-central2-b"),
    ("gke cluster", _full(naming.GKE_CLUSTER), "tpu-cluster"),
    ("gcs path", _full(naming.GCS_PATH), "gs://bucket-1/tmp/x"),
    ("service account", _full(naming.SERVICE_ACCOUNT), "sa@proj.iam.gserviceaccount.com"),
    ("location", naming.is_location, "us-east5-a"),
    ("topology", _raises(lambda v: resolve("v5e", v)), "4x4"),
    ("topology (form)", _pattern(TOPOLOGY_PATTERN), "2x2x4"),
    ("data_dir (form)", _pattern(DATA_DIR_PATTERN), "/srv/corpora"),
    # It goes into the Asset URI slipway://models/<name> and the lineage record's URI.
    ("model_name (form)", _pattern(MODEL_NAME_PATTERN), "slipway-demo-2"),
    ("tpu zone", _raises(lambda v: _problems(ClusterSettings(tpu_zone=v))), "us-central2-b"),
    ("step name", _raises(lambda v: Step(v)), "tokens/train/brown"),
]


def _problems(settings: ClusterSettings) -> None:
    if problems := settings.problems():
        raise ValueError(problems)


def _corruptions(value: str) -> dict[str, str]:
    # Cyrillic letters, fullwidth digits and punctuation that look like their ASCII twins.
    twins = dict(
        zip("aeoxcpysi0123456789/_-.", "аеохсруѕі０１２３４５６７８９／＿‐．", strict=True)
    )
    lookalike = value.translate(str.maketrans(twins))
    assert lookalike != value
    middle = len(value) // 2
    return {
        "trailing newline": value + "\n",
        "leading newline": "\n" + value,
        "inner newline": value[:middle] + "\n" + value[middle:],
        "trailing tab": value + "\t",
        "inner tab": value[:middle] + "\t" + value[middle:],
        "NUL": value[:middle] + "\x00" + value[middle:],
        "unicode look-alike": lookalike,
    }


@pytest.mark.parametrize(("name", "accepts", "valid"), VALIDATORS, ids=[v[0] for v in VALIDATORS])
def test_every_validator_matches_the_whole_string(name, accepts, valid):
    assert accepts(valid), f"{name}: the valid value {valid!r} is refused"
    let_through = {k: v for k, v in _corruptions(valid).items() if accepts(v)}
    assert not let_through, f"{name} accepts {let_through}"


@pytest.mark.parametrize(
    "field", ["image", "service_account", "queue", "namespace", "labels", "topology"]
)
def test_a_trailing_newline_never_reaches_a_rendered_jobset(field):
    base = {"name": "run-1", "image": "repo/trainer:1", "config_uri": "gs://b/c.json"}
    bad = {
        "image": {"image": "repo/trainer:1\n"},
        "service_account": {"service_account": "slipway-trainer\n"},
        "queue": {"queue": "tpu-queue\n"},
        "namespace": {"namespace": "training\n"},
        "labels": {"labels": {"team": "a\n"}},
        "topology": {"accelerator": "v5e", "topology": "4x4\n"},
    }[field]
    with pytest.raises((ManifestError, ShapeError)):
        TrainingLaunch(**{**base, **bad}).render()


# -- the run form: check_run_config -------------------------------------------------------------


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags["slipway_pipeline"]


def _form(dag, **conf):
    params = copy.deepcopy(dag.params)
    params.update(conf)
    return params.validate()


def _refused(values: dict) -> str:
    from operators.pipeline.form import check_run_config

    with pytest.raises(RunConfigError) as err:
        check_run_config(values)
    return str(err.value)


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """A platform whose data roots are one corpora folder and one bucket prefix."""
    corpora = tmp_path / "corpora"
    (corpora / "2026").mkdir(parents=True)
    monkeypatch.setenv("SLIPWAY_ALLOWED_DATA_ROOTS", f"{corpora},gs://slipway-data/corpora")
    monkeypatch.setenv("SLIPWAY_DATA_DIR", str(corpora))
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    return corpora


@pytest.mark.parametrize(
    "data_dir",
    ["/", "/etc", "/opt/airflow/dags", "gs://other-bucket/corpora", "gs://slipway-data/corpora2"],
)
def test_data_dir_outside_the_platform_roots_is_refused(dag, roots, data_dir):
    message = _refused(_form(dag, data_dir=data_dir))
    assert f"data_dir {data_dir!r} is outside the data roots" in message
    assert "SLIPWAY_ALLOWED_DATA_ROOTS" in message


def test_data_dir_at_or_below_a_root_is_accepted(dag, roots):
    from operators.pipeline.form import check_run_config
    from operators.settings import data_dir

    for value in (str(roots), str(roots / "2026"), "gs://slipway-data/corpora/2026"):
        check_run_config(_form(dag, data_dir=value))
        assert data_dir(value) == value


def test_a_symlink_out_of_a_root_is_refused(dag, roots):
    (roots / "escape").symlink_to("/etc")
    assert "is outside the data roots" in _refused(_form(dag, data_dir=str(roots / "escape")))


@pytest.mark.parametrize(
    ("stage", "field", "value"),
    [
        ("decontaminate", "eval_sets", ["/var/run/secrets/**", "http://169.254.169.254/x"]),
        ("decontaminate", "eval_sets", []),
        ("tokenize", "tokenizer", "/etc/passwd"),
    ],
)
def test_stage_config_paths_come_from_the_graph_not_the_form(dag, roots, stage, field, value):
    """The eval sets and the tokenizer are the run's (data_dir's eval/ files, its own
    train_tokenizer step): a path in stage_configs would read outside the data roots."""
    from operators.pipeline.graph import StageConfigNotAllowed, build_graph

    values = _form(dag, data_dir=str(roots), stage_configs={stage: {field: value}})
    assert f"stage_configs.{stage}.{field}: not a run setting" in _refused(values)
    with pytest.raises(StageConfigNotAllowed, match=rf"stage_configs\.{stage}\.{field}"):
        build_graph(values)  # refused again where the configs enter the steps


def test_the_forms_data_dir_default_is_the_platforms(monkeypatch, tmp_path):
    from operators.params import pipeline_params

    monkeypatch.setenv("SLIPWAY_DATA_DIR", str(tmp_path / "corpora"))
    assert pipeline_params()["data_dir"].value == str(tmp_path / "corpora")
    monkeypatch.delenv("SLIPWAY_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    assert pipeline_params()["data_dir"].value == str(tmp_path / "data")


def test_every_string_default_is_filled_in(dag):
    # The UI form treats an empty required string as missing: its Trigger button stays
    # disabled (what a new user met). The browser test sees the form itself.
    empty = [name for name, p in dag.params.items() if p.value == "" and p.schema.get("type")]
    assert empty == []


# the platform's namespace and service account (gke_platform), and a cluster it lists
GKE = {
    "namespace": "slipway-training",
    "service_account": "slipway-trainer",
    "cluster_name": "tpu",
    "location": "us-east5",
}
IMAGE = "us-docker.pkg.dev/proj/slipway/slipway-trainer:1"


@pytest.fixture
def gke_platform(monkeypatch):
    """What the Helm chart's ConfigMap sets for a gke deploy."""
    monkeypatch.setenv("SLIPWAY_TRAINING_NAMESPACE", "slipway-training")
    monkeypatch.setenv("SLIPWAY_TRAINER_SERVICE_ACCOUNT", "slipway-trainer")
    monkeypatch.setenv("SLIPWAY_TRAINER_IMAGE", IMAGE)
    monkeypatch.setenv("SLIPWAY_ALLOWED_GKE_CLUSTERS", "us-east5/tpu")
    for name in ("SLIPWAY_ALLOWED_KUBECONFIGS", "SLIPWAY_ALLOWED_GCP_CONN_IDS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _gke(dag, image=IMAGE, **gke):
    return _form(dag, backend="gke", image=image, gke={**GKE, **gke})


def test_the_platforms_own_gke_settings_are_accepted(dag, gke_platform):
    from operators.pipeline.form import check_run_config

    check_run_config(_gke(dag, service_account="slipway-trainer"))
    check_run_config(_gke(dag, gcp_conn_id="google_cloud_default"))
    check_run_config(_gke(dag, image="us-docker.pkg.dev/proj/slipway/slipway-trainer:2"))


@pytest.mark.parametrize(
    ("change", "named", "variable"),
    [
        ({"gcp_conn_id": "someone_elses_gcp"}, "gke.gcp_conn_id", "SLIPWAY_ALLOWED_GCP_CONN_IDS"),
        ({"namespace": "kube-system"}, "gke.namespace", "SLIPWAY_ALLOWED_NAMESPACES"),
        ({"service_account": "cluster-admin"}, "gke.service_account", "ALLOWED_SERVICE_ACCOUNTS"),
        ({"image": "docker.io/evil/trainer:1"}, "image", "SLIPWAY_ALLOWED_IMAGES"),
    ],
)
def test_credentials_identities_and_images_come_from_the_platform(
    dag, gke_platform, change, named, variable
):
    image = change.pop("image", IMAGE)
    message = _refused(_gke(dag, image=image, **change))
    assert f"{named} " in message and "is not allowed by the platform" in message
    assert variable in message


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"cluster_name": "prod"}, "'us-east5/prod'"),
        ({"location": "europe-west4"}, "'europe-west4/tpu'"),
        ({"project_id": "someone-elses"}, "'someone-elses/us-east5/tpu'"),
    ],
)
def test_a_gke_cluster_must_be_one_the_platform_lists(dag, gke_platform, change, named):
    """The platform's GCP identity reaches every cluster its IAM grants: a run names one of
    the platform's (a project given must be listed with it)."""
    from operators.pipeline.form import check_run_config

    message = _refused(_gke(dag, **change))
    assert f"gke cluster {named} is not allowed by the platform" in message
    assert "SLIPWAY_ALLOWED_GKE_CLUSTERS" in message
    gke_platform.setenv("SLIPWAY_ALLOWED_GKE_CLUSTERS", f"us-east5/tpu,{named.strip(chr(39))}")
    check_run_config(_gke(dag, **change))


def test_a_kubeconfig_must_be_one_the_platform_lists(dag, gke_platform, tmp_path):
    from operators.pipeline.form import check_run_config

    kubeconfig = str(tmp_path / "kubeconfig")
    values = _form(
        dag,
        backend="gke",
        image=IMAGE,
        gke={
            "namespace": "slipway-training",
            "service_account": "slipway-trainer",
            "kubeconfig": kubeconfig,
        },
    )
    message = _refused(values)
    assert f"gke.kubeconfig {kubeconfig!r} is not allowed" in message
    gke_platform.setenv("SLIPWAY_ALLOWED_KUBECONFIGS", f"/etc/slipway/kubeconfig,{kubeconfig}")
    check_run_config(values)


def test_local_runs_name_no_cluster_credentials(dag):
    message = _refused(_form(dag, gke={"kubeconfig": "/root/.kube/config"}))
    assert "gke.kubeconfig: only a backend=gke run names cluster credentials" in message


def test_a_directrunner_runs_dataflow_values_are_checked_though_unused(dag):
    """The form's `dataflow` object only matters on DataflowRunner; given on DirectRunner its
    values are still checked (every one named), and valid ones pass."""
    message = _refused(
        _form(
            dag,
            runner="DirectRunner",
            dataflow={
                "project_id": "not a project\n",
                "location": "mars",
                "sdk_container_image": "reg.io/p/slipway-beam:latest",
                "max_num_workers": 5,
            },
        )
    )
    assert "dataflow.project_id 'not a project\\n' is not a GCP project id" in message
    assert "dataflow.location 'mars' is not a Dataflow region" in message
    assert "dataflow.sdk_container_image" in message and "max_num_workers" not in message
    from operators.pipeline.form import check_run_config

    check_run_config(
        _form(
            dag, runner="DirectRunner", dataflow={"location": "europe-west4", "max_num_workers": 5}
        )
    )


def test_dataflow_identity_and_image_come_from_the_platform(dag, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", "gs://slipway-data/home")
    monkeypatch.setenv("SLIPWAY_DATA_DIR", "gs://slipway-data/corpora")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_SERVICE_ACCOUNT", "df@proj-1.iam.gserviceaccount.com")
    values = _form(
        dag,
        runner="DataflowRunner",
        dataflow={
            "project_id": "proj-1",
            "location": "us-central1",
            "temp_location": "gs://slipway-data/tmp",
            "sdk_container_image": "docker.io/evil/beam:1",
            "service_account": "owner@proj-1.iam.gserviceaccount.com",
        },
    )
    message = _refused(values)
    assert "dataflow.service_account 'owner@proj-1.iam.gserviceaccount.com' is not allowed" in (
        message
    )
    assert "dataflow.sdk_container_image 'docker.io/evil/beam:1' is not allowed" in message


@pytest.fixture
def dataflow_platform(monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", "gs://slipway-data/home")
    monkeypatch.setenv("SLIPWAY_DATA_DIR", "gs://slipway-data/corpora")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_PROJECT_ID", "proj-1")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_LOCATION", "us-central1")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_TEMP_LOCATION", "gs://slipway-data/dataflow/tmp")
    monkeypatch.setenv("SLIPWAY_DATAFLOW_SDK_CONTAINER_IMAGE", "us-docker.pkg.dev/p/s/beam:1")
    for name in ("SLIPWAY_ALLOWED_DATAFLOW_PROJECTS", "SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _dataflow(dag, settings):
    return _form(
        dag, runner="DataflowRunner", data_dir="gs://slipway-data/corpora", dataflow=settings
    )


@pytest.mark.parametrize(
    ("change", "named", "variable"),
    [
        ({"project_id": "someone-elses-proj"}, "project_id", "SLIPWAY_ALLOWED_DATAFLOW_PROJECTS"),
        ({"temp_location": "gs://attacker/t"}, "temp_location", "ALLOWED_DATAFLOW_LOCATIONS"),
        ({"temp_location": "gs://slipway-data/home2"}, "temp_location", "ALLOWED_DATAFLOW_LOC"),
        ({"temp_location": "gs://slipway-data/home/../x"}, "temp_location", "ALLOWED_DATAFLOW"),
    ],
)
def test_dataflow_projects_and_buckets_come_from_the_platform(
    dag, dataflow_platform, change, named, variable
):
    """The platform's identities stage files in, and run jobs in, only the platform's own
    projects and buckets (or the allow-listed ones)."""
    message = _refused(_dataflow(dag, change))
    assert f"dataflow.{named} {change[named]!r} is not allowed by the platform" in message
    assert variable in message


def test_the_platforms_own_dataflow_projects_and_buckets_are_accepted(dag, dataflow_platform):
    from operators.pipeline.form import check_run_config

    for change in (
        {"project_id": "proj-1"},
        {"temp_location": "gs://slipway-data/dataflow/tmp/run-1"},  # below the platform's
        {"temp_location": "gs://slipway-data/home/tmp"},  # below the storage root
    ):
        check_run_config(_dataflow(dag, change))
    dataflow_platform.setenv("SLIPWAY_ALLOWED_DATAFLOW_PROJECTS", "proj-2")
    dataflow_platform.setenv("SLIPWAY_ALLOWED_DATAFLOW_LOCATIONS", "gs://team-scratch/")
    check_run_config(
        _dataflow(dag, {"project_id": "proj-2", "temp_location": "gs://team-scratch/df"})
    )


def test_a_storage_root_from_the_airflow_variable_is_the_platforms_bucket_too(
    dag, dataflow_platform
):
    """Step outputs follow the Variable ``slipway_home`` when ``$SLIPWAY_HOME`` is unset; so
    does what the policy calls the platform's storage root."""
    from operators import settings
    from operators.pipeline.form import check_run_config
    from operators.policy import PolicyViolation, enforce

    dataflow_platform.delenv("SLIPWAY_HOME")
    dataflow_platform.setattr(
        settings,
        "_variable",
        lambda key: "gs://slipway-data/home" if key == "slipway_home" else None,
    )
    below_root = _dataflow(dag, {"temp_location": "gs://slipway-data/home/tmp"})
    check_run_config(below_root)
    enforce(below_root)
    beside_root = _dataflow(dag, {"temp_location": "gs://slipway-data/home2/tmp"})
    with pytest.raises(PolicyViolation, match=r"dataflow\.temp_location 'gs://slipway-data/home2"):
        enforce(beside_root)


def test_a_kube_context_needs_an_allowed_kubeconfig(dag, gke_platform, tmp_path):
    """Alone, a context would pick a user of the worker's default kubeconfig."""
    from operators.pipeline.form import check_run_config

    message = _refused(_gke(dag, context="prod-cluster-admin"))
    assert "gke.context 'prod-cluster-admin': names a context of gke.kubeconfig" in message
    kubeconfig = str(tmp_path / "kubeconfig")
    gke_platform.setenv("SLIPWAY_ALLOWED_KUBECONFIGS", kubeconfig)
    check_run_config(
        _form(
            dag,
            backend="gke",
            image=IMAGE,
            gke={
                "namespace": "slipway-training",
                "service_account": "slipway-trainer",
                "kubeconfig": kubeconfig,
                "context": "training",
            },
        )
    )


def test_the_policy_is_enforced_where_values_are_used_too(dag, gke_platform, dataflow_platform):
    """A run whose validate task was marked successful by hand still cannot launch with what
    the platform refuses: the trainer launch and the Dataflow launch check again."""
    from operators.beam_stage import BeamStageOperator
    from operators.launching import trainer_launch
    from operators.policy import PolicyViolation

    refused = _gke(dag, service_account="cluster-admin")
    with pytest.raises(PolicyViolation, match=r"gke\.service_account 'cluster-admin'"):
        trainer_launch("train-x", refused, config_uri="gs://slipway-data/home/c.json")
    trainer_launch("train-x", _gke(dag), config_uri="gs://slipway-data/home/c.json")
    # A gke object without a namespace (refused by validate) never falls to "default" here.
    no_namespace = _gke(dag)
    no_namespace["gke"] = {k: v for k, v in no_namespace["gke"].items() if k != "namespace"}
    with pytest.raises(PolicyViolation, match=r"gke\.namespace: a gke run names"):
        trainer_launch("train-x", no_namespace, config_uri="gs://slipway-data/home/c.json")
    stage = BeamStageOperator(stage_task="ingest")
    flow = _dataflow(dag, {"temp_location": "gs://attacker/t"})
    with pytest.raises(PolicyViolation, match=r"dataflow\.temp_location 'gs://attacker/t'"):
        stage._dataflow_job(None, flow, None, {"output": "gs://slipway-data/home/x"})


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"learning_rate": float("nan")}, "learning_rate: must be a finite number"),
        ({"heldout_fraction": float("nan")}, "heldout_fraction: must be a finite number"),
        (
            {"sources": [{"name": "brown", "weight": float("nan")}]},
            "sources[0].weight: must be a finite number",
        ),
        # The gate's thresholds: every comparison with NaN is false, so it would pass nothing
        # (or, as a regression margin, everything).
        (
            {"gate_max_bits_per_byte": float("nan")},
            "gate_max_bits_per_byte: must be a finite number",
        ),
        (
            {"gate_min_accuracy": {"piqa": float("nan")}},
            "gate_min_accuracy.piqa: must be a finite number",
        ),
        ({"gate_max_regression": float("nan")}, "gate_max_regression: must be a finite number"),
    ],
)
def test_non_finite_numbers_are_refused(dag, conf, named):
    assert named in _refused(_form(dag, **conf))


def test_infinity_past_the_schema_is_refused_too(dag):
    values = _form(dag)  # the schema's maximum refuses inf; check_run_config does not rely on it
    values["learning_rate"] = float("inf")
    assert "learning_rate: must be a finite number, got inf" in _refused(values)


def test_nan_deep_in_a_stage_config_is_refused(dag):
    configs = copy.deepcopy(dag.params["stage_configs"])
    configs["fuzzy_dedup"] = {"threshold": float("nan")}
    message = _refused(_form(dag, stage_configs=configs))
    assert "stage_configs.fuzzy_dedup.threshold: must be a finite number" in message


@pytest.mark.parametrize(
    ("stage", "config", "named"),
    [
        ("decontaminate", {"ngrams": 13}, "stage_configs.decontaminate: unknown config field"),
        ("decontaminate", {"ngram": "13"}, "stage_configs.decontaminate: ngram: expected an int"),
        ("decontaminate", {"ngram": 0}, "stage_configs.decontaminate: invalid"),
        ("fuzzy_dedup", {"threshold": 1.5}, "stage_configs.fuzzy_dedup: invalid"),
        ("exact_dedup", {"dedup_documents": "yes"}, "stage_configs.exact_dedup: dedup_documents"),
        ("quality", {"sources": {"brown": {"min_wordz": 3}}}, "stage_configs.quality: invalid"),
        ("tokenize", {"batch_docs": 0}, "stage_configs.tokenize: invalid"),
        ("train_tokenizer", {"vocab_size": 10}, "stage_configs.train_tokenizer: invalid"),
        # Values that would size the work before any data is read have an upper bound too.
        ("fuzzy_dedup", {"max_rounds": 10**7}, "max_rounds must be <= 64, not 10000000"),
        ("fuzzy_dedup", {"num_perm": 10**9}, "num_perm must be <= 4096"),
        ("fuzzy_dedup", {"batch_size": 10**9}, "batch_size must be <= 65536"),
        ("train_tokenizer", {"vocab_size": 10**9}, "vocab_size must be <= 1048576"),
        ("train_tokenizer", {"num_threads": 10**6}, "num_threads must be <= 256"),
        ("tokenize", {"encode_threads": 10**6}, "encode_threads must be <= 256"),
        ("tokenize", {"batch_docs": 10**12}, "batch_docs must be <= 65536"),
    ],
)
def test_every_stage_config_is_checked(dag, stage, config, named):
    configs = copy.deepcopy(dag.params["stage_configs"])
    configs[stage] = config
    assert named in _refused(_form(dag, stage_configs=configs))


def test_the_validate_task_refuses_before_any_data_and_records_it(dag, tmp_path, monkeypatch):
    from operators.lineage import LineageStore
    from operators.validate import ValidateRunOperator

    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SLIPWAY_DATA_DIR", str(tmp_path / "no-corpora-here"))
    configs = copy.deepcopy(dag.params["stage_configs"])
    configs["decontaminate"] = {"ngrams": 13}
    params = _form(dag, stage_configs=configs, learning_rate=0.01)
    task = dag.get_task("validate")
    assert isinstance(task, ValidateRunOperator) and dag.get_task("fetch").upstream_task_ids == {
        "validate"
    }
    with pytest.raises(RunConfigError, match=r"stage_configs\.decontaminate"):
        task.execute({"params": params, "run_id": "bad_run"})
    assert not (tmp_path / "no-corpora-here").exists()  # nothing fetched, nothing read
    url = f"sqlite:///{tmp_path / 'home' / 'lineage.db'}"
    with LineageStore(url, create=False) as store:
        (node,) = store.run_graph("bad_run").steps
        run = store.run_graph("bad_run").run
        [listed] = store.runs()
    assert (node.execution.name, str(node.execution.state)) == ("validate", "FAILED")
    assert "stage_configs.decontaminate: unknown config field" in node.execution.error
    # What was refused stays readable on the run: the values, and which left their defaults.
    assert run.properties["params"]["learning_rate"] == 0.01
    assert run.properties["params"]["stage_configs"]["decontaminate"] == {"ngrams": 13}
    assert run.properties["changed"] == ["learning_rate", "stage_configs"]
    assert listed.properties == run.properties


# -- `slipway plan --conf`: the same checks from a shell ------------------------------------------


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"image": "repo/trainer:1\n"}, "image"),
        ({"backend": "gke", "gke": {"namespace": "training\n"}}, "gke.namespace"),
        ({"data_dir": "/etc"}, "data_dir '/etc' is outside the data roots"),
        (
            {"backend": "gke", "gke": {"namespace": "t", "kubeconfig": "/root/.kube/config"}},
            "gke.kubeconfig '/root/.kube/config' is not allowed",
        ),
        (
            {
                "backend": "gke",
                "gke": {
                    "namespace": "t",
                    "cluster_name": "c",
                    "location": "us-east5",
                    "gcp_conn_id": "prod_admin",
                },
            },
            "gke.gcp_conn_id 'prod_admin' is not allowed",
        ),
        ({"learning_rate": "NaN"}, "learning_rate: must be a finite number"),
        ({"model_name": "Slipway Demo"}, "model_name"),
        ({"gate_min_accuracy": {"mmlu_5shot": 0.3}}, "gate_min_accuracy.mmlu_5shot"),
        (
            {"stage_configs": {"decontaminate": {"ngrams": 13}}},
            "stage_configs.decontaminate: unknown config field(s) for DecontaminateConfig: ngrams",
        ),
        # not an object: once a traceback (null), or fields named s, t, e, p ("steps")
        (None, "a JSON object of form fields, not NoneType"),
        ("steps", "a JSON object of form fields, not str"),
    ],
)
def test_slipway_plan_refuses_naming_the_field(tmp_path, conf, named):
    text = json.dumps(conf).replace('"NaN"', "NaN")  # JSON has no NaN; Python's parser does
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPWAY_ALLOWED_")}
    env["SLIPWAY_HOME"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "operators.cli", "plan", "--conf", text],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result
    assert named in result.stderr, result.stderr


def test_slipway_plan_without_corpora_or_a_home_says_what_to_do(tmp_path):
    """A new user's first `slipway plan`: no corpora yet, no $SLIPWAY_HOME. It says to fetch
    the corpora, and where it plans, without importing Airflow (which writes ~/airflow)."""
    from operators.pipeline.form import SOURCES
    from tests.support.tiny_pipeline import make_corpora

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPWAY_", "AIRFLOW"))}
    env["HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])

    def plan(cwd: Path) -> subprocess.CompletedProcess:
        cwd.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "operators.cli", "plan"]
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)

    bare = plan(tmp_path / "fresh")
    assert bare.returncode == 2, bare.stderr
    assert "raw/brown.jsonl.gz is missing: fetch the corpora first (make corpora)" in bare.stderr
    make_corpora(tmp_path / "clone" / "data", SOURCES)  # the form's default mixture
    planned = plan(tmp_path / "clone")
    assert planned.returncode == 0, planned.stderr
    assert f"planning against {tmp_path / 'clone' / 'out' / 'steps'}" in planned.stderr
    assert "never run" in planned.stdout
    assert not (tmp_path / "home" / "airflow").exists()


def test_the_trainers_own_checks_run_on_the_config_train_will_write(dag):
    # The trainer's validation of the config file the train step writes, in the first task.
    message = _refused(_form(dag, sources=[{"name": "brown", "weight": 0}]))
    assert "trainer config: data.sources: weights must not all be 0" in message
