"""The pipeline DAG's run form: Airflow Params with JSON schemas, and their cross-checks.

Airflow validates each Param against its JSON schema when a run is triggered (UI form, REST,
``airflow dags trigger/test``), so a bad value is refused before any task starts. JSON schema
cannot express rules across fields (a topology offered for the chosen TPU type, weights that
are not all zero), so :func:`check_run_config` does those; the DAG's first task calls it and
fails in seconds, before any data is read.

Importable at DAG parse time: Airflow's ``Param`` and the standard library only.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from airflow.sdk import Param

# Training corpora `pipelines.corpora.fetch` knows (data/raw/<name>.jsonl.gz).
SOURCES = ("brown", "factbook", "fortunes", "python-stdlib", "spam-assassin")
# trainer/model.py PRESETS (a unit test checks they agree; importing it here would pull in JAX).
MODEL_PRESETS = ("nano", "30m", "75m", "150m", "300m", "600m", "1.4b", "8b")
# operators/jobset/catalogue.py names (a unit test checks they agree).
ACCELERATORS = ("cpu", "v4", "v5e", "v5p", "v6e", "tpu7x")
BACKENDS = ("local", "gke")
RUNNERS = ("DirectRunner", "DataflowRunner")
STAGES = (
    "ingest",
    "quality",
    "exact_dedup",
    "fuzzy_dedup",
    "decontaminate",
    "train_tokenizer",
    "tokenize",
)

DEFAULT_MIXTURE = [
    {"name": "brown", "weight": 0.35},
    {"name": "python-stdlib", "weight": 0.25},
    {"name": "factbook", "weight": 0.15},
    {"name": "fortunes", "weight": 0.15},
    {"name": "spam-assassin", "weight": 0.10},
]


def _demo_stage_configs() -> dict[str, Any]:
    """The data plane's per-stage defaults (``pipelines/demo_config.json``), read as a file.

    Found through the import system without importing ``pipelines`` (parse time stays light).
    The tokenizer vocabulary is made small: the default run trains a nano model.
    """
    spec = find_spec("pipelines")
    configs: dict[str, Any] = {}
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "demo_config.json"
        if path.exists():
            configs = json.loads(path.read_text())
    configs = {stage: dict(configs.get(stage, {})) for stage in STAGES}
    configs["train_tokenizer"].setdefault("vocab_size", 2048)
    return configs


DATA_DIR_PATTERN = r"^(?!.*(^|/)\.\.(/|$))(|/[^\s\x00-\x1f]*|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s\x00-\x1f]*)?)$"


def pipeline_params() -> dict[str, Param]:
    """The run form. Defaults: the tiny run that ``make demo`` does on two cores."""
    return {
        "sources": Param(
            copy.deepcopy(DEFAULT_MIXTURE),
            type="array",
            minItems=1,
            uniqueItems=True,
            title="Sources and mixture weights",
            description="Training corpora and their sampling weights (normalised; not all 0).",
            items={
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": list(SOURCES)},
                    "weight": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["name", "weight"],
                "additionalProperties": False,
            },
        ),
        "model_preset": Param(
            "nano", type="string", enum=list(MODEL_PRESETS), title="Model preset"
        ),
        "steps": Param(200, type="integer", minimum=1, maximum=10_000_000, title="Train steps"),
        "batch_size": Param(
            16, type="integer", minimum=1, maximum=65_536, title="Global batch (sequences)"
        ),
        "seq_len": Param(128, type="integer", minimum=8, maximum=131_072, title="Sequence length"),
        "learning_rate": Param(
            3e-3, type="number", exclusiveMinimum=0, maximum=1, title="Peak learning rate"
        ),
        "warmup_steps": Param(20, type="integer", minimum=0, title="Warmup steps"),
        "seed": Param(0, type="integer", minimum=0, maximum=2**31 - 1, title="Seed"),
        "accelerator": Param(
            "cpu", type="string", enum=list(ACCELERATORS), title="Accelerator (TPU type)"
        ),
        "topology": Param(
            "1",
            type="string",
            pattern=r"^[0-9]+(x[0-9]+){0,2}$",
            title="Topology",
            description="TPU topology (2x2x4, 4x4) or, for cpu, the number of local processes.",
        ),
        "slices": Param(1, type="integer", minimum=1, maximum=64, title="Slices"),
        "backend": Param("local", type="string", enum=list(BACKENDS), title="Training backend"),
        "runner": Param("DirectRunner", type="string", enum=list(RUNNERS), title="Beam runner"),
        "dataflow": Param(
            {},
            type="object",
            title="Dataflow settings",
            description="For DataflowRunner: project_id, location, temp_location, "
            "sdk_container_image, service_account, max_num_workers.",
            properties={
                "project_id": {"type": "string"},
                "location": {"type": "string"},
                "temp_location": {"type": "string", "pattern": "^gs://"},
                "sdk_container_image": {"type": "string"},
                "service_account": {"type": "string"},
                "max_num_workers": {"type": "integer", "minimum": 1},
            },
            additionalProperties=False,
        ),
        "gke": Param(
            {},
            type="object",
            title="GKE settings",
            description="For backend=gke: namespace (required) and one credentials source -- "
            "cluster_name + location [+ project_id, gcp_conn_id] (GKE via a GCP connection), "
            "kubeconfig [+ context], or in_cluster -- plus an optional Workload-Identity "
            "service_account and Kueue queue.",
            properties={
                "namespace": {"type": "string"},
                "cluster_name": {"type": "string"},
                "location": {"type": "string"},
                "project_id": {"type": "string"},
                "gcp_conn_id": {"type": "string"},
                "use_internal_ip": {"type": "boolean"},
                "kubeconfig": {"type": "string"},
                "context": {"type": "string"},
                "in_cluster": {"type": "boolean"},
                "service_account": {"type": "string"},
                "queue": {"type": "string"},
            },
            additionalProperties=False,
        ),
        "image": Param(
            "slipway/trainer:dev",
            type="string",
            minLength=1,
            title="Trainer image",
            description="Ignored by the local backend (it runs this interpreter).",
        ),
        "stage_configs": Param(
            _demo_stage_configs(),
            type="object",
            title="Per-stage configs",
            description="JSON config of each data-plane stage (pipelines/<stage>.py).",
            properties={stage: {"type": "object"} for stage in STAGES},
            additionalProperties=False,
        ),
        "num_shards": Param(4, type="integer", minimum=1, maximum=4096, title="Shards per stage"),
        "heldout_fraction": Param(
            0.02, type="number", exclusiveMinimum=0, maximum=0.5, title="Held-out fraction"
        ),
        "eval_max_tokens": Param(
            65_536, type="integer", minimum=1, title="Eval tokens per store (cap)"
        ),
        "data_dir": Param(
            "",
            type="string",
            # An absolute local folder or a gs:// prefix: no relative paths (a task's working
            # directory is nobody's business), no `..` segments, no whitespace or controls.
            pattern=DATA_DIR_PATTERN,
            title="Corpora folder",
            description="Holds raw/ and eval/: an absolute folder or gs://bucket/prefix "
            "(default $SLIPWAY_DATA_DIR or ./data).",
        ),
        "fail_at_step": Param(
            0,
            type="integer",
            minimum=0,
            title="Fault injection: stop training at step",
            description="0 = off. Otherwise the training task pre-empts the JobSet once the "
            "trainer logs this step (it checkpoints and stops) and fails the task; a retry "
            "or cleared task resumes from that checkpoint.",
        ),
    }


class RunConfigError(ValueError):
    """A run form whose fields are each valid but do not fit together."""


@dataclass(frozen=True)
class Source:
    name: str
    weight: float


def sources_of(params: Mapping[str, Any]) -> tuple[Source, ...]:
    return tuple(Source(str(s["name"]), float(s["weight"])) for s in params["sources"])


# The `gke` object's keys that say where the cluster is (operators.jobset.gke.ClusterSettings;
# a unit test checks they agree), and those that go into the manifest.
GKE_CLUSTER_KEYS = (
    "namespace",
    "kubeconfig",
    "context",
    "in_cluster",
    "gcp_conn_id",
    "project_id",
    "location",
    "cluster_name",
    "use_internal_ip",
)
GKE_LAUNCH_KEYS = ("service_account", "queue")
DEV_IMAGE = "slipway/trainer:dev"  # the form's default: runs locally, pullable by no cluster
_GCP_LOCATION = re.compile(r"^[a-z]+-[a-z]+[0-9]+(-[a-z])?$")  # us-central2, us-east5-a
_GCP_PROJECT = re.compile(r"^([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_GKE_CLUSTER = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


def gke_cluster(params: Mapping[str, Any]) -> dict[str, Any]:
    """The run form's cluster settings (:class:`~operators.jobset.gke.ClusterSettings` dict)."""
    gke = params.get("gke") or {}
    return {k: gke[k] for k in GKE_CLUSTER_KEYS if k in gke}


