"""One run read as a report: :func:`run_view` turns a lineage :class:`RunGraph` into the rows
and tables the run page and ``report.html`` show.

A step appears once, as its latest attempt (a cleared and rerun step has several executions;
the table says how many). Counts come from the step's output artifacts (the manifests'
records in/out and drops by reason, a token store's tokens); the training, evaluation,
benchmark and sample records from the artifacts the train and evaluate steps recorded; the
gate's decision from its execution; what a clear-and-rerun resumes from the run summary of the
run's last task (the pipeline's ``record``, ``operators/record.py``; the sweep's ``check``,
``operators/sweep/summary.py``), which probed the step markers when the run ended. A summary
that a step started after (the run cleared and running again) is not used.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.lineage.render import evaluation_output
from operators.lineage.schema import ArtifactType, ExecutionState
from operators.lineage.store import (
    ArtifactRecord,
    ExecutionRecord,
    RunFailure,
    RunGraph,
    RunOutput,
    StepNode,
)
from operators.promotion import HELDOUT_PREFIX, MODEL_URI_PREFIX, Metrics, gate_outcome

TRACEBACK_TAIL_LINES = 12
RUN_SUMMARY = "run_summary"  # the artifact type of record's and the sweep check's summaries
REPORT_ARTIFACT = "run_report"  # record's static report.html (operators/reports/static.py)
BAD_STATES = (ExecutionState.FAILED, ExecutionState.CANCELED)
# Airflow's task states of a task that never ran in the run (None: no state at all).
_NOT_RUN = (None, "upstream_failed", "skipped", "removed", "scheduled", "queued", "none")


@dataclass(frozen=True)
class StepRow:
    """One step of the run: its latest attempt."""

    name: str
    state: str
    attempts: int
    step_version: str | None
    duration_s: float | None
    records_in: int | None = None
    records_out: int | None = None
    dropped: Mapping[str, int] = field(default_factory=dict)
    tokens: int | None = None
    error: str | None = None
    traceback_tail: str | None = None
    resumed_from_step: int | None = None
    last_checkpoint_step: int | None = None
    task_id: str | None = None  # the Airflow task that ran it, where not the step's own name

    @property
    def cached(self) -> bool:
        return self.state == ExecutionState.CACHED

    @property
    def failed(self) -> bool:
        return self.state in BAD_STATES

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


@dataclass(frozen=True)
class Training:
    state: str
    checkpoint: str
    checkpoint_version: str
    steps: int | None
    params: int | None
    loss_start: float | None
    loss_end: float | None
    metrics_path: str | None  # the trainer's metrics.jsonl: the loss curve

    @property
    def output_dir(self) -> str | None:
        return posixpath.dirname(self.metrics_path) if self.metrics_path else None


@dataclass(frozen=True)
class RunView:
    run_id: str
    pipeline: str | None
    state: str
    started_at: Any
    ended_at: Any
    steps: tuple[StepRow, ...]
    training: Training | None
    evaluations: tuple[tuple[str, Mapping[str, Any]], ...]  # (store role, metrics)
    benchmarks: tuple[tuple[str, Mapping[str, Any]], ...]  # (task, metrics)
    samples: Mapping[str, Any]
    gate: Mapping[str, Any] | None
    exports: tuple[tuple[str, str | None], ...]  # (folder, the weights' dtype)
    failures: tuple[StepRow, ...]
    # the run summary's "resume" (None before it is written, and once a rerun has started)
    resume: Mapping[str, Any] | None
    summary_failed: tuple[Mapping[str, Any], ...]  # the run summary's failed steps, first first
    task_states: Mapping[str, str | None] = field(default_factory=dict)  # the summary's, by task
    # The latest train execution's output folder, recorded when it started: where the loss
    # log of a run that failed mid-training is (its Training is None: no checkpoint recorded).
    train_output: str | None = None
    # What validate recorded on the run: "params" (the form's values) and "changed" (those
    # not at the DAG form's defaults). Empty for runs recorded before it did.
    run_properties: Mapping[str, Any] = field(default_factory=dict)
    # The run's static report.html (record's output; None: not written, as for a sweep night)
    report: str | None = None
    # A cleared run going again: what its last summary said a rerun runs, and the tasks that
    # summary had as not run, in its order (empty otherwise). Those not started yet stay listed.
    rerun_pending: tuple[str, ...] = ()

    @property
    def heldout_bits_per_byte(self) -> float | None:
        """The mean bits/byte over the held-out stores: the promotion gate's measure (None
        when a store's is not finite; the runs list shows that case as nan)."""
        metrics = Metrics.from_evaluation({"results": dict(self.evaluations)})
        return metrics.mean_bits_per_byte

    @property
    def not_run(self) -> tuple[tuple[str, str], ...]:
        """(name, why) of what never started in this run: the steps the run summary says a
        rerun runs, and the tasks without steps (the gate) Airflow did not run, with the
        state it gave them (``upstream_failed``)."""
        ran = {row.name for row in self.steps} | {row.task_id for row in self.steps if row.task_id}
        rerun = [step_name(key) for key in (self.resume or {}).get("rerun") or ()]
        # A run whose values validate refused runs nothing on a clear either (it keeps them):
        # the page says to trigger a new run, and no row may say otherwise.
        later = "" if self.refused else "runs on a clear-and-rerun"
        states = self.task_states

        def why(name: str) -> str:
            # a step whose task Airflow left unrun says so as the tasks without steps do
            airflow = f"Airflow: {states[name] or 'no state'}" if name in states else ""
            return "; ".join(filter(None, [airflow, later])) or "not run"

        found = {name: why(name) for name in rerun if name not in ran}
        for task, state in states.items():
            if task not in ran and task not in found and task != "record" and state in _NOT_RUN:
                found[task] = why(task)
        for name in self.rerun_pending:
            if name not in ran and name not in found:
                found[name] = "not started yet in this rerun"
        names = _in_pipeline_order(found, list(states) or self.rerun_pending)
        return tuple((name, found[name]) for name in names)

    @property
    def refused(self) -> bool:
        """The run's values were refused (its ``validate`` failed): nothing after it ran."""
        first = self.first_failure
        return first is not None and first.get("step") == "validate"

    @property
    def scheduled(self) -> bool:
        """A run the schedule (or a backfill of it) made: only such runs does a backfill with
        ``reprocess_behavior=failed`` reprocess. By Airflow's run type, which ``validate``
        records; a run recorded without one goes by the run ids Airflow gives those runs (an
        id a trigger may also choose)."""
        run_type = self.run_properties.get("run_type")
        if run_type is not None:
            return run_type in ("scheduled", "backfill")
        return self.run_id.startswith(("scheduled__", "backfill__"))

    @property
    def metrics_dir(self) -> str | None:
        """Where the trainer's ``metrics.jsonl`` is: the loss curve's source."""
        return self.training.output_dir if self.training else self.train_output

    @property
    def settings(self) -> Mapping[str, Any]:
        return self.run_properties.get("params") or {}

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(self.run_properties.get("changed") or ())

    @property
    def failed(self) -> bool:
        return bool(self.failures or self.summary_failed) or self.state in BAD_STATES

    @property
    def duration_s(self) -> float | None:
        if self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()

    @property
    def first_failure(self) -> Mapping[str, Any] | None:
        """The step that failed first (pipeline order, as the run summary says) and why."""
        if self.summary_failed:
            return self.summary_failed[0]
        if self.failures:
            return {"step": self.failures[0].name, "error": self.failures[0].error}
        return None


