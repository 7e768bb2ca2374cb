"""The pipeline's run form: each field's default and JSON schema, and the checks across fields.

Airflow-free: ``operators/params.py`` wraps each field in an Airflow ``Param``, which Airflow
validates against its schema when a run is triggered (UI form, REST, ``airflow dags
trigger/test``), so a bad value is refused before any task starts; :func:`form_values` applies
the same schemas (``jsonschema``, as Airflow does) without Airflow. JSON schema
cannot express rules across fields (a topology offered for the chosen TPU type, weights that
are not all zero), so :func:`check_run_config` does those; the DAG's first task calls it and
fails in seconds, before any data is read.

Why over 500 lines: most of it is the form itself (about 240 lines of field schemas, titles and
descriptions the UI shows); the checks across fields belong beside the fields they relate.

A platform deploy pre-fills the form: the training fields' defaults come from the Helm
chart's ConfigMap (``slipway-config``, environment variables of every Airflow container; see
:data:`PLATFORM_ENV`), read when the DAG is parsed. Environment only: an Airflow Variable or
connection lookup at parse time would hit the metadata database on every parse.

Importable at DAG parse time: ``jsonschema`` and the standard library only.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from operators import naming
from operators.pipeline.definition import STAGES
from operators.promotion import HELDOUT_PREFIX, MODEL_NAME_BODY
from operators.settings import absolute
from trainer.shapes import PRESETS
from trainer.tasks import TASK_NAMES

# Training corpora `pipelines.corpora.fetch` knows (data/raw/<name>.jsonl.gz).
SOURCES = ("brown", "factbook", "fortunes", "python-stdlib", "spam-assassin")
MODEL_PRESETS = tuple(PRESETS)  # trainer/shapes.py: JAX-free, cheap at parse time
# operators/jobset/catalogue.py names (a unit test checks they agree).
ACCELERATORS = ("cpu", "v4", "v5e", "v5p", "v6e", "tpu7x")
BACKENDS = ("local", "gke")
RUNNERS = ("DirectRunner", "DataflowRunner")

# What `python -m trainer.export --dtype` writes (trainer/export.py WEIGHT_DTYPES; a unit test
# checks they agree: importing it here would pull numpy into every DAG parse).
EXPORT_DTYPES = ("float32", "bfloat16")

# The benchmark tasks a run evaluates by default: the zero-shot suite (MMLU's 5-shot variant
# is left to those who ask for it: five worked examples in every prompt).
DEFAULT_EVAL_TASKS = (
    "arc_easy",
    "arc_challenge",
    "boolq",
    "hellaswag",
    "piqa",
    "winogrande",
    "lambada_openai",
    "mmlu",
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
    """
    spec = find_spec("pipelines")
    configs: dict[str, Any] = {}
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "demo_config.json"
        if path.exists():
            configs = json.loads(path.read_text())
    return {stage: dict(configs.get(stage, {})) for stage in STAGES}


# The form's training defaults a platform deploy sets (charts/slipway ConfigMap keys): form
# field, or "gke.<key>" for a key of the `gke` object -> environment variable.
PLATFORM_ENV = {
    "backend": "SLIPWAY_TRAINING_BACKEND",
    "image": "SLIPWAY_TRAINER_IMAGE",
    "accelerator": "SLIPWAY_TPU_ACCELERATOR",
    "topology": "SLIPWAY_TPU_TOPOLOGY",
    "slices": "SLIPWAY_TPU_SLICES",
    "gke.namespace": "SLIPWAY_TRAINING_NAMESPACE",
    "gke.service_account": "SLIPWAY_TRAINER_SERVICE_ACCOUNT",
    "gke.queue": "SLIPWAY_KUEUE_QUEUE",
    "gke.tpu_zone": "SLIPWAY_TPU_ZONE",
    "data_dir": "SLIPWAY_DATA_DIR",
}
# The form's default image: the local build of the trainer image (docker/README.md). The local
# backend ignores it (it runs this interpreter); no cluster can pull it, so gke refuses it.
DEV_IMAGE = "slipway-trainer:dev"