def _gke_problems(params: Mapping[str, Any]) -> list[str]:
    """backend=gke: the settings a GKE launch needs, checked before any task runs."""
    from operators.jobset.gke import ClusterSettings

    gke = params.get("gke") or {}
    problems: list[str] = []
    if not gke.get("namespace"):
        problems.append("gke.namespace: backend=gke needs the training namespace")
    # The backend's own checks: namespace a DNS-1123 label, one credentials source, ...
    settings = ClusterSettings.from_dict(gke_cluster(params))
    problems += [f"gke.{p}" for p in settings.problems()]
    if gke.get("cluster_name") and not _GKE_CLUSTER.match(gke["cluster_name"]):
        problems.append(
            f"gke.cluster_name {gke['cluster_name']!r}: lowercase letters, digits and '-', "
            "starting with a letter, at most 40 characters"
        )
    if gke.get("location") and not _GCP_LOCATION.match(gke["location"]):
        problems.append(
            f"gke.location {gke['location']!r}: a GCP region or zone (us-central2, us-east5-a)"
        )
    if gke.get("project_id") and not _GCP_PROJECT.match(gke["project_id"]):
        problems.append(f"gke.project_id {gke['project_id']!r}: not a GCP project id")
    if params.get("image") == DEV_IMAGE:
        problems.append(
            f"image: {DEV_IMAGE} is the local default; backend=gke needs the trainer image in "
            "a registry the cluster can pull (e.g. us-docker.pkg.dev/<project>/<repo>/trainer:<tag>)"
        )
    if params.get("fail_at_step"):
        problems.append("fail_at_step: fault injection is for backend=local only")
    return problems


