"""The promotion gate's decision, and what "the currently promoted model of a name" is.

After ``evaluate``, the pipeline's ``gate`` task (:mod:`operators.gate`) promotes the run's model
under the form's ``model_name`` if every criterion the form sets holds:

* ``gate_max_bits_per_byte``: the mean bits/byte over the held-out stores (``heldout-*``, one
  per training source) at most this;
* ``gate_min_accuracy``: per benchmark task, ``acc`` at least this (a task with no result
  fails, "no result for <task>": a criterion never passes on a missing number);
* ``gate_max_regression``: no held-out store's bits/byte above the promoted model's by more
  than this margin, and no task's ``acc`` below it by more than the margin (absolute), over
  the stores and tasks both have.

No criterion set: the gate passes and promotes (a table that says so). Each criterion is a row
of a :class:`Decision`: threshold, value, and by how much it failed (or the room it left).

**Promotions live in lineage**, not in Airflow: one artifact of type :data:`PROMOTED_MODEL` per
promotion, at the model's URI (``slipway://models/<name>``, the same URI as the Airflow Asset
the gate updates) with a version of its own (``promotion:<gate execution id>``), produced by
the ``gate`` execution of the run that promoted it. Its properties hold the trained run, the
checkpoint, the metrics and the DAG run. The store's latest version of a URI is the one
recorded last, so the currently promoted model of a name is simply
``store.artifact(model_uri(name))`` (:func:`current_promotion`), and every earlier promotion is
still there (:func:`promotions`), traceable back to the raw corpora like any other output.

Airflow-free and cheap to import (the run form takes its name pattern from here at DAG parse
time; the lineage store is imported only by the functions that use it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from operators.lineage.schema import ArtifactType

# Held-out stores are named heldout-<source> by the step graph (operators/pipeline/graph.py).
HELDOUT_PREFIX = "heldout-"
# The lineage artifact type of one promotion.
PROMOTED_MODEL = ArtifactType.PROMOTED_MODEL
# The gate's outlet: an alias, because the asset's name is only known at run time (the form's
# model_name). Downstream DAGs schedule on Asset("slipway://models/<name>") or on the alias.
MODELS_ALIAS = "slipway-models"
MODEL_URI_PREFIX = "slipway://models/"
# A model name goes into an Asset URI and the lineage URI: lowercase letters, digits and '-'.
MODEL_NAME_BODY = r"[a-z0-9][a-z0-9-]{0,62}"
# Decimals in the table: bits/byte and accuracies differ in the third or fourth.
_DIGITS = 4


def model_uri(name: str) -> str:
    """The promoted model's URI: the Airflow Asset's and the lineage artifact's."""
    return f"{MODEL_URI_PREFIX}{name}"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- what the gate compares -----------------------------------------------------------------------


@dataclass(frozen=True)
class Criteria:
    """The form's gate fields. None / empty: that criterion is not set."""

    max_bits_per_byte: float | None = None
    min_accuracy: Mapping[str, float] = field(default_factory=dict)
    max_regression: float | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Criteria:
        return cls(
            max_bits_per_byte=params.get("gate_max_bits_per_byte"),
            min_accuracy=dict(params.get("gate_min_accuracy") or {}),
            max_regression=params.get("gate_max_regression"),
        )

    @property
    def empty(self) -> bool:
        return (
            self.max_bits_per_byte is None and not self.min_accuracy and self.max_regression is None
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_bits_per_byte": self.max_bits_per_byte,
            "min_accuracy": dict(self.min_accuracy),
            "max_regression": self.max_regression,
        }


