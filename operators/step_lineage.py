"""What every Slipway operator shares: run a step under the step model, record lineage.

For each step a task runs:

1. a lineage execution starts RUNNING (run id = the DAG run's, pipeline = the DAG id), with
   the step's version, its output path and its unversioned settings;
2. :class:`~operators.steps.StepRunner` runs it: a SUCCESS marker means a cache hit (recorded
   CACHED, nothing recomputed), otherwise the work runs under a heartbeat lease;
3. the execution ends COMPLETE / CACHED with its input and output artifacts (counts from the
   manifest), FAILED with the error (and whatever ``failure_properties`` adds, e.g. the last
   checkpoint), or CANCELED when Airflow terminated the task.

Artifacts are recorded with the version of their content (:func:`input_fields`): outputs with
the step's version, an upstream output read as input with the upstream step's version, a raw
file read as input with its content id (what the ``fetch`` task recorded for it). A trace of
a run's outputs therefore reaches the exact files that run read, not a later refetch.

The same inputs and outputs feed the OpenLineage provider through
``get_openlineage_facets_on_start/complete/failure``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from operators.steps import (
    Outcome,
    OutputRef,
    Step,
    StepResult,
    StepRunner,
    StepSpec,
    join,
    output_path,
)

log = logging.getLogger(__name__)

LEASE_SECONDS = 120.0  # a task's heartbeat renews it every 40 s


@dataclass(frozen=True)
class ArtifactRef:
    """An input or output of a step: a URI (or an upstream output), its type and role."""

    uri: Any  # str or OutputRef
    type: str
    role: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)  # counts, content_hash, config


def stage_output_artifacts(
    output_type: str, spec: StepSpec, result: StepResult
) -> list[ArtifactRef]:
    """A Beam stage step's output (``<step>/output``), with the fields its run described."""
    from operators.pipeline.graph import STAGE_OUT

    fields = dict(result.result or {})
    fields.pop("output", None)
    return [ArtifactRef(join(spec.output_path, STAGE_OUT), output_type, fields=fields)]


def split_output_artifacts(spec: StepSpec, result: StepResult) -> list[ArtifactRef]:
    """The ``split`` step's per-source ``train/`` and ``heldout/`` files, with their counts."""
    from operators.pipeline.graph import DATASET

    counts = (result.result or {}).get("sources", {})
    return [
        ArtifactRef(
            join(spec.output_path, kind, f"{source}.jsonl.gz"),
            DATASET,
            role=kind,
            fields={"counts": {"records": n[kind]}},
        )
        for source, n in counts.items()
        for kind in ("train", "heldout")
    ]


def require_own_run(store: Any, run_id: str, pipeline: str) -> None:
    """Raise ``RunIdConflict`` when another DAG recorded this run id first, and
    ``RunFolderTaken`` when another run id names the same run folder (docs/
    steps_and_lineage.md): this run must not read or write the other run's."""
    from operators.settings import require_own_run_folder

    store.require_owner(run_id, pipeline)
    require_own_run_folder(run_id, store.run_ids())


def resolve_uri(uri: Any, root: str) -> str:
    if isinstance(uri, OutputRef):
        return join(output_path(root, uri.step), uri.subpath)
    return str(uri)


def trained_model_input(train: OutputRef, root: str) -> ArtifactRef:
    """The trained model as a step that reads it records it (evaluate, export, gate): the
    train step's newest checkpoint, the very artifact train recorded as its output, so that a
    trace goes on from the model through training to the corpora. While train has no
    checkpoint (the reader will fail on that), its output folder."""
    from operators.lineage import ArtifactType
    from trainer.rundir import CHECKPOINTS, last_checkpoint, step_name

    ckpt = last_checkpoint(resolve_uri(train, root))
    if ckpt is None:
        return ArtifactRef(train, ArtifactType.MODEL, role="trained_run")
    subpath = "/".join(p for p in (train.subpath, CHECKPOINTS, step_name(ckpt[0])) if p)
    return ArtifactRef(OutputRef(train.step, subpath), ArtifactType.CHECKPOINT, role="trained_run")


