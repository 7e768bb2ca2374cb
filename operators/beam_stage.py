"""Run data-plane stages (``python -m pipelines.<stage>``) through the apache-beam provider.

:class:`BeamStageOperator` runs each stage with the provider's
:class:`BeamRunPythonPipelineOperator` (created at execute time: importing the provider pulls
in the Google provider's Dataflow hooks, over a second that DAG parsing should not pay), with
``py_file`` a module name run with ``-m`` (``pipelines.tokenize`` as a script would shadow the standard
library's ``tokenize``) by this interpreter.

DirectRunner locally. With ``runner=DataflowRunner`` the stage runs on Dataflow: the settings
come from the platform (``SLIPWAY_DATAFLOW_<FIELD>`` environment variables, set by the Helm
chart's ConfigMap) overlaid by the run's ``dataflow`` param, the project falling back to the
GCP connection's. :func:`dataflow_settings` validates every value before it can reach the
launcher's command line; :func:`dataflow_job_name` and :func:`dataflow_labels` make the job
traceable to the Airflow run (DAG, run, task, step version); the provider follows the job and
``on_kill`` cancels it (by id, or by its unique name while the launcher is still submitting).

Each stage run is one step of :mod:`operators.graph`: a SUCCESS output is a cache hit (no Beam
job, lineage CACHED); otherwise the job writes into the step's output directory and lineage
gets the manifest's counts. The ``tokenize`` task runs several steps (one token store per
source and split, plus eval prose), each cached on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.sdk import BaseOperator

from operators import naming
from operators.graph import STAGE_OUT
from operators.step_lineage import ArtifactRef, StepLineageMixin, resolve_uri
from operators.steps import StepResult, StepSpec, join

log = logging.getLogger(__name__)

# -- Dataflow settings -------------------------------------------------------------------------

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
            found[name] = int(value) if value.isdigit() else value  # validated below
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
    problems = [
        f"unknown Dataflow setting {k!r}" for k in sorted(set(merged) - set(DATAFLOW_FIELDS))
    ]
    project = merged.get("project_id") or connection_project
    if not project:
        problems.append(
            "project_id is not set (run form dataflow.project_id, "
            f"{DATAFLOW_ENV_PREFIX}PROJECT_ID, or the GCP connection's project)"
        )
    elif not naming.full(naming.PROJECT, project):
        problems.append(f"project_id {project!r} is not a GCP project id")
    location = merged.get("location")
    if not location:
        problems.append(_unset("location", "a Dataflow region, e.g. us-central1"))
    elif not naming.full(naming.REGION, location):
        problems.append(f"location {location!r} is not a Dataflow region (e.g. us-central1)")
    temp = merged.get("temp_location")
    if not temp:
        problems.append(_unset("temp_location", "gs://bucket/path"))
    elif not naming.full(naming.GCS_PATH, temp):
        problems.append(f"temp_location {temp!r} is not a gs://bucket/path")
    staging = merged.get("staging_location") or (
        f"{temp.rstrip('/')}/staging" if isinstance(temp, str) and temp else None
    )
    # Derived from temp_location when not given: a missing temp_location is reported once.
    if staging is not None and not naming.full(naming.GCS_PATH, staging):
        problems.append(f"staging_location {staging!r} is not a gs://bucket/path")
    image = merged.get("sdk_container_image")
    if not image:
        # Without it workers run Beam's stock image, which lacks the pipelines package.
        problems.append(_unset("sdk_container_image", "the slipway-beam image"))
    elif error := naming.image_problem(image, "sdk_container_image"):
        problems.append(error)
    account = merged.get("service_account")
    if account is not None and not naming.full(naming.SERVICE_ACCOUNT, account):
        problems.append(f"service_account {account!r} is not a service account e-mail")
    workers = merged.get("max_num_workers")
    if workers is not None and (
        isinstance(workers, bool)
        or not isinstance(workers, int)
        or not 1 <= workers <= MAX_DATAFLOW_WORKERS
    ):
        problems.append(
            f"max_num_workers {workers!r} is not an integer in 1..{MAX_DATAFLOW_WORKERS}"
        )
    experiments, bad = _check_experiments(merged.get("experiments", []))
    problems += bad
    if problems:
        raise DataflowSettingsError(
            "invalid Dataflow settings:\n  " + "\n  ".join(problems), problems
        )
    return DataflowSettings(
        project_id=project,
        location=location,
        temp_location=temp,
        staging_location=staging,
        sdk_container_image=image,
        service_account=account,
        max_num_workers=workers,
        experiments=experiments,
    )


def gcp_connection_project(gcp_conn_id: str = GCP_CONN_ID) -> str | None:
    """The GCP connection's project (its ``project`` extra, else its credentials'), or None."""
    try:
        from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

        return GoogleBaseHook(gcp_conn_id=gcp_conn_id).project_id or None
    except Exception as exc:  # no such connection, no credentials: settings must name it
        log.info("No project from connection %s: %s", gcp_conn_id, exc)
        return None


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
    """Pipeline options for the workers (the rest go through ``DataflowConfiguration``)."""
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


def dataflow_configuration_kwargs(
    settings: DataflowSettings, identity: RunIdentity, spec: StepSpec, gcp_conn_id: str
) -> dict[str, Any]:
    """Keyword arguments of the provider's ``DataflowConfiguration`` for one step's job."""
    return {
        "job_name": dataflow_job_name(identity, spec.name, spec.version),
        "append_job_name": True,  # the provider's fresh suffix: unique per launch
        "project_id": settings.project_id,
        "location": settings.location,
        "gcp_conn_id": gcp_conn_id,
        "service_account": settings.service_account,
        "wait_until_finished": True,
        # Batch jobs: cancel (not drain) on kill, and wait for the cancel to be accepted.
        "drain_pipeline": False,
    }


# -- the operator ------------------------------------------------------------------------------


def describe_stage_output(output_dir: str) -> dict[str, Any]:
    """Counts, config, content hash and manifest extras (tokens, vocabulary) of an output."""
    from operators.lineage.describe import describe_documents
    from pipelines.manifest import has_manifest, read_manifest  # the data contract's owner

    fields = describe_documents(output_dir)
    if has_manifest(output_dir):
        extra = read_manifest(output_dir).extra
        keep = ("num_tokens", "vocab_size", "tokenizer_sha256", "num_documents", "sample")
        fields.setdefault("counts", {}).update({k: extra[k] for k in keep if k in extra})
    return fields


@contextlib.contextmanager
def _nested(operator: Any) -> Iterator[None]:
    """Run a provider operator's ``execute`` inside ours without the "called outside of the
    Task Runner" warning: Airflow's guard checks which operator the runner is executing."""
    try:
        from airflow.sdk.bases.operator import ExecutorSafeguard

        token = ExecutorSafeguard.tracker.set(operator)
    except (ImportError, AttributeError):  # another Airflow: the warning is harmless
        yield
        return
    try:
        yield
    finally:
        ExecutorSafeguard.tracker.reset(token)


