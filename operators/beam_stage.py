"""Run data-plane stages (``python -m pipelines.<stage>``) through the apache-beam provider.

:class:`BeamStageOperator` runs each stage with the provider's
:class:`BeamRunPythonPipelineOperator` (created at execute time: importing the provider pulls
in the Google provider's Dataflow hooks, over a second that DAG parsing should not pay), with
``py_file`` a module name run with ``-m`` (``pipelines.tokenize`` as a script would shadow the standard
library's ``tokenize``) by this interpreter. DirectRunner locally; with the ``DataflowRunner``
param it passes a :class:`DataflowConfiguration` (project, region, job name) and the worker
options, and the provider follows and (``on_kill``) cancels the Dataflow job.

Each stage run is one step of :mod:`operators.graph`: a SUCCESS output is a cache hit (no Beam
job, lineage CACHED); otherwise the job writes into the step's output directory and lineage
gets the manifest's counts. The ``tokenize`` task runs several steps (one token store per
source and split, plus eval prose), each cached on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from airflow.sdk import BaseOperator

from operators.graph import STAGE_OUT
from operators.step_lineage import ArtifactRef, StepLineageMixin, resolve_uri
from operators.steps import StepResult, StepSpec, join

# Dataflow worker settings taken from the run's `dataflow` param (the rest go to
# DataflowConfiguration).
_DATAFLOW_OPTIONS = ("temp_location", "sdk_container_image", "max_num_workers")


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

    def __init__(
        self, *, stage_task: str, gcp_conn_id: str = "google_cloud_default", **kwargs: Any
    ) -> None:
        kwargs.setdefault("task_id", stage_task)
        super().__init__(**kwargs)
        self.stage_task = stage_task
        self.gcp_conn_id = gcp_conn_id
        self._beam: Any = None  # the provider operator running the current stage

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
        self._beam = self.beam_operator(stage_step.stage, params, spec, options)
        self.log.info("%s: python -m pipelines.%s -> %s", spec.name, stage_step.stage, out)
        with _nested(self._beam):
            self._beam.execute(context)  # the provider's hook raises on a non-zero exit
        return describe_stage_output(out)

    def beam_operator(
        self, stage: str, params: Mapping[str, Any], spec: StepSpec, options: dict[str, Any]
    ) -> Any:
        """The provider operator for one stage run (``-m``: a module, not a file path)."""
        from airflow.providers.apache.beam.operators.beam import BeamRunPythonPipelineOperator

        runner = params["runner"]
        dataflow_config = (
            self._dataflow_config(params, spec, options) if runner == "DataflowRunner" else None
        )
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
        if self._beam is not None:
            self._beam.on_kill()  # the provider cancels a Dataflow job
        # The provider's hook keeps no handle on a local pipeline process: end our children.
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    @staticmethod
    def _dataflow_config(params: Mapping[str, Any], spec: StepSpec, options: dict[str, Any]) -> Any:
        from airflow.providers.google.cloud.operators.dataflow import DataflowConfiguration

        dataflow = dict(params.get("dataflow") or {})
        for key in _DATAFLOW_OPTIONS:
            if dataflow.get(key):
                options[key] = dataflow[key]
        # Dataflow job names: lowercase letters, digits and '-'; the hook appends a suffix.
        job = f"slipway-{spec.name}-{spec.version[:8]}".replace("/", "-").replace("_", "-")
        return DataflowConfiguration(
            job_name=job.lower(),
            project_id=dataflow.get("project_id"),
            location=dataflow.get("location"),
            service_account=dataflow.get("service_account"),
            wait_until_finished=True,
        )
