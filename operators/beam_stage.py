"""Run data-plane stages (``python -m pipelines.<stage>``) as Airflow tasks.

:class:`BeamStageOperator` orchestrates: for each step of its task, a SUCCESS output is a
cache hit (no Beam job, lineage CACHED); otherwise :class:`~operators.hooks.beam.BeamStageHook`
runs the stage module into the step's output directory (DirectRunner locally, DataflowRunner
in production) and lineage gets the manifest's counts. The ``tokenize`` task runs several
steps (one token store per source and split, plus eval prose), each cached on its own.

Each stage run is one step of :mod:`operators.pipeline.graph` (its options:
:func:`operators.pipeline.graph.stage_options`, shared with the data-plane walker
``operators.pipeline.dataplane``). With ``runner=DataflowRunner`` the settings come from the
platform (``SLIPWAY_DATAFLOW_<FIELD>`` environment variables, set by the Helm chart's
ConfigMap) overlaid by the run's ``dataflow`` param, the project falling back to the GCP
connection's; :func:`operators.dataflow.dataflow_settings` validates every value before it can
reach the launcher's command line, and the job's name and labels trace it to the Airflow run
(DAG, run, task, step version). ``on_kill`` stops the launcher and cancels the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.dataflow import (
    GCP_CONN_ID,
    RunIdentity,
    check_remote_paths,
    dataflow_job,
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


class BeamStageOperator(StepLineageMixin, BaseOperator):
    """Runs the Beam steps of one pipeline task (``ingest`` ... ``tokenize``).

    :param stage_task: the task's name in :func:`operators.pipeline.graph.build_graph` ``stages``.
    :param gcp_conn_id: the Google connection for DataflowRunner.
    :param py_interpreter: the Python that runs the stage modules (this one by default).
    """

    template_fields = ("gcp_conn_id",)

    def __init__(
        self,
        *,
        stage_task: str,
        gcp_conn_id: str = GCP_CONN_ID,
        py_interpreter: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("task_id", stage_task)
        super().__init__(**kwargs)
        self.stage_task = stage_task
        self.gcp_conn_id = gcp_conn_id
        self.py_interpreter = py_interpreter
        self._hook: Any = None  # the hook running the current stage (what on_kill stops)

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
        job = None
        if params["runner"] == "DataflowRunner":
            job = self._dataflow_job(self._run_identity(context), params, spec, options)
        self._hook = self.beam_hook(params["runner"], job)
        self.log.info("%s: python -m pipelines.%s -> %s", spec.name, stage_step.stage, out)
        try:
            launched = self._hook.run_module(f"pipelines.{stage_step.stage}", options)
        finally:
            # Cleared after the hook has stopped what it ran (it kills on any exception).
            self._hook = None
        return {**describe_stage_output(out), **launched}

    def beam_hook(self, runner: str, dataflow: Any) -> Any:
        """The hook that runs one stage (``dataflow``: its job, on DataflowRunner)."""
        from operators.hooks.beam import BeamStageHook

        kwargs = {"py_interpreter": self.py_interpreter} if self.py_interpreter else {}
        return BeamStageHook(runner, dataflow=dataflow, **kwargs)

    def _run_identity(self, context: Mapping[str, Any]) -> RunIdentity:
        ti = context.get("ti")
        try_number = getattr(ti, "try_number", None)
        return RunIdentity(
            dag_id=str(getattr(ti, "dag_id", None) or self.dag_id),
            run_id=str(context.get("run_id") or getattr(ti, "run_id", None) or "manual"),
            task_id=self.task_id,
            try_number=try_number if isinstance(try_number, int) else 1,
        )

    def on_kill(self) -> None:
        hook = self._hook
        if hook is not None:
            hook.kill()

    def on_lease_lost(self) -> None:
        # The launcher and its Dataflow job are this attempt's alone (the job's name carries
        # the try): a new owner launches its own. A stage in this process runs on.
        self.on_kill()

    def _dataflow_job(
        self,
        identity: RunIdentity,
        params: Mapping[str, Any],
        spec: StepSpec,
        options: dict[str, Any],
    ) -> Any:
        """Validate everything and add the worker options; nothing is launched when a value
        is refused."""
        from operators.hooks.beam import gcp_connection_project
        from operators.policy import enforce

        enforce(params)  # again where the project, identity, image and buckets are used
        check_remote_paths(options)
        run = dict(params.get("dataflow") or {})
        platform = platform_dataflow_settings()
        connection_project = None
        if not (run.get("project_id") or platform.get("project_id")):
            connection_project = gcp_connection_project(self.gcp_conn_id)
        settings = dataflow_settings(run, platform, connection_project=connection_project)
        options.update(dataflow_worker_options(settings))
        return dataflow_job(settings, identity, spec, self.gcp_conn_id)