@dataclass(frozen=True)
class Metrics:
    """What the gate reads of an evaluation: bits/byte per held-out store, acc per task.

    ``missing``: held-out stores and tasks the evaluation lists without a finite value (a
    criterion on them fails rather than being computed over the rest).
    """

    bits_per_byte: Mapping[str, float] = field(default_factory=dict)
    accuracy: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    # What each metric was measured on (:func:`measurements`): two values of one name compare
    # only when this is the same. Empty in promotions recorded before it was kept.
    measured: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_evaluation(cls, evaluation: Mapping[str, Any]) -> Metrics:
        """From the evaluate task's result: ``results`` (store -> ``bits_per_byte``...) and
        ``benchmarks`` (task -> ``acc``...; absent until the benchmarks run)."""
        bpb: dict[str, float] = {}
        acc: dict[str, float] = {}
        missing: list[str] = []
        for store, r in sorted((evaluation.get("results") or {}).items()):
            if store.startswith(HELDOUT_PREFIX):
                value = (r or {}).get("bits_per_byte")
                if _finite(value):
                    bpb[store] = float(value)
                else:
                    missing.append(store)
        for task, b in sorted((evaluation.get("benchmarks") or {}).items()):
            value = (b or {}).get("acc")
            if _finite(value):
                acc[task] = float(value)
            else:
                missing.append(task)
        return cls(bpb, acc, tuple(missing))

    @property
    def mean_bits_per_byte(self) -> float | None:
        """The mean over the held-out stores; None if there are none, or one has no value."""
        if not self.bits_per_byte or any(m.startswith(HELDOUT_PREFIX) for m in self.missing):
            return None
        return sum(self.bits_per_byte.values()) / len(self.bits_per_byte)

    def same_data(self, other: Metrics, name: str) -> bool:
        """Whether ``name`` was measured on the same data here and in ``other``; also when
        either did not record it (a promotion from before ``measured`` was kept)."""
        here, there = self.measured.get(name), other.measured.get(name)
        return here is None or there is None or here == there

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits_per_byte": dict(self.bits_per_byte),
            "mean_bits_per_byte": self.mean_bits_per_byte,
            "accuracy": dict(self.accuracy),
            "missing": list(self.missing),
            "measured": dict(self.measured),
        }

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> Metrics:
        return cls(
            {k: float(v) for k, v in (body.get("bits_per_byte") or {}).items() if _finite(v)},
            {k: float(v) for k, v in (body.get("accuracy") or {}).items() if _finite(v)},
            tuple(body.get("missing") or ()),
            dict(body.get("measured") or {}),
        )


def measurements(evaluate_config: Mapping[str, Any]) -> dict[str, str]:
    """What each metric of an evaluation was measured on, from its evaluate step's config: a
    held-out store's bits/byte on that token store (its step, hence its text and tokenizer)
    and ``max_tokens`` of it; a task's accuracy on its evaluation set (content id) and
    ``task_limit`` examples of it."""
    from trainer.tasks import TASKS

    out: dict[str, str] = {}
    limit = f"max_tokens={evaluate_config.get('max_tokens')}"
    for name, ref in (evaluate_config.get("stores") or {}).items():
        where = getattr(getattr(ref, "step", None), "key", None) or str(ref)
        out[name] = f"{where} {limit}"
    sets = evaluate_config.get("task_sets") or {}
    for task in evaluate_config.get("tasks") or ():
        content = str(sets.get(TASKS[task].eval_set) or "?")
        out[task] = (
            f"{content.removeprefix('sha256:')[:12]} limit={evaluate_config.get('task_limit')}"
        )
    return out


@dataclass(frozen=True)
class Promotion:
    """One promotion of a model name, as lineage holds it."""

    name: str
    uri: str
    version: str
    run_id: str | None
    model: str | None  # the train step's output (the trained run)
    checkpoint: str | None
    metrics: Metrics
    promoted_at: datetime | None
    export: str | None = None  # the Hugging Face folder, where the model was exported

    @classmethod
    def from_artifact(cls, artifact: Any) -> Promotion:
        props = dict(artifact.properties or {})
        return cls(
            name=props.get("name") or artifact.uri.removeprefix(MODEL_URI_PREFIX),
            uri=artifact.uri,
            version=artifact.version,
            run_id=props.get("run_id"),
            model=props.get("model"),
            checkpoint=props.get("checkpoint"),
            metrics=Metrics.from_dict(props.get("metrics") or {}),
            promoted_at=artifact.created_at,
            export=props.get("export"),
        )

    def describe(self) -> str:
        return f"{self.uri} @{self.version} (run {self.run_id})"