def step_name(key: str) -> str:
    """``train-1a2b3c4d`` (a step's key in the run summary) -> ``train``."""
    name, _, version = key.rpartition("-")
    return name if name and len(version) == 8 else key


def _tail(text: str | None, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    if not text:
        return None
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _step_row(node: StepNode, attempts: int) -> StepRow:
    ex: ExecutionRecord = node.execution
    props = dict(ex.properties or {})
    row: dict[str, Any] = {}
    tokens = None
    for link in node.outputs:
        c = dict(link.artifact.counts or {})
        if "records_in" in c and "records_out" in c and "records_in" not in row:
            row = {
                "records_in": c["records_in"],
                "records_out": c["records_out"],
                "dropped": dict(c.get("dropped") or {}),
            }
        if link.artifact.type == ArtifactType.TOKEN_STORE and c.get("num_tokens") is not None:
            tokens = (tokens or 0) + int(c["num_tokens"])
    return StepRow(
        name=ex.name,
        state=str(ex.state),
        attempts=attempts,
        step_version=ex.step_version,
        duration_s=ex.duration_s,
        tokens=tokens,
        error=ex.error,
        traceback_tail=_tail(ex.traceback),
        resumed_from_step=props.get("resumed_from_step"),
        last_checkpoint_step=props.get("last_checkpoint_step"),
        task_id=props.get("task_id") if isinstance(props.get("task_id"), str) else None,
        **row,
    )


def _training(node: StepNode) -> Training | None:
    checkpoint: ArtifactRecord | None = None
    metrics: str | None = None
    for link in node.outputs:
        if link.artifact.type == ArtifactType.CHECKPOINT:
            checkpoint = link.artifact
        elif link.artifact.type == ArtifactType.METRICS:
            metrics = link.artifact.uri
    if checkpoint is None:
        return None
    c = dict(checkpoint.counts or {})
    return Training(
        state=str(node.execution.state),
        checkpoint=checkpoint.uri,
        checkpoint_version=checkpoint.version,
        steps=c.get("steps"),
        params=c.get("params"),
        loss_start=c.get("loss_start"),
        loss_end=c.get("loss_end"),
        metrics_path=metrics,
    )


def _run_state(graph: RunGraph, summary: Mapping[str, Any]) -> str:
    """The run's state as the runs list shows it (lineage's), but settled by the run summary
    when there is one: the record task writes the report while its own execution runs."""
    if not summary:
        return str(graph.run.state)
    failed = summary.get("state") == "FAILED"
    return str(ExecutionState.FAILED if failed else ExecutionState.COMPLETE)


def _in_pipeline_order(names: Iterable[str], tasks: Sequence[str]) -> tuple[str, ...]:
    """``names`` in the order of ``tasks`` (a summary's task states, which ``record`` writes
    in the DAG's order); steps without a task of their own after them, as they came."""
    order = {task: i for i, task in enumerate(tasks)}
    return tuple(sorted(names, key=lambda name: order.get(name, len(order))))


def _output(node: StepNode | None) -> str | None:
    output = (node.execution.properties or {}).get("output") if node else None
    return output if isinstance(output, str) else None


def run_view(graph: RunGraph) -> RunView:
    attempts: dict[str, int] = {}
    latest: dict[str, StepNode] = {}
    for node in graph.steps:  # start order: the last attempt of each step wins
        attempts[node.execution.name] = attempts.get(node.execution.name, 0) + 1
        latest[node.execution.name] = node
    summary: Mapping[str, Any] = {}
    rerun_pending: tuple[str, ...] = ()
    summarized_by = None  # the execution that wrote the run summary (record, the sweep's check)
    rows, evaluations, benchmarks, exports = [], [], [], []
    samples: Mapping[str, Any] = {}
    training = None
    report = None
    for name, node in latest.items():
        for link in node.outputs:
            a = link.artifact
            if a.type == RUN_SUMMARY:
                summary = dict(a.properties or {})
                summarized_by = node.execution
            elif a.type == ArtifactType.EVAL_RESULT:
                kind, label = evaluation_output(link)
                if kind == "benchmark":
                    benchmarks.append((label, dict(a.counts or {})))
                elif kind == "samples":
                    samples = dict(a.properties or {})
                else:
                    evaluations.append((label, dict(a.counts or {})))
            elif a.type == ArtifactType.HF_EXPORT:
                exports.append((a.uri, (a.properties or {}).get("dtype")))
            elif a.type == REPORT_ARTIFACT:
                report = a.uri
        found = _training(node)
        if found is not None and (name == "train" or training is None):
            training = found
        if name != "record":  # the run's own summary: not a step of the pipeline
            rows.append(_step_row(node, attempts[name]))
    if summarized_by is not None and any(
        node.execution.started_at > summarized_by.started_at for node in graph.steps
    ):
        # A step started after the summary: the run was cleared and runs again, so the
        # summary's failures, resume plan, task states, state and end are an earlier
        # attempt's. The executions say where the rerun is until its last task sums it up;
        # what that summary had as not run stays listed until it starts.
        earlier_states = summary.get("task_states") or {}
        earlier = [step_name(key) for key in (summary.get("resume") or {}).get("rerun") or ()]
        earlier += [
            task
            for task, state in earlier_states.items()
            if task != "record" and state in _NOT_RUN and task not in earlier
        ]
        rerun_pending = _in_pipeline_order(earlier, list(earlier_states))
        summary, summarized_by = {}, None
    ended_at = graph.run.ended_at
    if summary and ended_at is None and summarized_by is not None:
        # Written by the run's last task while it runs: the run ended when that task began.
        ended_at = summarized_by.started_at
    return RunView(
        run_id=graph.run.run_id,
        pipeline=graph.run.pipeline,
        state=_run_state(graph, summary),
        started_at=graph.run.started_at,
        ended_at=ended_at,
        steps=tuple(rows),
        training=training,
        evaluations=tuple(evaluations),
        benchmarks=tuple(benchmarks),
        samples=samples,
        gate=gate_outcome([node.execution for node in graph.steps]),
        exports=tuple(exports),
        failures=tuple(r for r in rows if r.failed),
        resume=summary.get("resume"),
        summary_failed=tuple(summary.get("failed") or ()),
        task_states=dict(summary.get("task_states") or {}),
        train_output=_output(latest.get("train")),
        run_properties=dict(graph.run.properties),
        rerun_pending=rerun_pending,
        report=report,
    )


def loss_curve(view: RunView) -> list[tuple[int, float]]:
    """(step, loss) from the trainer's ``metrics.jsonl`` (the last line per step wins, as a
    resumed run logs steps again); empty when there is no log (not trained yet, or gone)."""
    if view.metrics_dir is None:
        return []
    from trainer.rundir import read_metrics

    try:
        records = read_metrics(view.metrics_dir)
    except OSError:
        return []
    return [(int(m["step"]), float(m["loss"])) for m in records if m.get("loss") is not None]


# -- many runs at once: the runs list's results ---------------------------------------------

# What :func:`run_results` reads (``LineageStore.run_outputs``): these steps' outputs of these
# types, from each step's latest attempt.
RESULT_STEPS = ("train", "evaluate", "gate")
RESULT_TYPES = (ArtifactType.CHECKPOINT, ArtifactType.EVAL_RESULT, ArtifactType.PROMOTED_MODEL)


@dataclass(frozen=True)
class RunResult:
    """A pipeline run's results in a line: the trained model's last loss (or, where its latest
    training failed, the loss it last logged and at which step), its mean held-out bits/byte
    (the gate's measure; NaN when a store's is not finite), and the model it promoted
    (``name @version``)."""

    train_loss: float | None = None
    train_failed_at: int | None = None  # the step of ``train_loss`` of a failed training
    heldout_bits_per_byte: float | None = None
    promoted: str | None = None
    promoted_uri: str | None = None
    promoted_version: str | None = None
    promoted_current: bool = False  # the model name's latest promotion among the runs


def run_results(
    outputs: Iterable[RunOutput], failures: Iterable[RunFailure] = ()
) -> dict[str, RunResult]:
    """Each run's :class:`RunResult`, from the outputs of its latest ``train``, ``evaluate``
    and ``gate`` (``LineageStore.run_outputs(RESULT_STEPS, RESULT_TYPES)``), and from its
    latest ``train`` where that failed (``LineageStore.run_failures(["train"])``: the loss
    the operator recorded as it failed)."""
    by_step: dict[tuple[str, str], list[RunOutput]] = {}
    for out in outputs:
        by_step.setdefault((out.run_id, out.step), []).append(out)
    found: dict[str, dict[str, Any]] = {}
    for failure in failures:
        loss = failure.properties.get("last_logged_loss")
        if failure.step == "train" and isinstance(loss, int | float):
            found[failure.run_id] = {
                "train_loss": float(loss),
                "train_failed_at": failure.properties.get("last_logged_loss_step"),
            }
    latest_promotion: dict[str, tuple[int, str]] = {}  # model URI -> (gate execution, run)
    for (run_id, step), outs in by_step.items():
        result = found.setdefault(run_id, {})
        if step == "train":
            losses = [o.counts.get("loss_end") for o in outs if o.type == ArtifactType.CHECKPOINT]
            result["train_loss"] = next((x for x in reversed(losses) if x is not None), None)
        elif step == "evaluate":
            stores = {
                o.role: o.counts for o in outs if o.role and o.type == ArtifactType.EVAL_RESULT
            }
            metrics = Metrics.from_evaluation({"results": stores})
            mean = metrics.mean_bits_per_byte
            if mean is None and any(m.startswith(HELDOUT_PREFIX) for m in metrics.missing):
                mean = math.nan  # evaluated, but a store's value is not finite: not "blank"
            result["heldout_bits_per_byte"] = mean
        elif step == "gate":
            promoted = [o for o in outs if o.type == ArtifactType.PROMOTED_MODEL]
            if promoted:
                last = promoted[-1]
                name = last.uri.removeprefix(MODEL_URI_PREFIX)
                result["promoted"] = f"{name} @{last.version}"
                result["promoted_uri"], result["promoted_version"] = last.uri, last.version
                newest = latest_promotion.get(last.uri)
                if newest is None or newest[0] < last.execution_id:
                    latest_promotion[last.uri] = (last.execution_id, run_id)
    for _, run_id in latest_promotion.values():
        found[run_id]["promoted_current"] = True
    return {run_id: RunResult(**fields) for run_id, fields in found.items()}