def tokenizer_input(model: OutputRef) -> ArtifactRef:
    """The tokenizer as a step that reads its model file records it: the train_tokenizer
    stage's output folder (``model``'s parent), the artifact that stage recorded, so that a
    trace links the two."""
    from operators.pipeline.graph import TOKENIZER

    folder = model.subpath.rsplit("/", 1)[0] if "/" in model.subpath else ""
    return ArtifactRef(OutputRef(model.step, folder), TOKENIZER, role="tokenizer")


def input_fields(ref: ArtifactRef) -> dict[str, Any]:
    """``ref.fields`` plus the version of the content the step reads, when it is known.

    An upstream step output is versioned by that step's version (as its producer records it);
    a raw file by its content id (``operators.pipeline.graph.content_id``, the same id its consumers'
    step versions hash and the ``fetch`` task records; memoised, so no second read of a local
    file). Anything else (a folder, a path that is not there) gets none: the store then links
    the latest version recorded for the URI.
    """
    fields = dict(ref.fields)
    if "version" in fields or "content_hash" in fields:
        return fields
    if isinstance(ref.uri, OutputRef):
        fields["version"] = ref.uri.step.version
        return fields
    try:
        from operators.pipeline.graph import content_id

        fields["content_hash"] = content_id(str(ref.uri))
    except Exception as exc:  # a folder, a missing path, an unreachable store
        log.debug("no content id for input %s: %s", ref.uri, exc)
    return fields


def _check_lineage_home() -> None:
    """The storage root may come from the Airflow Variable ``slipway_home``; the lineage
    database never does (the CLI and the listener cannot read it). Say so when they differ,
    and refuse a remote root without a database URL (a SQLite file in a pod is lost)."""
    from operators.lineage.url import HOME_ENV, LINEAGE_ENV, LineageConfigError, default_home

    if os.environ.get(LINEAGE_ENV) or os.environ.get(HOME_ENV):
        return
    from operators.settings import storage_root

    root = storage_root()
    if root == default_home():
        return
    if "://" in root and not root.startswith("file://"):
        raise LineageConfigError(
            f"storage root {root} is remote: set {LINEAGE_ENV} to a database URL "
            "(Postgres / Cloud SQL in production)"
        )
    log.warning(
        "storage root %s comes from the Airflow Variable slipway_home, which `slipway lineage` "
        "and the listener cannot read: lineage stays in %s/lineage.db. Set %s (or %s) in "
        "the environment of every Airflow process.",
        root,
        default_home(),
        HOME_ENV,
        LINEAGE_ENV,
    )


def _terminated(exc: BaseException) -> bool:
    try:
        from airflow.sdk.exceptions import AirflowTaskTerminated
    except ImportError:  # pragma: no cover - airflow is a dependency
        return isinstance(exc, KeyboardInterrupt)
    return isinstance(exc, AirflowTaskTerminated | KeyboardInterrupt)