# -- the decision -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One row of the decision: ``value`` against ``threshold`` (``op``: "<=" or ">=").

    ``shortfall``: by how much the value misses the threshold (> 0: failed by that much; <= 0:
    the room it left); None when there is no value to compare (``note`` says why).
    """

    criterion: str
    op: str
    threshold: float | None
    value: float | None
    passed: bool
    note: str = ""
    # Not judged (measured on other data than what it would be compared with): never a pass.
    skipped: bool = False

    @property
    def shortfall(self) -> float | None:
        if self.value is None or self.threshold is None:
            return None
        diff = self.value - self.threshold
        return diff if self.op == "<=" else -diff

    def outcome(self) -> str:
        if self.skipped:
            return f"not compared: {self.note}"
        if self.passed:
            text = "pass"
            if self.shortfall is not None:
                text += f" ({abs(self.shortfall):.{_DIGITS}f} to spare)"
        elif self.shortfall is not None:
            text = f"FAIL by {self.shortfall:.{_DIGITS}f}"
        else:
            text = "FAIL"
        return f"{text}: {self.note}" if self.note else text

    def to_dict(self) -> dict[str, Any]:
        return {
            "criterion": self.criterion,
            "op": self.op,
            "threshold": self.threshold,
            "value": self.value,
            "passed": self.passed,
            "shortfall": self.shortfall,
            "note": self.note,
            "skipped": self.skipped,
        }


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.{_DIGITS}f}"


@dataclass(frozen=True)
class Decision:
    """Every criterion checked; the model is promoted if all passed (also when none is set)."""

    checks: tuple[Check, ...]
    baseline: Promotion | None = None
    # Promoted with no criterion set over a better model: said in the table and the summary,
    # not refused (the form's criteria refuse).
    warning: str | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def table(self) -> str:
        """The plain-text table: criterion, threshold, value, outcome (failed by how much)."""
        if not self.checks:
            text = "no criterion set: promoted as evaluated"
            return f"{text}\nwarning: {self.warning}" if self.warning else text
        header = ("criterion", "threshold", "value", "outcome")
        rows = [header] + [
            (c.criterion, f"{c.op} {_num(c.threshold)}", _num(c.value), c.outcome())
            for c in self.checks
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
            for r in rows
        ]
        lines.insert(1, "-" * max(len(line) for line in lines))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: what the gate decided."""
        if not self.checks:
            return "passed: no criterion set" + (
                " (worse than the model it replaces)" if self.warning else ""
            )
        judged = [c for c in self.checks if not c.skipped]
        if self.passed:
            skipped = len(self.checks) - len(judged)
            return f"passed: {len(judged)} criteria" + (
                f" ({skipped} not compared)" if skipped else ""
            )
        names = ", ".join(c.criterion for c in self.failed)
        return f"failed {len(self.failed)} of {len(judged)} criteria: {names}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "checks": [c.to_dict() for c in self.checks],
            "table": self.table(),
            "warning": self.warning,
            "baseline": None
            if self.baseline is None
            else {
                "uri": self.baseline.uri,
                "version": self.baseline.version,
                "run_id": self.baseline.run_id,
            },
        }


def _bits_per_byte_check(limit: float, metrics: Metrics) -> Check:
    stores = sorted(metrics.bits_per_byte) + [
        m for m in metrics.missing if m.startswith(HELDOUT_PREFIX)
    ]
    criterion = f"held-out bits/byte, mean of {len(stores)} stores"
    mean = metrics.mean_bits_per_byte
    if mean is None:
        missing = [m for m in metrics.missing if m.startswith(HELDOUT_PREFIX)]
        note = (
            f"no bits/byte for {', '.join(missing)}"
            if missing
            else f"no result for a held-out store ({HELDOUT_PREFIX}*)"
        )
        return Check(criterion, "<=", limit, None, False, note)
    return Check(criterion, "<=", limit, mean, mean <= limit)


def _accuracy_check(task: str, minimum: float, metrics: Metrics) -> Check:
    criterion = f"{task} acc"
    value = metrics.accuracy.get(task)
    if value is None:
        return Check(criterion, ">=", minimum, None, False, f"no result for {task}")
    return Check(criterion, ">=", minimum, value, value >= minimum)