def _child_pids() -> list[int]:
    """This process's direct children (Linux /proc; elsewhere none are found)."""
    me, found = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                # Field 4 (ppid) follows the parenthesised command name, which may hold spaces.
                if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
    return found


class BeamStageOperator(StepLineageMixin, BaseOperator):
    """Runs the Beam steps of one pipeline task (``ingest`` ... ``tokenize``).

    :param stage_task: the task's name in :func:`operators.graph.build_graph` ``stages``.
    :param gcp_conn_id: the Google connection for DataflowRunner.
    """

    template_fields = ("gcp_conn_id",)

    def __init__(self, *, stage_task: str, gcp_conn_id: str = GCP_CONN_ID, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", stage_task)
        super().__init__(**kwargs)
        self.stage_task = stage_task
        self.gcp_conn_id = gcp_conn_id
        self._beam: Any = None  # the provider operator running the current stage
        self._identity: RunIdentity | None = None  # set per stage run: names Dataflow jobs

    def planned_io(self, params: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        from operators.graph import build_graph
        from operators.steps import output_path

        root = self.steps_root()
        stages = build_graph(params).stages[self.stage_task]
        inputs = [resolve_uri(ref[0], root) for s in stages for ref in s.inputs]
        return inputs, [join(output_path(root, s.step), STAGE_OUT) for s in stages]

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from operators.graph import build_graph

        params = self.run_params(context)
        graph = build_graph(params)
        results = []
        for stage_step in graph.stages[self.stage_task]:
            result = self.run_step(
                context,
                stage_step.step,
                lambda spec, s=stage_step: self._run_stage(context, params, s, spec),
                inputs=[ArtifactRef(u, t, r) for u, t, r in stage_step.inputs],
                outputs=lambda spec, res, s=stage_step: self._outputs(s.output_type, spec, res),
                output_subpath=STAGE_OUT,
            )
            results.append(
                {
                    "step": stage_step.step.key,
                    "outcome": str(result.outcome),
                    "output": result.spec.output_path,
                    **(result.result or {}),
                }
            )
        return results

    @staticmethod
    def _outputs(output_type: str, spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
        fields = dict(result.result or {})
        fields.pop("output", None)
        return [ArtifactRef(join(spec.output_path, STAGE_OUT), output_type, fields=fields)]

    def _run_stage(
        self, context: Any, params: Mapping[str, Any], stage_step: Any, spec: StepSpec
    ) -> dict[str, Any]:
        root = self.steps_root()
        options: dict[str, Any] = {}
        for key, value in stage_step.options.items():
            if isinstance(value, list | tuple):
                options[key] = [resolve_uri(v, root) for v in value]
            elif isinstance(value, Mapping):
                options[key] = json.dumps(value)
            else:
                options[key] = resolve_uri(value, root)
        out = join(spec.output_path, STAGE_OUT)
        options["output"] = out
        options["config"] = json.dumps(
            dict(params["stage_configs"].get(stage_step.stage, {})), sort_keys=True
        )
        self._identity = self._run_identity(context)
        self._beam = self.beam_operator(stage_step.stage, params, spec, options)
        self.log.info("%s: python -m pipelines.%s -> %s", spec.name, stage_step.stage, out)
        with _nested(self._beam):
            self._beam.execute(context)  # the provider's hook raises on a non-zero exit
        return describe_stage_output(out)

    def _run_identity(self, context: Mapping[str, Any]) -> RunIdentity:
        ti = context.get("ti")
        try_number = getattr(ti, "try_number", None)
        return RunIdentity(
            dag_id=str(getattr(ti, "dag_id", None) or self.dag_id),
            run_id=str(context.get("run_id") or getattr(ti, "run_id", None) or "manual"),
            task_id=self.task_id,
            try_number=try_number if isinstance(try_number, int) else 1,
        )

    def beam_operator(
        self, stage: str, params: Mapping[str, Any], spec: StepSpec, options: dict[str, Any]
    ) -> Any:
        """The provider operator for one stage run (``-m``: a module, not a file path)."""
        from airflow.providers.apache.beam.operators.beam import BeamRunPythonPipelineOperator

        runner = params["runner"]
        dataflow_config = None
        if runner == "DataflowRunner":
            dataflow_config = self._dataflow_config(params, spec, options)
        return BeamRunPythonPipelineOperator(
            task_id=self.task_id,
            py_file=f"pipelines.{stage}",
            py_options=["-m"],
            py_interpreter=sys.executable,
            runner=runner,
            pipeline_options=options,
            dataflow_config=dataflow_config,
            gcp_conn_id=self.gcp_conn_id,
            deferrable=False,  # the step lease needs this process alive while the job runs
        )

    def on_kill(self) -> None:
        # Our children first: a launcher still staging must not go on to submit a job. (The
        # provider's hook keeps no handle on the pipeline process, local or launcher.)
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        beam, self._beam = self._beam, None
        if beam is None:
            return
        if getattr(beam, "dataflow_job_id", None) or not getattr(beam, "is_dataflow", False):
            beam.on_kill()  # the provider cancels the Dataflow job whose id it read
            return
        self._cancel_by_name(beam)

    def _cancel_by_name(self, beam: Any) -> None:
        """Killed before the launcher printed the job id: the job may exist already, and its
        name (with the provider's fresh suffix) is unique, so cancel whatever carries it."""
        hook, name = getattr(beam, "dataflow_hook", None), getattr(beam, "dataflow_job_name", None)
        if hook is None or not name:
            return  # killed before the provider prepared a launch: nothing was submitted
        config = beam.dataflow_config
        self.log.info("Cancelling Dataflow job named %s (its id was not known yet)", name)
        try:
            hook.cancel_job(job_name=name, project_id=config.project_id, location=config.location)
        except Exception:  # the task is being killed anyway: say what may be left running
            self.log.exception("Could not cancel Dataflow job %s: cancel it in the console", name)

    def _connection_project(self) -> str | None:
        return gcp_connection_project(self.gcp_conn_id)

    def _dataflow_config(
        self, params: Mapping[str, Any], spec: StepSpec, options: dict[str, Any]
    ) -> Any:
        """Validate everything, add the worker options and labels, and build the provider's
        ``DataflowConfiguration``; nothing is launched when a value is refused."""
        from airflow.providers.google.cloud.operators.dataflow import DataflowConfiguration

        check_remote_paths(options)
        run = dict(params.get("dataflow") or {})
        platform = platform_dataflow_settings()
        connection_project = None
        if not (run.get("project_id") or platform.get("project_id")):
            connection_project = self._connection_project()
        settings = dataflow_settings(run, platform, connection_project=connection_project)
        identity = self._identity or RunIdentity(self.dag_id, "unknown", self.task_id)
        options.update(dataflow_worker_options(settings))
        options["labels"] = dataflow_labels(identity, spec.name, spec.version)
        return DataflowConfiguration(
            **dataflow_configuration_kwargs(settings, identity, spec, self.gcp_conn_id)
        )
