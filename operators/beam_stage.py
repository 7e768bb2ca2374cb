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

Each stage run is one step of :mod:`operators.pipeline.graph` (its options:
:func:`operators.pipeline.graph.stage_options`, shared with the data-plane walker ``operators.pipeline.dataplane``): a SUCCESS output is a cache hit (no Beam
job, lineage CACHED); otherwise the job writes into the step's output directory and lineage
gets the manifest's counts. The ``tokenize`` task runs several steps (one token store per
source and split, plus eval prose), each cached on its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.dataflow import (
    GCP_CONN_ID,
    RunIdentity,
    check_remote_paths,
    dataflow_configuration_kwargs,
    dataflow_labels,
    dataflow_settings,
    dataflow_worker_options,
    platform_dataflow_settings,
)
from operators.lineage.describe import describe_stage_output
from operators.pipeline.graph import STAGE_OUT
from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    resolve_uri,
    stage_output_artifacts,
)
from operators.steps import StepSpec, join

log = logging.getLogger(__name__)


def gcp_connection_project(gcp_conn_id: str = GCP_CONN_ID) -> str | None:
    """The Airflow GCP connection's project (the Dataflow project's last fallback) (its ``project`` extra, else its credentials'), or None."""
    try:
        from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

        return GoogleBaseHook(gcp_conn_id=gcp_conn_id).project_id or None
    except Exception as exc:  # no such connection, no credentials: settings must name it
        log.info("No project from connection %s: %s", gcp_conn_id, exc)
        return None


# -- the operator ------------------------------------------------------------------------------


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

    :param stage_task: the task's name in :func:`operators.pipeline.graph.build_graph` ``stages``.
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

    def planned_io(self, context: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        from operators.steps import output_path

        root = self.steps_root()
        stages = self.step_graph(context).stages[self.stage_task]
        inputs = [resolve_uri(ref[0], root) for s in stages for ref in s.inputs]
        return inputs, [join(output_path(root, s.step), STAGE_OUT) for s in stages]

    def execute(self, context: Any) -> list[dict[str, Any]]:
        params = self.run_params(context)
        graph = self.step_graph(context)
        results = []
        for stage_step in graph.stages[self.stage_task]:
            result = self.run_step(
                context,
                stage_step.step,
                lambda spec, s=stage_step: self._run_stage(context, params, s, spec),
                inputs=[
                    ArtifactRef(u, t, r, fields=graph.input_fields(u))
                    for u, t, r in stage_step.inputs
                ],
                outputs=lambda spec, res, s=stage_step: stage_output_artifacts(
                    s.output_type, spec, res
                ),
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

    def _run_stage(
        self, context: Any, params: Mapping[str, Any], stage_step: Any, spec: StepSpec
    ) -> dict[str, Any]:
        from operators.pipeline.graph import stage_options

        options = stage_options(stage_step, spec, self.steps_root())
        out = options["output"]
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