def _regression_checks(margin: float, metrics: Metrics, baseline: Promotion | None) -> list[Check]:
    if baseline is None:
        return [
            Check(
                "no regression vs the promoted model",
                "<=",
                margin,
                None,
                True,
                "no model of this name promoted yet: nothing to regress against",
            )
        ]
    before = baseline.metrics
    checks: list[Check] = []

    def other_data(name: str) -> Check | None:
        """A skipped row where the two values of ``name`` were measured on different data
        (another held-out text, tokenizer, max_tokens, task set or limit): not comparable, so
        not compared; shown, so that nobody takes it for a pass."""
        if metrics.same_data(before, name):
            return None
        now, was = metrics.measured[name], before.measured[name]
        store = name.startswith(HELDOUT_PREFIX)
        return Check(
            f"{name} {'bits/byte' if store else 'acc'} vs promoted",
            "<=" if store else ">=",
            None,
            None,
            True,
            f"measured on {now}, the promoted model on {was}",
            skipped=True,
        )

    # Per store and per task, over those both have: a mean over different sources (another
    # mixture) would compare different things.
    for store in sorted(set(metrics.bits_per_byte) & set(before.bits_per_byte)):
        if (refused := other_data(store)) is not None:
            checks.append(refused)
            continue
        was, now = before.bits_per_byte[store], metrics.bits_per_byte[store]
        limit = was + margin
        checks.append(
            Check(
                f"{store} bits/byte vs promoted",
                "<=",
                limit,
                now,
                now <= limit,
                f"promoted {_num(was)}",
            )
        )
    for task in sorted(set(metrics.accuracy) & set(before.accuracy)):
        if (refused := other_data(task)) is not None:
            checks.append(refused)
            continue
        was, now = before.accuracy[task], metrics.accuracy[task]
        limit = was - margin
        checks.append(
            Check(
                f"{task} acc vs promoted", ">=", limit, now, now >= limit, f"promoted {_num(was)}"
            )
        )
    if not [c for c in checks if not c.skipped]:
        # A regression criterion that compares nothing would pass silently.
        why = (
            "every one in common was measured on other data"
            if checks
            else "no held-out store or task in common"
        )
        checks.append(
            Check(
                "no regression vs the promoted model",
                "<=",
                margin,
                None,
                False,
                f"{why} with {baseline.describe()}; to start a new baseline, promote once "
                "without gate_max_regression",
            )
        )
    return checks


def decide(criteria: Criteria, metrics: Metrics, baseline: Promotion | None = None) -> Decision:
    """Check every criterion the form sets against the evaluation's ``metrics`` and, for the
    regression margin, the currently promoted model of the same name (``baseline``)."""
    checks: list[Check] = []
    if metrics.missing:
        # Whatever the criteria: a NaN or infinite held-out loss is a diverged model, and a
        # metric without a value cannot be compared with the model it would replace.
        checks.append(
            Check(
                "evaluated metrics without a finite value",
                "<=",
                0,
                len(metrics.missing),
                False,
                f"{', '.join(metrics.missing)} (a diverged model?)",
            )
        )
    if criteria.max_bits_per_byte is not None:
        checks.append(_bits_per_byte_check(float(criteria.max_bits_per_byte), metrics))
    for task, minimum in sorted(criteria.min_accuracy.items()):
        checks.append(_accuracy_check(task, float(minimum), metrics))
    if criteria.max_regression is not None:
        checks += _regression_checks(float(criteria.max_regression), metrics, baseline)
    return Decision(tuple(checks), baseline, None if checks else _worse_than(metrics, baseline))


def _worse_than(metrics: Metrics, baseline: Promotion | None) -> str | None:
    """Why a model promoted without criteria is worse than the one it replaces (held-out
    bits/byte, mean over the stores both have), or None."""
    if baseline is None:
        return None
    before = baseline.metrics.bits_per_byte
    shared = sorted(
        s
        for s in set(metrics.bits_per_byte) & set(before)
        if metrics.same_data(baseline.metrics, s)
    )
    if not shared:
        return None
    now = sum(metrics.bits_per_byte[s] for s in shared) / len(shared)
    was = sum(before[s] for s in shared) / len(shared)
    if now <= was:
        return None
    return (
        f"held-out bits/byte {now:.{_DIGITS}f} (mean of {len(shared)} stores) is worse than "
        f"{was:.{_DIGITS}f} for the model it replaces, {baseline.uri} @{baseline.version} (run "
        f"{baseline.run_id}); set gate_max_regression to keep the better one"
    )


# -- promotions in lineage --------------------------------------------------------------------


def promotions(store: Any, name: str) -> list[Promotion]:
    """Every promotion of ``name``, oldest first (a :class:`~operators.lineage.LineageStore`)."""
    return [
        Promotion.from_artifact(a)
        for a in store.artifact_versions(model_uri(name))
        if a.type == PROMOTED_MODEL
    ]


def current_promotion(store: Any, name: str, *, exclude_run: str | None = None) -> Promotion | None:
    """The currently promoted model of ``name``: its latest promotion, or None.

    ``exclude_run``: skip promotions that run made, so that a gate cleared and run again never
    takes its own earlier promotion for the model to beat.
    """
    if exclude_run is None:  # the latest version alone: one row, however many promotions
        from operators.lineage import NotFound

        try:
            latest = store.artifact(model_uri(name))
        except NotFound:
            return None
        if latest.type == PROMOTED_MODEL:
            return Promotion.from_artifact(latest)
    found = [p for p in promotions(store, name) if exclude_run is None or p.run_id != exclude_run]
    return found[-1] if found else None