def check_run_config(params: Mapping[str, Any]) -> None:
    """Cross-field checks JSON schema cannot express. Raises :class:`RunConfigError`."""
    # Lazy: the catalogue is cheap, but keep parse-time imports to Param only.
    from operators.jobset import ManifestError, TrainingLaunch

    problems: list[str] = []
    sources = sources_of(params)
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        problems.append(f"sources: a source is listed twice ({names})")
    if not any(s.weight > 0 and math.isfinite(s.weight) for s in sources):
        problems.append("sources: mixture weights must not all be 0")
    if params["warmup_steps"] > params["steps"]:
        problems.append(
            f"warmup_steps: {params['warmup_steps']} is more than steps ({params['steps']})"
        )
    if params["fail_at_step"] and params["fail_at_step"] >= params["steps"]:
        problems.append(
            f"fail_at_step: {params['fail_at_step']} must be below steps ({params['steps']})"
        )
    if params["backend"] == "gke":
        problems.extend(_gke_problems(params))
    if params["runner"] == "DataflowRunner":
        missing = [
            k for k in ("project_id", "location", "temp_location") if not params["dataflow"].get(k)
        ]
        if missing:
            problems.append(f"dataflow: DataflowRunner needs {', '.join(missing)}")
    try:
        TrainingLaunch(
            name="check",
            image=params["image"],
            config_uri="check.json",
            accelerator=params["accelerator"],
            topology=params["topology"],
            slices=params["slices"],
        )
    except ManifestError as exc:
        problems.append(f"accelerator/topology/slices: {exc}")
    if params["backend"] == "gke":
        gke = params.get("gke") or {}
        # Service account and queue go into the manifest: the renderer's own checks.
        for key in GKE_LAUNCH_KEYS:
            if gke.get(key):
                try:
                    TrainingLaunch(
                        name="check", image="check", config_uri="check.json", **{key: gke[key]}
                    )
                except ManifestError as exc:
                    problems.append(f"gke.{key}: {exc}")
    if problems:
        raise RunConfigError("invalid run configuration:\n  " + "\n  ".join(problems))