class StepLineageMixin:
    """Mixed into operators; needs ``self.task_id`` and ``self.dag_id`` (BaseOperator)."""

    # Filled while executing, read by the OpenLineage methods.
    _ol_inputs: list[str]
    _ol_outputs: list[str]

    # -- settings (late imports: nothing here may slow DAG parsing) ---------------------------

    @staticmethod
    def steps_root() -> str:
        from operators.settings import steps_root

        return steps_root()

    @staticmethod
    def lineage_store() -> Any:
        """The store at :func:`operators.lineage.lineage_url`: the database the listener, the
        run summary and ``slipway lineage`` open under the same environment."""
        from operators.lineage import LineageStore, lineage_url

        _check_lineage_home()
        return LineageStore(lineage_url())

    def require_run_owned(self, context: Mapping[str, Any]) -> None:
        """:func:`require_own_run` on a store of its own. For ``all_done`` tasks, which run
        even after the run's first task was refused: they must not read or write another
        run's records or folder."""
        run_id = context.get("run_id")
        if not run_id:
            return
        store = self.lineage_store()
        try:
            require_own_run(store, run_id, self.dag_id)
        finally:
            store.close()

    @staticmethod
    def run_params(context: Mapping[str, Any]) -> dict[str, Any]:
        """The run's params, any pipeline field its DAG's form leaves out at its default."""
        from operators.pipeline.form import with_defaults

        params = context.get("params") or {}
        return with_defaults(dict(params.items()) if hasattr(params, "items") else dict(params))

    def step_graph(self, context: Mapping[str, Any]) -> Any:
        """The run's step graph (:func:`operators.pipeline.graph.graph_for_run`: from the form and the
        content ids ``fetch`` resolved), built once per task process."""
        from operators.pipeline.graph import graph_for_run

        run_id = context.get("run_id")
        cached = getattr(self, "_step_graph", None)
        if cached is not None and cached[0] == run_id:
            return cached[1]
        graph = graph_for_run(self.run_params(context), run_id)
        self._step_graph = (run_id, graph)
        return graph

    # -- running ------------------------------------------------------------------------------

    def run_step(
        self,
        context: Mapping[str, Any],
        step: Step,
        fn: Callable[[StepSpec], Any],
        *,
        inputs: Iterable[ArtifactRef] = (),
        outputs: Callable[[StepSpec, StepResult], Iterable[ArtifactRef]] = lambda s, r: (),
        failure_properties: Callable[[StepSpec], Mapping[str, Any]] = lambda s: {},
        complete_properties: Callable[[StepResult], Mapping[str, Any]] = lambda r: {},
        runner: StepRunner | None = None,
        output_subpath: str = "",
    ) -> StepResult:
        from operators.steps import resolve

        root = runner.root if runner else self.steps_root()
        runner = runner or StepRunner(root, lease_seconds=LEASE_SECONDS)
        spec = resolve(step, root)
        inputs = list(inputs)
        self._remember_io(
            [resolve_uri(a.uri, root) for a in inputs], [join(spec.output_path, output_subpath)]
        )
        store = self.lineage_store()
        try:
            execution = self.start_step_execution(store, context, step, spec, inputs, root)
            try:
                result = runner.run(step, fn, on_lost=self.on_lease_lost)
            except BaseException as exc:
                self.fail_step_execution(store, execution, exc, lambda: failure_properties(spec))
                raise
            self.finish_step_execution(
                store, execution, result, outputs(spec, result), complete_properties(result), root
            )
            self.log_step(step, result)
            return result
        finally:
            store.close()

    def on_lease_lost(self) -> None:
        """Stop this task's work on a step whose lease another runner took over while
        :meth:`run_step` ran it (this process stalled for longer than the lease). Called from
        the step's heartbeat thread; it should stop only what this process runs alone, never
        what the new owner may have adopted. By default nothing: work in this process runs
        on, and the step still ends in ``LeaseLost``, never SUCCESS from this runner."""

    # -- the lineage record of one step attempt (run_step, and the deferred training path) -----

    def start_step_execution(
        self,
        store: Any,
        context: Mapping[str, Any],
        step: Step,
        spec: StepSpec,
        inputs: Iterable[ArtifactRef],
        root: str,
    ) -> int:
        """RUNNING, with the task (and its map index, for a mapped task), try, output and
        unversioned settings, and the inputs."""
        ti = context.get("ti")
        task: dict[str, Any] = {"task_id": getattr(self, "task_id", None)}
        map_index = getattr(ti, "map_index", None)
        if isinstance(map_index, int) and map_index >= 0:
            # The sweep's cells are one task mapped over the grid: the listener and the
            # leftover closing must tell one cell's execution from its siblings'.
            task["map_index"] = map_index
        execution = store.start_execution(
            step.name,
            run_id=context.get("run_id"),
            pipeline=getattr(self, "dag_id", None),
            step_version=step.version,
            properties={
                **task,
                "try_number": getattr(ti, "try_number", None),
                "output": spec.output_path,
                "unversioned": dict(spec.unversioned),
            },
        )
        for ref in inputs:
            store.record_input(
                execution, resolve_uri(ref.uri, root), ref.type, role=ref.role, **input_fields(ref)
            )
        return execution

    def fail_step_execution(
        self,
        store: Any,
        execution: int,
        exc: BaseException,
        failure_properties: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        """FAILED (CANCELED when the task was terminated), with the error and its context."""
        from operators.lineage import ExecutionState

        state = ExecutionState.CANCELED if _terminated(exc) else ExecutionState.FAILED
        try:
            extra = dict(failure_properties())
        except Exception:  # the original error matters more
            log.exception("execution %s: could not collect failure properties", execution)
            extra = {}
        store.finish_execution(execution, state, error=exc, properties=extra)

    def finish_step_execution(
        self,
        store: Any,
        execution: int,
        result: StepResult,
        outputs: Iterable[ArtifactRef],
        complete_properties: Mapping[str, Any],
        root: str,
    ) -> None:
        """COMPLETE with the outputs (versioned by the step's version), or CACHED when nothing
        ran here (the same versions: a cache hit links the artifacts the first run made)."""
        from operators.lineage import ExecutionState

        for ref in outputs:
            fields = {"version": result.spec.version, **ref.fields}
            store.record_output(
                execution, resolve_uri(ref.uri, root), ref.type, role=ref.role, **fields
            )
        # WAITED: another runner computed it while we waited; either way nothing ran here.
        cached = result.outcome in (Outcome.CACHED, Outcome.WAITED)
        store.finish_execution(
            execution,
            ExecutionState.CACHED if cached else ExecutionState.COMPLETE,
            properties={
                "outcome": str(result.outcome),
                **({} if cached else dict(complete_properties)),
            },
        )

    def log_step(self, step: Step, result: StepResult) -> None:
        logger = getattr(self, "log", log)
        if result.outcome in (Outcome.CACHED, Outcome.WAITED):
            logger.info(
                "%s: %s, output %s already SUCCESS: not recomputed",
                step.key,
                result.outcome,
                result.spec.output_path,
            )
        else:
            logger.info("%s: %s -> %s", step.key, result.outcome, result.spec.output_path)

    # -- OpenLineage --------------------------------------------------------------------------

    def _remember_io(self, inputs: list[str], outputs: list[str]) -> None:
        if not hasattr(self, "_ol_inputs"):
            self._ol_inputs, self._ol_outputs = [], []
        self._ol_inputs.extend(u for u in inputs if u not in self._ol_inputs)
        self._ol_outputs.extend(u for u in outputs if u not in self._ol_outputs)

    def planned_io(self, context: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """Inputs and outputs before running (for the START event); operators override."""
        return [], []

    def _openlineage(self) -> Any:
        from airflow.providers.openlineage.extractors import OperatorLineage

        inputs = getattr(self, "_ol_inputs", None)
        outputs = getattr(self, "_ol_outputs", None)
        if inputs is None:
            try:
                from airflow.sdk import get_current_context

                inputs, outputs = self.planned_io(get_current_context())
            except Exception:  # no context (listener thread) or corpora not there yet
                inputs, outputs = [], []
        return OperatorLineage(
            inputs=[ol_dataset(u) for u in inputs or []],
            outputs=[ol_dataset(u) for u in outputs or []],
        )

    def get_openlineage_facets_on_start(self) -> Any:
        return self._openlineage()

    def get_openlineage_facets_on_complete(self, task_instance: Any = None) -> Any:
        return self._openlineage()

    def get_openlineage_facets_on_failure(self, task_instance: Any = None) -> Any:
        return self._openlineage()


def ol_dataset(uri: str) -> Any:
    """An OpenLineage Dataset named per the spec: ``gs://bucket`` + path, or ``file`` + path."""
    from airflow.providers.common.compat.openlineage.facet import Dataset

    if "://" in uri and not uri.startswith("file://"):
        scheme, rest = uri.split("://", 1)
        bucket, _, path = rest.partition("/")
        return Dataset(namespace=f"{scheme}://{bucket}", name=path or "/")
    return Dataset(namespace="file", name=uri.removeprefix("file://"))


# -- a step split at a deferral --------------------------------------------------------------


@dataclass(frozen=True)
class Submission:
    """What :meth:`DeferredStep.submit` left: a finished ``result`` (a cache hit, a step
    another run completed meanwhile), or a held ``lease`` and what the submission returned."""

    result: StepResult | None = None
    lease: Any = None  # operators.steps.HeldLease, held for the trigger to renew
    value: Mapping[str, Any] = field(default_factory=dict)


class DeferredStep:
    """:meth:`StepLineageMixin.run_step` split at a deferral, for work that outlives the
    task process (a JobSet on GKE followed by a trigger): the same step model and lineage.

    * **start** -- :meth:`begin` starts the lineage execution RUNNING; :meth:`submit` claims
      the step and runs the submission under a lease that stays *held* when it returns (a
      SUCCESS output is a cache hit, recorded and returned as ``Submission.result``);
    * **hold** -- the task defers with ``Submission.lease.to_dict()``; the trigger renews it
      (:mod:`operators.triggers.lease`);
    * **finish** -- on resume, :meth:`finish` ends the lease SUCCESS with the work's value
      and the execution COMPLETE with its outputs, or, if anything raises, the lease FAILED
      (unless it was taken over) and the execution FAILED; :meth:`fail` does the second alone.
    """

    def __init__(
        self,
        operator: StepLineageMixin,
        step: Step,
        *,
        inputs: Iterable[ArtifactRef] = (),
        outputs: Callable[[StepSpec, StepResult], Iterable[ArtifactRef]] = lambda s, r: (),
        failure_properties: Callable[[StepSpec], Mapping[str, Any]] = lambda s: {},
        complete_properties: Callable[[StepResult], Mapping[str, Any]] = lambda r: {},
    ) -> None:
        from operators.steps import resolve

        self.operator = operator
        self.step = step
        self.root = operator.steps_root()
        self.spec = resolve(step, self.root)
        self.inputs = list(inputs)
        self.outputs = outputs
        self.failure_properties = failure_properties
        self.complete_properties = complete_properties
        operator._remember_io(
            [resolve_uri(a.uri, self.root) for a in self.inputs], [self.spec.output_path]
        )

    def begin(self, context: Mapping[str, Any]) -> int:
        """The lineage execution of this attempt, RUNNING, with its inputs."""
        with self._store() as store:
            return self.operator.start_step_execution(
                store, context, self.step, self.spec, self.inputs, self.root
            )

    def submit(self, execution: int, fn: Callable[[StepSpec, Any], Any]) -> Submission:
        """Claim the step and run ``fn(spec, lease)``; the lease stays held when it returns."""
        from operators.steps import Status
        from operators.triggers.lease import SubmittingStepRunner

        runner = SubmittingStepRunner(self.root)
        with self._store() as store:
            try:
                result = runner.run(self.step, lambda spec: fn(spec, runner.lease))
            except BaseException as exc:
                self._record_failure(store, execution, exc)
                raise
            if runner.lease is None or result.status.status is not Status.RUNNING:
                self._record_done(store, execution, result)
                return Submission(result=result)
        return Submission(lease=runner.lease, value=dict(result.status.result or {}))

    def finish(
        self, execution: int, lease_data: Mapping[str, Any], work: Callable[[], Any]
    ) -> StepResult:
        """End the held lease and the execution with ``work()``'s value (or its error)."""
        from operators.steps import HeldLease, LeaseLost, Outcome

        lease = HeldLease.from_dict(lease_data)
        with self._store() as store:
            try:
                record = lease.succeed(work())  # LeaseLost if taken over meanwhile
            except BaseException as exc:
                if not isinstance(exc, LeaseLost):  # a new owner holds it now: leave it be
                    lease.fail(exc)
                self._record_failure(store, execution, exc)
                raise
            result = StepResult(Outcome.RAN, self.spec, record)
            self._record_done(store, execution, result)
        return result

    def fail(
        self, execution: int | None, exc: BaseException, lease_data: Mapping[str, Any] | None
    ) -> None:
        """The work will not finish: the lease FAILED (if held) and the execution FAILED."""
        from operators.steps import HeldLease

        if lease_data:
            HeldLease.from_dict(lease_data).fail(exc)
        if execution is not None:
            with self._store() as store:
                self._record_failure(store, execution, exc)

    # -- records ----------------------------------------------------------------------------

    def _record_failure(self, store: Any, execution: int, exc: BaseException) -> None:
        self.operator.fail_step_execution(
            store, execution, exc, lambda: self.failure_properties(self.spec)
        )

    def _record_done(self, store: Any, execution: int, result: StepResult) -> None:
        self.operator.finish_step_execution(
            store,
            execution,
            result,
            self.outputs(result.spec, result),
            self.complete_properties(result),
            self.root,
        )
        self.operator.log_step(self.step, result)

    @contextlib.contextmanager
    def _store(self) -> Iterator[Any]:
        store = self.operator.lineage_store()
        try:
            yield store
        finally:
            store.close()