def latest_version(store: Any, name: str) -> str | None:
    """The version of the latest artifact at ``name``'s URI, None if there is none: what a
    gate reads before it decides, and hands :func:`record_promotion` as ``if_latest``."""
    from operators.lineage import NotFound

    try:
        return store.artifact(model_uri(name)).version
    except NotFound:
        return None


def promotion_version(execution: int) -> str:
    """One promotion's artifact version: unique per gate execution, so each promotion is a new
    version of the model's URI and the latest recorded is the current one."""
    return f"promotion:{execution}"


def record_promotion(
    store: Any,
    execution: int,
    name: str,
    metrics: Metrics,
    *,
    run_id: str | None,
    pipeline: str | None,
    model: str | None,
    checkpoint: str | None,
    step: int | None,
    decision: Decision,
    if_latest: str | None,
    export: str | None = None,
) -> Promotion:
    """Record the gate execution's output: the promoted model of ``name`` (see the module
    docstring). Returns it as :func:`current_promotion` will now read it.

    ``if_latest``: :func:`latest_version` as read *before* the decision's baseline. If another
    gate promoted a model of ``name`` since, the decision was made against a model that is no
    longer the current one: nothing is recorded and :class:`~operators.lineage.Superseded` is
    raised, so of two gates deciding at once, one promotes and the other must decide again.
    """
    counts: dict[str, Any] = {}
    if metrics.mean_bits_per_byte is not None:
        counts["heldout_bits_per_byte"] = round(metrics.mean_bits_per_byte, 6)
    counts.update({f"acc_{t}": round(v, 6) for t, v in sorted(metrics.accuracy.items())})
    properties = {
        "name": name,
        "run_id": run_id,
        "pipeline": pipeline,
        "model": model,
        "checkpoint": checkpoint,
        "step": step,
        "export": export,  # the Hugging Face folder (trainer/export.py), None for MoE
        "metrics": metrics.to_dict(),
        "gate": decision.to_dict(),
        "previous": None if decision.baseline is None else decision.baseline.version,
    }
    store.record_output(
        execution,
        model_uri(name),
        PROMOTED_MODEL,
        role="promoted",
        version=promotion_version(execution),
        if_latest=if_latest,
        counts=counts,
        properties=properties,
    )
    return Promotion.from_artifact(store.artifact(model_uri(name), promotion_version(execution)))


def gate_outcome(executions: Sequence[Any]) -> dict[str, Any] | None:
    """The last ``gate`` execution among a run's ``executions`` as the run summary shows it:
    state, model, whether it promoted and, on failure, the table of failed criteria. None
    when the run has no gate execution."""
    gates = [ex for ex in executions if ex.name == "gate"]
    if not gates:
        return None
    ex = gates[-1]
    props = dict(ex.properties or {})
    gate = dict(props.get("gate") or {})
    promoted = props.get("promoted") or {}
    return {
        "state": str(ex.state),
        "model_name": props.get("model_name"),
        "promoted": bool(promoted),
        # The criteria passed: a gate that did not promote all the same failed on something
        # else (another gate promoted first), which its error says.
        "passed": bool(gate.get("passed")),
        "uri": promoted.get("uri"),
        "version": promoted.get("version"),
        "summary": gate.get("summary"),
        "table": gate.get("table"),
        "warning": gate.get("warning"),
        "error": ex.error,
    }


def gate_line(outcome: Mapping[str, Any] | None) -> str | None:
    """The run summary's line for the gate (:func:`gate_outcome`), or None without a gate."""
    if outcome is None:
        return None
    name = outcome.get("model_name") or "the model"
    if outcome.get("promoted"):
        line = f"gate: promoted {outcome['uri']} @{outcome['version']} ({outcome.get('summary')})"
        return f"{line}\n  warning: {outcome['warning']}" if outcome.get("warning") else line
    if outcome.get("summary") and not outcome.get("passed"):
        # The failed criteria's table is the gate's error, listed under failures.
        return f"gate: {outcome['state']}, {name} not promoted ({outcome['summary']})"
    return f"gate: {outcome['state']}, {name} not promoted: {outcome.get('error')}"
