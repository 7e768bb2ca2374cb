"""Plain-text views of lineage records (the ``slipway lineage`` CLI prints these)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from operators.lineage.store import (
    ArtifactRecord,
    ExecutionRecord,
    Linked,
    RunGraph,
    RunSummary,
    TraceNode,
)

_TEE, _LAST, _PIPE, _GAP = "├── ", "└── ", "│   ", "    "


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _duration(record: ExecutionRecord) -> str:
    seconds = record.duration_s
    return "" if seconds is None else f"  {seconds:.1f}s"


def _counts(artifact: ArtifactRecord) -> str:
    counts = artifact.counts or {}
    if "records_in" in counts and "records_out" in counts:
        dropped = sum((counts.get("dropped") or {}).values())
        return (
            f"  (records {counts['records_in']} in, {counts['records_out']} out, {dropped} dropped)"
        )
    shown = ", ".join(f"{k}={v}" for k, v in counts.items() if not isinstance(v, dict))
    return f"  ({shown})" if shown else ""


def _version(artifact: ArtifactRecord) -> str:
    """`` @sha256:1a2b3c4d5e6f``: which content of the URI this is (a refetch is another).

    Step outputs are versioned by their step, whose hash their path already shows: no tag.
    """
    version = artifact.version
    if not version:
        return ""
    algo, _, digest = version.rpartition(":")
    if not algo and digest[:8] in artifact.uri:
        return ""
    return f" @{algo}:{digest[:12]}" if algo else f" @{digest[:12]}"


def _artifact(artifact: ArtifactRecord) -> str:
    return f"{artifact.type} {artifact.uri}{_version(artifact)}{_counts(artifact)}"


def _execution(record: ExecutionRecord) -> str:
    version = f" [{record.step_version[:8]}]" if record.step_version else ""
    line = f"{record.name}{version} {record.state}{_duration(record)}"
    props = record.properties or {}
    if props.get("resumed_from_step") is not None:
        line += f" (resumed from step {props['resumed_from_step']})"
    if record.error:
        line += f": {record.error}"
        if props.get("last_checkpoint_step") is not None:
            line += f" [last checkpoint: step {props['last_checkpoint_step']}]"
    return line


def render_runs(runs: Sequence[RunSummary]) -> str:
    if not runs:
        return "no runs recorded"
    header = ("RUN", "PIPELINE", "STATE", "STARTED (UTC)", "ENDED (UTC)", "STEPS")
    rows = [header] + [
        (
            r.run_id,
            r.pipeline or "-",
            str(r.state),
            _time(r.started_at),
            _time(r.ended_at),
            " ".join(f"{k}={v}" for k, v in sorted(r.counts.items())),
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def render_run(graph: RunGraph) -> str:
    """The run as a tree: steps in start order, each with its inputs and outputs."""
    run = graph.run
    total = " ".join(f"{k}={v}" for k, v in sorted(run.counts.items()))
    lines = [f"run {run.run_id} ({run.pipeline or 'no pipeline'}) {run.state}  [{total}]"]
    for i, node in enumerate(graph.steps):
        last = i == len(graph.steps) - 1
        lines.append((_LAST if last else _TEE) + _execution(node.execution))
        children = [("in ", link) for link in node.inputs] + [
            ("out", link) for link in node.outputs
        ]
        prefix = _GAP if last else _PIPE
        for j, (direction, link) in enumerate(children):
            branch = _LAST if j == len(children) - 1 else _TEE
            lines.append(f"{prefix}{branch}{direction} {_linked(link)}")
    return "\n".join(lines)


def _linked(link: Linked) -> str:
    role = f"{link.role}: " if link.role else ""
    return role + _artifact(link.artifact)


def render_trace(root: TraceNode) -> str:
    """The artifact, then producers and their inputs, down to the raw inputs."""
    lines = [_artifact(root.artifact)]
    lines.extend(_trace_lines(root, ""))
    raw = root.raw_inputs()
    lines.append("")
    lines.append(f"raw inputs ({len(raw)}):")
    lines.extend(f"  {_artifact(a)}" for a in raw)
    return "\n".join(lines)


def _trace_lines(node: TraceNode, prefix: str) -> Iterable[str]:
    if node.producer is None:
        return
    producer = node.producer
    run = f", run {producer.run_id}" if producer.run_id else ""
    code = f", code {producer.code_version[:12]}" if producer.code_version else ""
    yield f"{prefix}{_LAST}produced by {_execution(producer)}{run}{code}"
    inner = prefix + _GAP
    for i, child in enumerate(node.inputs):
        last = i == len(node.inputs) - 1
        raw = "  [raw input]" if child.producer is None else ""
        yield f"{inner}{_LAST if last else _TEE}{_artifact(child.artifact)}{raw}"
        yield from _trace_lines(child, inner + (_GAP if last else _PIPE))
