"""Dataflow settings of a run: merged, validated and turned into launch options (Airflow-free).

The Beam stages' settings on Dataflow come from the platform (``SLIPWAY_DATAFLOW_<FIELD>``
environment variables, set by the Helm chart's ConfigMap) overlaid by the run's ``dataflow``
param, the project falling back to the GCP connection's. :func:`dataflow_settings` validates
every value (with :mod:`operators.naming`'s full-string checks and its one image policy)
before it can reach the launcher's command line; :func:`dataflow_job_name` and
:func:`dataflow_labels` make a job traceable to the Airflow run (DAG, run, task, step
version). Used by the run form's checks (:mod:`operators.params`) and the Beam stage operator
(:mod:`operators.beam_stage`), which both build the settings from the same sources.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from operators import naming

if TYPE_CHECKING:
    from operators.steps import StepSpec

log = logging.getLogger(__name__)

GCP_CONN_ID = "google_cloud_default"  # the operators' default GCP connection
DATAFLOW_ENV_PREFIX = "SLIPWAY_DATAFLOW_"  # + the field name upper-cased (Helm ConfigMap keys)
DATAFLOW_FIELDS = (
    "project_id",
    "location",
    "temp_location",
    "staging_location",
    "sdk_container_image",
    "service_account",
    "max_num_workers",
    "experiments",
)
# Slipway's bound, not Dataflow's: more workers than this for one stage is a typo.
MAX_DATAFLOW_WORKERS = 1000
# The provider appends "-" + 8 hex characters to every job name (a fresh one per launch, so
# retries and reruns never collide); Dataflow allows 63 characters in all.
JOB_NAME_MAX = 63 - 9
# Custom SDK containers need Runner v2 (Beam's Python default; stated so it cannot drift).
RUNNER_V2 = "use_runner_v2"
_NO_RUNNER_V2 = ("disable_runner_v2", "disable_prime_runner_v2")

_EXPERIMENT_RE = re.compile(r"[a-z][a-z0-9_]{0,62}(?:=[A-Za-z0-9_.:/-]{1,200})?")


class DataflowSettingsError(ValueError):
    """Dataflow settings that must not reach a command line (every problem, one message).

    ``problems`` lists them one by one, each starting with the setting's name, for callers
    that report them among others (the run form's cross-checks).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


@dataclass(frozen=True)
class DataflowSettings:
    """Validated settings of the Dataflow jobs of one run."""

    project_id: str
    location: str
    temp_location: str
    staging_location: str
    sdk_container_image: str
    service_account: str | None = None
    max_num_workers: int | None = None
    experiments: tuple[str, ...] = (RUNNER_V2,)


def platform_dataflow_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Platform defaults from ``SLIPWAY_DATAFLOW_<FIELD>`` (experiments comma-separated)."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for name in DATAFLOW_FIELDS:
        value = environ.get(DATAFLOW_ENV_PREFIX + name.upper(), "").strip()
        if not value:
            continue
        if name == "experiments":
            found[name] = [e.strip() for e in value.split(",") if e.strip()]
        elif name == "max_num_workers":
            found[name] = (
                int(value) if value.isascii() and value.isdigit() else value
            )  # checked below
        else:
            found[name] = value
    return found


def _merge(platform: Mapping[str, Any], run: Mapping[str, Any]) -> dict[str, Any]:
    """The run's values win; empty ones ("" / None / []) fall through to the platform's."""
    merged = dict(platform)
    merged.update({k: v for k, v in run.items() if v not in ("", None, [], ())})
    return merged


def _unset(field: str, what: str) -> str:
    """A missing setting, with the two places it can be given."""
    return (
        f"{field} is not set ({what}; run form dataflow.{field} or "
        f"{DATAFLOW_ENV_PREFIX}{field.upper()})"
    )


def _check_experiments(experiments: Any) -> tuple[tuple[str, ...], list[str]]:
    if isinstance(experiments, str) or not isinstance(experiments, list | tuple):
        return (), [f"experiments must be a list of names, got {experiments!r}"]
    problems = [
        f"experiments: {e!r} is not NAME or NAME=VALUE"
        for e in experiments
        if not naming.full(_EXPERIMENT_RE, e)
    ]
    problems += [
        f"experiments: {e} cannot be used: the custom SDK container needs Runner v2"
        for e in experiments
        if isinstance(e, str) and e.split("=", 1)[0] in _NO_RUNNER_V2
    ]
    # Runner v2 first, then the user's, each once, in order.
    return tuple(dict.fromkeys([RUNNER_V2, *experiments])), problems


def value_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with each Dataflow setting ``values`` gives (unset ones aside): the
    checks :func:`dataflow_settings` makes, also asked of a DirectRunner run's ``dataflow``
    object, which nothing would use, so that a typo there is named rather than ignored."""
    problems = [
        f"unknown Dataflow setting {k!r}" for k in sorted(set(values) - set(DATAFLOW_FIELDS))
    ]
    given = {k: v for k, v in values.items() if v not in ("", None, [], ())}
    for name, pattern, what in (
        ("project_id", naming.PROJECT, "a GCP project id"),
        ("location", naming.REGION, "a Dataflow region (e.g. us-central1)"),
        ("temp_location", naming.GCS_PATH, "a gs://bucket/path"),
        ("staging_location", naming.GCS_PATH, "a gs://bucket/path"),
        ("service_account", naming.SERVICE_ACCOUNT, "a service account e-mail"),
    ):
        if name in given and not naming.full(pattern, given[name]):
            problems.append(f"{name} {given[name]!r} is not {what}")
    if "sdk_container_image" in given and (
        error := naming.image_problem(given["sdk_container_image"], "sdk_container_image")
    ):
        problems.append(error)
    workers = given.get("max_num_workers")
    if workers is not None and (
        isinstance(workers, bool)
        or not isinstance(workers, int)
        or not 1 <= workers <= MAX_DATAFLOW_WORKERS
    ):
        problems.append(
            f"max_num_workers {workers!r} is not an integer in 1..{MAX_DATAFLOW_WORKERS}"
        )
    problems += _check_experiments(given.get("experiments", []))[1]
    return problems


def dataflow_settings(
    run: Mapping[str, Any],
    platform: Mapping[str, Any] | None = None,
    *,
    connection_project: str | None = None,
) -> DataflowSettings:
    """Merge, validate and complete the Dataflow settings of a run.

    ``run`` is the run's ``dataflow`` param, ``platform`` the defaults
    (:func:`platform_dataflow_settings`), ``connection_project`` the GCP connection's project,
    used when neither names one. Raises :class:`DataflowSettingsError` listing every problem.
    """
    merged = _merge(platform or {}, run)
    project = merged.get("project_id") or connection_project
    temp = merged.get("temp_location")
    # Derived from temp_location when not given: a missing temp_location is reported once.
    staging = merged.get("staging_location") or (
        f"{temp.rstrip('/')}/staging" if isinstance(temp, str) and temp else None
    )
    completed = {**merged, "project_id": project, "staging_location": staging}
    problems = []
    if not project:
        problems.append(
            "project_id is not set (run form dataflow.project_id, "
            f"{DATAFLOW_ENV_PREFIX}PROJECT_ID, or the GCP connection's project)"
        )
    if not merged.get("location"):
        problems.append(_unset("location", "a Dataflow region, e.g. us-central1"))
    if not temp:
        problems.append(_unset("temp_location", "gs://bucket/path"))
    if not merged.get("sdk_container_image"):
        # Without it workers run Beam's stock image, which lacks the pipelines package.
        problems.append(_unset("sdk_container_image", "the slipway-beam image"))
    problems += value_problems(completed)
    if problems:
        raise DataflowSettingsError(
            "invalid Dataflow settings:\n  " + "\n  ".join(problems), problems
        )
    return DataflowSettings(
        project_id=project,
        location=merged["location"],
        temp_location=temp,
        staging_location=staging,
        sdk_container_image=merged["sdk_container_image"],
        service_account=merged.get("service_account"),
        max_num_workers=merged.get("max_num_workers"),
        experiments=_check_experiments(merged.get("experiments", []))[0],
    )


@dataclass(frozen=True)
class RunIdentity:
    """Which Airflow task try launches a job: what job names and labels trace back to."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int = 1

    @property
    def run_hash(self) -> str:
        """8 hex characters naming the DAG run in job names (run ids are long, with ':' '+')."""
        return hashlib.sha256(f"{self.dag_id}\0{self.run_id}".encode()).hexdigest()[:8]


def _slug(text: str, limit: int, allowed: str = "a-z0-9") -> str:
    """Lowercase, other characters to '-', no leading/trailing/double '-', at most ``limit``."""
    slug = re.sub(f"[^{allowed}]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-")


def dataflow_job_name(identity: RunIdentity, step_name: str, version: str) -> str:
    """``{dag}-{step}-{version[:8]}-{run hash}``: DNS-safe, <= 54 characters, so <= 63 with the
    provider's unique suffix; the labels carry the full, untruncated values."""
    tail = f"-{version[:8]}-{identity.run_hash}"
    head = "-".join(p for p in (_slug(identity.dag_id, 20), _slug(step_name, 24)) if p)
    if not head[:1].isalpha():  # Dataflow names start with a letter
        head = f"sw-{head}".rstrip("-")
    return f"{head[: JOB_NAME_MAX - len(tail)].rstrip('-')}{tail}"


def _label(text: str) -> str:
    # Dataflow label values: <= 63 of lowercase letters, digits, '_' and '-'.
    return _slug(text, 63, "a-z0-9_")


def dataflow_labels(identity: RunIdentity, step_name: str, version: str) -> dict[str, str]:
    """Job labels that find the job from the run and the run from the job."""
    return {
        "slipway-dag": _label(identity.dag_id),
        "slipway-run": _label(identity.run_id),
        "slipway-run-hash": identity.run_hash,
        "slipway-task": _label(identity.task_id),
        "slipway-try": str(identity.try_number),
        "slipway-step": _label(step_name),
        "slipway-version": version[:16],
    }


def dataflow_worker_options(settings: DataflowSettings) -> dict[str, Any]:
    """Pipeline options for the workers (the job's own are the hook's: name, project, region)."""
    options: dict[str, Any] = {
        "temp_location": settings.temp_location,
        "staging_location": settings.staging_location,
        "sdk_container_image": settings.sdk_container_image,
        # The image already holds this Beam SDK: do not stage a tarball of it per job.
        "sdk_location": "container",
        "experiments": list(settings.experiments),
    }
    if settings.max_num_workers is not None:
        options["max_num_workers"] = settings.max_num_workers
    return options


def check_remote_paths(options: Mapping[str, Any]) -> None:
    """Dataflow workers cannot read this machine's disk: every path must be on ``gs://``."""
    problems = []
    for key, value in options.items():
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, str) and (
                item.startswith(("/", "file:", "./"))
                or (key == "output" and not item.startswith("gs://"))
            ):
                problems.append(f"--{key}={item}")
    if problems:
        raise DataflowSettingsError(
            "DataflowRunner needs gs:// paths (set SLIPWAY_HOME and the corpora folder to "
            "gs://...), got: " + ", ".join(problems)
        )


@dataclass(frozen=True)
class DataflowJob:
    """Where and as whom one stage's Dataflow job runs: what the Beam stage hook launches.

    ``job_name`` is the base name (<= 54 characters); the hook appends the provider's fresh
    8-hex suffix per launch, so retries and reruns never collide.
    """

    job_name: str
    project_id: str
    location: str
    gcp_conn_id: str
    service_account: str | None = None
    labels: Mapping[str, str] | None = None


def dataflow_job(
    settings: DataflowSettings, identity: RunIdentity, spec: StepSpec, gcp_conn_id: str
) -> DataflowJob:
    """The Dataflow job of one step's stage run, from validated settings."""
    return DataflowJob(
        job_name=dataflow_job_name(identity, spec.name, spec.version),
        project_id=settings.project_id,
        location=settings.location,
        gcp_conn_id=gcp_conn_id,
        service_account=settings.service_account,
        labels=dataflow_labels(identity, spec.name, spec.version),
    )