class PlatformDefaultsError(ValueError):
    """A platform default (environment variable) the form's own schema refuses."""


def platform_defaults(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The form defaults set in the environment (:data:`PLATFORM_ENV`); unset or empty ones
    are left out. ``gke.<key>`` entries are gathered into a ``gke`` object."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for field, name in PLATFORM_ENV.items():
        value = environ.get(name, "").strip()
        if not value:
            continue
        if field == "data_dir":
            found[field] = absolute(value)  # what a task would read
        elif field == "slices":
            # Left as text when not a number: the schema check names it.
            found[field] = int(value) if value.isascii() and value.isdigit() else value
        elif field.startswith("gke."):
            found.setdefault("gke", {})[field.removeprefix("gke.")] = value
        else:
            found[field] = value
    return found


def _check_platform_defaults(
    fields: Mapping[str, Mapping[str, Any]], defaults: Mapping[str, Any]
) -> None:
    """Refuse, at parse time and naming the variables, platform defaults the schema refuses:
    otherwise every run with the pre-filled form would be refused, far from the cause."""
    problems = []
    for name in defaults:
        reason = schema_problem(fields[name], fields[name]["default"])
        if reason is not None:
            names = sorted(n for f, n in PLATFORM_ENV.items() if f.split(".")[0] == name)
            problems.append(f"{', '.join(names)} (form field {name}): {reason}")
    if problems:
        raise PlatformDefaultsError(
            "invalid platform defaults for the run form:\n  " + "\n  ".join(problems)
        )


def full_match(body: str) -> str:
    """A JSON-schema ``pattern`` that must match the whole value. Airflow checks patterns with
    Python's ``re.search``, where ``$`` also matches before a final newline, so ``(?!\\n)``
    follows it; the browser form's ECMAScript regexes read the same pattern the same way."""
    return f"^(?:{body})$(?!\\n)"


# Empty (the platform's folder), or an absolute local folder or a gs:// prefix in plain path
# characters (spaces allowed locally):
# no relative paths (a task's working directory is nobody's business), no segment starting with
# "." (so no `..`), no tabs, newlines, controls or unicode look-alikes. Which roots it may lie
# under is checked at run time (operators.settings.data_dir), where the platform's are known.
_LOCAL_PART = r"[A-Za-z0-9_~+=,@-][A-Za-z0-9._~+=,@ -]*"
_GCS_PART = r"[A-Za-z0-9_~+=,@-][A-Za-z0-9._~+=,@-]*"
DATA_DIR_PATTERN = full_match(
    rf"|/|(/{_LOCAL_PART})+/?|gs://[a-z0-9][a-z0-9._-]{{1,220}}[a-z0-9](/{_GCS_PART})*/?"
)
TOPOLOGY_PATTERN = full_match(r"[0-9]+(x[0-9]+){0,2}")
MODEL_NAME_PATTERN = full_match(MODEL_NAME_BODY)


def field(default: Any, **schema: Any) -> dict[str, Any]:
    """One form field: its default and its JSON schema (title and description included)."""
    return {"default": default, **schema}


def schema_of(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "default"}


def schema_problem(spec: Mapping[str, Any], value: Any) -> str | None:
    """Why ``value`` fails the field's schema (checked as Airflow's ``Param.resolve`` checks
    it), or None."""
    import jsonschema

    try:
        jsonschema.validate(value, schema_of(spec), format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as exc:
        return exc.message
    return None


def check_value(name: str, spec: Mapping[str, Any], value: Any) -> Any:
    """``value`` if it passes field ``name``'s schema, else :class:`RunConfigError` naming the
    field and the reason."""
    problem = schema_problem(spec, value)
    if problem is not None:
        raise RunConfigError(f"{name}: {problem}")
    return value


def form_fields(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The run form, field -> {default, schema}. Defaults: the tiny run that ``make demo``
    does on two cores, with the training fields a platform deploy sets in the environment
    (:func:`platform_defaults`), each checked against its own schema."""
    platform = platform_defaults(environ)
    fields = _form(platform)
    _check_platform_defaults(fields, platform)
    batch = fields["batch_size"]
    batch["default"] = _batch_the_mesh_splits(fields, batch["default"])
    return fields


def _batch_the_mesh_splits(fields: Mapping[str, Mapping[str, Any]], batch: int) -> int:
    """``batch`` rounded up to a multiple of the default mesh's data-parallel size on the
    form's default slices: a platform's 2 x 4x4 v5e splits the batch 32 ways, and a default
    of 16 would make every pre-filled form invalid. Unchanged where the shape is unknown
    (validate names the field)."""
    from operators.jobset import ManifestError, TrainingLaunch

    try:
        shape = TrainingLaunch(
            name="check",
            image=_CHECK_IMAGE,
            config_uri="check.json",
            accelerator=fields["accelerator"]["default"],
            topology=fields["topology"]["default"],
            slices=fields["slices"]["default"],
        ).shape
    except ManifestError:
        return batch
    # Without a mesh override every chip is on a batch axis (replica, then data or fsdp,
    # whichever fills the slice; tensor 1), so no preset needs sizing here at parse time.
    dp = shape.chips_per_slice * shape.slices
    return -(-batch // dp) * dp


def _form(platform: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "sources": field(
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
        "model_preset": field(
            "nano", type="string", enum=list(MODEL_PRESETS), title="Model preset"
        ),
        "steps": field(200, type="integer", minimum=1, maximum=10_000_000, title="Train steps"),
        "batch_size": field(
            16, type="integer", minimum=1, maximum=65_536, title="Global batch (sequences)"
        ),
        "seq_len": field(128, type="integer", minimum=8, maximum=131_072, title="Sequence length"),
        "learning_rate": field(
            3e-3, type="number", exclusiveMinimum=0, maximum=1, title="Peak learning rate"
        ),
        "warmup_steps": field(20, type="integer", minimum=0, title="Warmup steps"),
        "seed": field(0, type="integer", minimum=0, maximum=2**31 - 1, title="Seed"),
        "accelerator": field(
            platform.get("accelerator", "cpu"),
            type="string",
            enum=list(ACCELERATORS),
            title="Accelerator (TPU type)",
        ),
        "topology": field(
            platform.get("topology", "1"),
            type="string",
            pattern=TOPOLOGY_PATTERN,
            title="Topology",
            description="TPU topology (2x2x4, 4x4) or, for cpu, the number of local processes.",
        ),
        "slices": field(
            platform.get("slices", 1), type="integer", minimum=1, maximum=64, title="Slices"
        ),
        "mesh": field(
            {},
            type="object",
            title="Device mesh override",
            description="Empty: derived from the launch (replica = slices; each slice filled by "
            "fsdp for presets too large to replicate on a chip, else by data). Otherwise some "
            'of {"data", "fsdp", "tensor"}: -1 (the rest of the slice) or a size; together '
            "they must use exactly a slice's chips.",
            properties={
                axis: {"type": "integer", "minimum": -1, "not": {"const": 0}}
                for axis in ("data", "fsdp", "tensor")
            },
            additionalProperties=False,
        ),
        "backend": field(
            platform.get("backend", "local"),
            type="string",
            enum=list(BACKENDS),
            title="Training backend",
        ),
        "runner": field("DirectRunner", type="string", enum=list(RUNNERS), title="Beam runner"),
        "dataflow": field(
            {},
            type="object",
            title="Dataflow settings",
            description="For DataflowRunner: project_id, location, temp_location, "
            "sdk_container_image, service_account, max_num_workers.",
            properties={
                "project_id": {"type": "string"},
                "location": {"type": "string"},
                "temp_location": {"type": "string", "pattern": full_match(r"gs://\S+")},
                "sdk_container_image": {"type": "string"},
                "service_account": {"type": "string"},
                "max_num_workers": {"type": "integer", "minimum": 1},
            },
            additionalProperties=False,
        ),
        "gke": field(
            dict(platform.get("gke", {})),
            type="object",
            title="GKE settings",
            description="For backend=gke: namespace (required) and one credentials source -- "
            "cluster_name + location [+ project_id, gcp_conn_id] (GKE via a GCP connection), "
            "kubeconfig [+ context], or in_cluster; none: in-cluster inside a pod -- plus an "
            "optional Workload-Identity service_account and Kueue queue, and tpu_zone (the TPU node "
            "pools' zone, for the availability preflight).",
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
                "tpu_zone": {"type": "string"},
            },
            additionalProperties=False,
        ),
        "image": field(
            platform.get("image", DEV_IMAGE),
            type="string",
            minLength=1,
            title="Trainer image",
            description="The slipway-trainer image (docker/trainer.Dockerfile) in a registry "
            "the cluster pulls from; ignored by the local backend (it runs this interpreter).",
        ),
        "stage_configs": field(
            _demo_stage_configs(),
            type="object",
            title="Per-stage configs",
            description="JSON config of each data-plane stage (pipelines/<stage>.py).",
            properties={stage: {"type": "object"} for stage in STAGES},
            additionalProperties=False,
        ),
        "num_shards": field(4, type="integer", minimum=1, maximum=4096, title="Shards per stage"),
        "heldout_fraction": field(
            0.02, type="number", exclusiveMinimum=0, maximum=0.5, title="Held-out fraction"
        ),
        "eval_max_tokens": field(
            65_536, type="integer", minimum=1, title="Eval tokens per store (cap)"
        ),
        "eval_tasks": field(
            list(DEFAULT_EVAL_TASKS),
            type="array",
            uniqueItems=True,
            items={"type": "string", "enum": list(TASK_NAMES)},
            title="Benchmark tasks",
            description="lm-evaluation-harness tasks the evaluate step scores the model on "
            "(trainer/tasks.py), besides the held-out stores' bits/byte. Empty: none.",
        ),
        "eval_task_limit": field(
            200,
            type="integer",
            minimum=1,
            title="Examples per benchmark task",
            description="The first N examples of each task's set (MMLU: round-robin over its "
            "subjects).",
        ),
        "export_dtype": field(
            "float32",
            type="string",
            enum=list(EXPORT_DTYPES),
            title="Export weights' type",
            description="The Hugging Face export's safetensors: float32 (the checkpoint's "
            "own, exact) or bfloat16 (half the folder, every weight rounded once; "
            "docs/export.md).",
        ),
        "model_name": field(
            "slipway-demo",
            type="string",
            pattern=MODEL_NAME_PATTERN,
            title="Model name",
            description="What the gate promotes the model as: the Airflow Asset "
            "slipway://models/<name> and its lineage record. Lowercase letters, digits and "
            "'-', at most 63.",
        ),
        "gate_max_bits_per_byte": field(
            None,
            type=["number", "null"],
            exclusiveMinimum=0,
            title="Gate: maximum held-out bits/byte",
            description="Empty: no such criterion. Otherwise the mean bits/byte over the "
            f"held-out stores ({HELDOUT_PREFIX}<source>, one per training source) must be at "
            "most this.",
        ),
        "gate_min_accuracy": field(
            {},
            type="object",
            title="Gate: minimum accuracy per task",
            description='Task -> minimum acc in [0, 1], e.g. {"arc_easy": 0.3}; each task '
            "must be in eval_tasks. A task without a result fails the gate.",
            properties={t: {"type": "number", "minimum": 0, "maximum": 1} for t in TASK_NAMES},
            additionalProperties=False,
        ),
        "gate_max_regression": field(
            None,
            type=["number", "null"],
            minimum=0,
            title="Gate: maximum regression against the promoted model",
            description="Empty: no such criterion. Otherwise no held-out store's bits/byte "
            "above, and no task's acc below, the currently promoted model of this name's by "
            "more than this (absolute), over the stores and tasks both have; with none "
            "promoted yet it passes.",
        ),
        "data_dir": field(
            # The platform's folder, shown in the form: an empty required field would keep
            # the form's Trigger button disabled.
            platform.get("data_dir", absolute("data")),
            type="string",
            pattern=DATA_DIR_PATTERN,
            title="Corpora folder",
            description="Holds raw/ and eval/: an absolute folder or gs://bucket/prefix at or "
            "below a root the platform allows ($SLIPWAY_ALLOWED_DATA_ROOTS, $SLIPWAY_DATA_DIR, "
            "$SLIPWAY_HOME). Default (or empty): $SLIPWAY_DATA_DIR, else ./data.",
        ),
        "fail_at_step": field(
            0,
            type="integer",
            minimum=0,
            title="Fault injection: stop training at step",
            description="0 = off. Otherwise the training task pre-empts the JobSet once the "
            "trainer logs this step (it checkpoints and stops) and fails the task; a retry "
            "or cleared task resumes from that checkpoint.",
        ),
    }


def with_defaults(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every pipeline field it lacks at its default: a DAG whose form leaves
    some out (the scaling sweep's recipe decides the reference-run fields) runs the shared
    tasks on the same values as a pipeline run with those defaults."""
    out = dict(params)
    for name, spec in form_fields().items():
        if name not in out:
            out[name] = copy.deepcopy(spec["default"])
    return out


class RunConfigError(ValueError):
    """A run form whose fields are each valid but do not fit together."""


def unknown_fields(given: Iterable[str], known: Iterable[str], form: str) -> list[str]:
    """``name: not a field of <form>`` for each given name the form lacks, sorted, with the
    closest field a typo may have meant (``step`` -> ``steps``)."""
    import difflib

    known = sorted(known)
    problems = []
    for name in sorted(set(given) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{name}: not a field of {form}{hint}")
    return problems


def form_values(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The params a trigger with ``conf`` gives a run: the form's defaults overlaid by
    ``conf``, each value checked by its field's JSON schema as Airflow checks it, then the
    checks across fields (:func:`check_run_config`). Errors name the field."""
    if not isinstance(conf, Mapping):
        raise RunConfigError(
            f"invalid run configuration: a JSON object of form fields, not {type(conf).__name__}"
        )
    form = form_fields()
    unknown = unknown_fields(conf, form, "slipway_pipeline's form")
    if unknown:
        raise RunConfigError("invalid run configuration:\n  " + "\n  ".join(unknown))
    params = {name: copy.deepcopy(spec["default"]) for name, spec in form.items()}
    params.update(conf)
    for name, spec in form.items():
        check_value(name, spec, params[name])
    check_run_config(params)
    return params


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
    "tpu_zone",
)
GKE_LAUNCH_KEYS = ("service_account", "queue")
# A valid image for the renderer's checks of the other fields (the run's image is checked alone).
_CHECK_IMAGE = "check:0"


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
    if gke.get("cluster_name") and not naming.full(naming.GKE_CLUSTER, gke["cluster_name"]):
        problems.append(
            f"gke.cluster_name {gke['cluster_name']!r}: lowercase letters, digits and '-', "
            "starting with a letter, at most 40 characters"
        )
    if gke.get("location") and not naming.is_location(gke["location"]):
        problems.append(
            f"gke.location {gke['location']!r}: a GCP region or zone (us-central2, us-east5-a)"
        )
    if gke.get("project_id") and not naming.full(naming.PROJECT, gke["project_id"]):
        problems.append(f"gke.project_id {gke['project_id']!r}: not a GCP project id")
    if params.get("image") == DEV_IMAGE:
        problems.append(
            f"image: {DEV_IMAGE} is the local default; backend=gke needs the trainer image in "
            "a registry the cluster can pull (e.g. "
            "us-central1-docker.pkg.dev/<project>/slipway/slipway-trainer:<tag>)"
        )
    if params.get("fail_at_step"):
        problems.append("fail_at_step: fault injection is for backend=local only")
    return problems


def _dataflow_problems(
    params: Mapping[str, Any], connection_project: Callable[[], str | None] | None
) -> list[str]:
    """runner=DataflowRunner: the settings the Beam stages will launch with, checked by the
    code that builds them (:func:`operators.dataflow.dataflow_settings`) from the same
    sources -- the run's ``dataflow`` object over the platform's ``SLIPWAY_DATAFLOW_*``, the
    project falling back to the GCP connection's -- and storage the workers can reach."""
    from operators.dataflow import (
        DataflowSettingsError,
        dataflow_settings,
        platform_dataflow_settings,
    )
    from operators.settings import DataDirNotAllowed, data_dir, storage_root

    run = dict(params.get("dataflow") or {})
    platform = platform_dataflow_settings()
    project = None
    if connection_project is not None and not (run.get("project_id") or platform.get("project_id")):
        project = connection_project()
    problems: list[str] = []
    try:
        dataflow_settings(run, platform, connection_project=project)
    except DataflowSettingsError as exc:
        problems += [f"dataflow.{p}" for p in exc.problems]
    # Dataflow workers cannot read the Airflow worker's disk.
    try:
        corpora = data_dir(params.get("data_dir"))
    except DataDirNotAllowed:
        corpora = "gs://"  # refused on its own by check_run_config
    for what, path in (
        ("storage root ($SLIPWAY_HOME)", storage_root()),
        ("data_dir (the corpora; default $SLIPWAY_DATA_DIR)", corpora),
    ):
        if not path.startswith("gs://"):
            problems.append(f"{what} {path}: DataflowRunner needs it on gs://")
    return problems


def _trainer_problems(params: Mapping[str, Any]) -> list[str]:
    """The trainer's own checks of the config the ``train`` step will write (the same code
    path, with stand-ins for the token stores the data plane has not made yet)."""
    from operators.pipeline.graph import sources_of, train_step_config, trainer_run_config
    from trainer.config import ConfigError

    stores = {s.name: f"<token store of {s.name}>" for s in sources_of(params)}
    try:
        trainer_run_config(train_step_config(params, stores), "<train step output>")
    except ConfigError as exc:
        return [f"trainer config: {exc}"]
    return []


def _non_finite(value: Any, path: str) -> list[str]:
    """Every NaN or infinity in a run form (JSON schema's ranges let NaN through: every
    comparison with it is false)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: must be a finite number, got {value!r}"]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _non_finite(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def check_run_config(
    params: Mapping[str, Any],
    *,
    connection_project: Callable[[], str | None] | None = None,
    batch: bool = True,
) -> None:
    """Every check of a run form that JSON schema cannot express. Raises
    :class:`RunConfigError` listing every problem, each starting with the field's name.

    Cross-field rules, non-finite numbers, the data roots, credentials and images the platform
    allows (:mod:`operators.policy`), every stage config (:mod:`pipelines.configs`), the TPU
    shape. ``connection_project`` looks up the GCP connection's project, the Dataflow
    project's last fallback; called only when neither the run nor the platform names one.
    ``batch=False``: a form without ``batch_size`` of its own (the sweep's recipe sets each
    cell's, a multiple of the data-parallel size), whose default is not checked on the mesh.
    """
    # Lazy: parse-time imports stay at Param; the stage configs import their stage modules.
    from operators.jobset import ManifestError, TrainingLaunch
    from operators.jobset.mesh import MeshError, data_parallel_size, launch_mesh, resolved
    from operators.pipeline.graph import graph_supplied_problems, sources_of
    from operators.policy import RunPolicy
    from operators.settings import DataDirNotAllowed, data_dir
    from pipelines.configs import check_stage_configs

    problems = _non_finite(dict(params), "")
    if problems:  # a NaN makes every other rule meaningless
        raise RunConfigError("invalid run configuration:\n  " + "\n  ".join(problems))
    sources = sources_of(params)
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        problems.append(f"sources: a source is listed twice ({names})")
    if not any(s.weight > 0 for s in sources):
        problems.append("sources: mixture weights must not all be 0")
    if params["warmup_steps"] > params["steps"]:
        problems.append(
            f"warmup_steps: {params['warmup_steps']} is more than steps ({params['steps']})"
        )
    eval_tasks = params.get("eval_tasks") or []
    for task in sorted(params.get("gate_min_accuracy") or {}):
        if task not in eval_tasks:
            problems.append(
                f"gate_min_accuracy.{task}: the gate needs its result, but {task} is not in "
                f"eval_tasks ({', '.join(eval_tasks) or 'none'})"
            )
    if params["fail_at_step"] and params["fail_at_step"] >= params["steps"]:
        problems.append(
            f"fail_at_step: {params['fail_at_step']} must be below steps ({params['steps']})"
        )
    try:
        data_dir(params.get("data_dir"))
    except DataDirNotAllowed as exc:
        problems.append(str(exc))
    problems += RunPolicy.from_env().problems(params)
    if problem := naming.image_problem(params["image"]):
        problems.append(problem)
    problems += check_stage_configs(params.get("stage_configs") or {})
    problems += graph_supplied_problems(params.get("stage_configs") or {})
    problems += _trainer_problems(params)
    if params["backend"] == "gke":
        problems.extend(_gke_problems(params))
    if params["runner"] == "DataflowRunner":
        problems.extend(_dataflow_problems(params, connection_project))
    elif params.get("dataflow"):
        # Unused on this runner, but a value there is still checked: a typo is named, not
        # carried along until someone switches the runner.
        from operators.dataflow import value_problems

        problems += [f"dataflow.{p}" for p in value_problems(params["dataflow"])]
    try:
        launch = TrainingLaunch(
            name="check",
            image=_CHECK_IMAGE,
            config_uri="check.json",
            accelerator=params["accelerator"],
            topology=params["topology"],
            slices=params["slices"],
        )
    except ManifestError as exc:
        problems.append(f"accelerator/topology/slices: {exc}")
    else:
        try:
            mesh = launch_mesh(launch.shape, params["model_preset"], params.get("mesh") or {})
        except MeshError as exc:
            problems.append(str(exc))
        else:
            # The trainer's own rule, checked here: there it would fail after the data plane.
            mesh = resolved(mesh, launch.shape.chips_per_slice)
            if batch and params["batch_size"] % (dp := data_parallel_size(mesh)):
                problems.append(
                    f"batch_size: {params['batch_size']} is not divisible by the data-parallel "
                    f"size {dp} (replica x data x fsdp of the mesh {mesh} on "
                    f"{params['slices']} x {params['topology']} {params['accelerator']})"
                )
    if params["backend"] == "gke":
        gke = params.get("gke") or {}
        # Service account and queue go into the manifest: the renderer's own checks.
        for key in GKE_LAUNCH_KEYS:
            if gke.get(key):
                try:
                    TrainingLaunch(
                        name="check",
                        image=_CHECK_IMAGE,
                        config_uri="check.json",
                        **{key: gke[key]},
                    )
                except ManifestError as exc:
                    problems.append(f"gke.{key}: {exc}")
    if problems:
        raise RunConfigError("invalid run configuration:\n  " + "\n  ".join(problems))
