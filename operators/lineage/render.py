"""Plain-text views of lineage records: runs, one run (:func:`render_run`, the one run printer:
the end-of-run summary, ``slipway lineage show`` and ``make demo-data`` print it), traces."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

from operators.lineage.schema import ExecutionState
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
        # one line in a tree: a multi-line error (validate's list of problems) joined by " | "
        line += ": " + " | ".join(
            part.strip() for part in record.error.splitlines() if part.strip()
        )
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


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


BENCHMARK_ROLE = "benchmark-"  # operators/evaluation.py's role for a task's result


def _score(value: object, stderr: object) -> str:
    if not isinstance(value, float | int):
        return f"{'-':>15}"
    err = f" ± {stderr:.3f}" if isinstance(stderr, float | int) else ""
    return f"{value:>7.3f}{err:<8}"


def _chance_gap(metrics: Mapping[str, object]) -> tuple[float, float] | None:
    """(acc - chance, two standard errors), or None without both numbers."""
    acc, err, chance = metrics.get("acc"), metrics.get("acc_stderr"), metrics.get("chance")
    if not (isinstance(acc, float | int) and isinstance(chance, float | int)):
        return None
    return acc - chance, 2 * (err if isinstance(err, float | int) else 0.0)


def near_chance(metrics: Mapping[str, object]) -> bool:
    """The task's accuracy is within two standard errors of its chance level."""
    gap = _chance_gap(metrics)
    return gap is not None and abs(gap[0]) <= gap[1]


def below_chance(metrics: Mapping[str, object]) -> bool:
    """The task's accuracy is more than two standard errors under its chance level."""
    gap = _chance_gap(metrics)
    return gap is not None and gap[0] < -gap[1]


CHANCE_NOTE = (
    "a model this small and briefly trained is expected to score near chance on these tasks"
)
BELOW_CHANCE_NOTE = (
    "below chance is no skill in reverse: a model that gives every question the same answer "
    "scores there on a task whose answers are unbalanced (boolq's are 62% yes)"
)


def render_benchmarks(rows: Sequence[tuple[str, Mapping[str, object]]]) -> list[str]:
    """The benchmark table: task, n, shots, acc and acc_norm with standard errors, chance.
    A task whose accuracy is within two standard errors of chance is marked ``~chance``: at
    the demo's sizes that is every task, and the table should say so rather than let a number
    pass for skill. One more than two standard errors under it is marked ``below chance``."""
    header = f"{'task':<16}{'n':>6}{'shots':>6}  {'acc':>15}  {'acc_norm':>15}  {'chance':>6}"
    lines = ["benchmarks (lm-evaluation-harness formats; trainer/tasks.py):", "  " + header]
    near = below = 0
    for task, c in rows:
        acc, err, chance = c.get("acc"), c.get("acc_stderr"), c.get("chance")
        at_chance, under = near_chance(c), below_chance(c)
        near += at_chance
        below += under
        mark = "  ~chance" if at_chance else "  below chance" if under else ""
        extra = f"  perplexity {c['perplexity']:.4g}" if c.get("perplexity") is not None else ""
        if c.get("truncated"):  # contexts cut from the left to fit seq_len: shots partly unseen
            extra += f"  {c['truncated']} of {c.get('n')} contexts cut to fit"
        lines.append(
            f"  {task:<16}{c.get('n')!s:>6}{c.get('shots', 0)!s:>6}  {_score(acc, err)}  "
            f"{_score(c.get('acc_norm'), c.get('acc_norm_stderr'))}  "
            f"{chance if chance is None else round(float(chance), 3)!s:>6}"
            f"{mark}{extra}"
        )
    if near:
        lines.append(
            f"  {near} of {len(rows)} within 2 standard errors of chance (~chance): {CHANCE_NOTE}"
        )
    if below:
        lines.append(
            f"  {below} of {len(rows)} more than 2 standard errors under chance: "
            f"{BELOW_CHANCE_NOTE}"
        )
    return lines


SAMPLES_ROLE = "samples"


def evaluation_output(link: Linked) -> tuple[str, str]:
    """What an ``eval_result`` output of evaluate is, by its role: ``("benchmark", task)``,
    ``("samples", "")`` or ``("store", role)`` (a held-out store's metrics)."""
    role = link.role or link.artifact.uri
    if role.startswith(BENCHMARK_ROLE):
        return "benchmark", role[len(BENCHMARK_ROLE) :]
    if role == SAMPLES_ROLE:
        return "samples", ""
    return "store", role


def render_samples(samples: Mapping[str, object]) -> list[str]:
    """The fixed prompts' completions, one line each (newlines shown as ⏎)."""
    if samples.get("skipped"):
        return [f"samples: none ({samples['skipped']})"]
    lines = [f"samples ({samples.get('decoding', 'greedy')}):"]
    for c in samples.get("completions") or []:
        text = (c["prompt"] + "|" + c["completion"]).replace("\n", "⏎")
        lines.append(f"  {text[:120]}{'…' if len(text) > 120 else ''}")
    return lines


def run_failed(graph: RunGraph) -> bool:
    """The run failed, or its latest attempt of some step did (FAILED or CANCELED)."""
    latest = {node.execution.name: node.execution for node in graph.steps}
    bad = (ExecutionState.FAILED, ExecutionState.CANCELED)
    return graph.run.state is ExecutionState.FAILED or any(e.state in bad for e in latest.values())


def render_run(
    graph: RunGraph,
    *,
    artifacts: bool = False,
    lineage: str | None = None,
    outputs_root: str | None = None,
) -> str:
    """One run, the one way Slipway prints a run (the end-of-run summary, ``slipway lineage
    show``, ``make demo-data``): per step its state, records in/out/dropped with the top drop
    reasons; then token stores, training, evaluation, failures and where the outputs are.
    ``artifacts`` adds the tree of every step's inputs and outputs."""
    run_id = graph.run.run_id
    where = f"  (lineage: {lineage})" if lineage else ""
    total = " ".join(f"{k}={v}" for k, v in sorted(graph.run.counts.items()))
    pipeline = graph.run.pipeline or "no pipeline"
    lines = [f"run {run_id} ({pipeline}) {graph.run.state}  [{total}]{where}", ""]
    header = f"{'step':<32}{'state':<10}{'in':>8}{'out':>8}{'dropped':>9}  drop reasons"
    lines += [header, "-" * len(header)]
    tokens, evals, benchmarks, train, outputs, failures = [], [], [], None, [], []
    samples: dict = {}
    latest = {}
    for node in graph.steps:
        latest[node.execution.name] = node
    for name, node in latest.items():
        ex = node.execution
        if ex.state in (ExecutionState.FAILED, ExecutionState.CANCELED):
            failures.append(f"{name}: {ex.state} {ex.error}")
        counted = False
        for out in node.outputs:
            a = out.artifact
            c = dict(a.counts or {})
            if a.type in ("dataset", "token_store", "tokenizer") and "records_in" in c:
                counted = True
                dropped = dict(c.get("dropped") or {})
                ranked = sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))
                reasons = ", ".join(f"{k}={v}" for k, v in ranked[:4])
                if len(ranked) > 4:  # the manifest has them all
                    reasons += f", +{len(ranked) - 4} more"
                lines.append(
                    f"{name:<32}{ex.state:<10}{c['records_in']:>8}{c['records_out']:>8}"
                    f"{sum(dropped.values()):>9}  {reasons}"
                )
                outputs.append((name, a.uri))
            if a.type == "token_store" and c.get("num_tokens") is not None:
                vocab = c.get("vocab_size")
                tokens.append(
                    (name, c["num_tokens"], "" if vocab is None else f" (vocabulary {vocab})")
                )
            if a.type == "checkpoint":
                train = (name, ex.state, c, a.uri)
                outputs.append((name, a.uri))
            if a.type == "eval_result":
                kind, label = evaluation_output(out)
                if kind == "benchmark":
                    benchmarks.append((label, c))
                elif kind == "samples":
                    samples = dict(a.properties or {})
                else:
                    evals.append((label, c))
            if a.type == "hf_export":
                dtype = (a.properties or {}).get("dtype")
                label = f"Hugging Face, {dtype}" if dtype else "Hugging Face"
                outputs.append((f"{name} ({label})", a.uri))
        if not counted:  # a step whose outputs carry no record counts: its state alone
            lines.append(f"{name:<32}{ex.state}")
    if tokens:
        lines += ["", "token stores:"]
        lines += [f"  {n:<32} {t} tokens{v}" for n, t, v in tokens]
    if train:
        name, state, c, uri = train
        lines += [
            "",
            f"training ({state}): {c.get('steps')} steps, {c.get('params')} parameters, "
            f"loss {_num(c.get('loss_start'))} -> {_num(c.get('loss_end'))}",
            f"  checkpoint {uri}",
        ]
    if evals:
        lines += ["", "evaluation:"]
        for role, c in evals:
            bpb = c.get("bits_per_byte")
            lines.append(
                f"  {role:<28} loss {c.get('loss'):.4f}  perplexity {c.get('perplexity'):.2f}"
                f"  bits/byte {bpb if bpb is None else round(bpb, 4)}  ({c.get('tokens')} tokens)"
            )
    if benchmarks:
        lines += ["", *render_benchmarks(benchmarks)]
    if samples:
        lines += ["", *render_samples(samples)]
    if failures:
        lines += ["", "failures:"]
        for failure in failures:  # a multi-line error keeps its lines, indented under it
            first, *rest = failure.splitlines() or [""]
            lines += [f"  {first}", *(f"    {r}" for r in rest)]
    if outputs:
        lines += ["", f"outputs{f' under {outputs_root}' if outputs_root else ''}:"]
        lines += [f"  {n:<32} {u}" for n, u in outputs]
    if artifacts:
        lines += ["", _artifact_tree(graph)]
    return "\n".join(lines)


def _artifact_tree(graph: RunGraph) -> str:
    """The run as a tree: steps in start order, each with its inputs and outputs."""
    lines = ["every step, its inputs and outputs:"]
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
    """The artifact, then producers and their inputs, down to the raw inputs. An artifact
    reached again along another path (a token store read by train and evaluate) has its
    producers shown once, where it first appears, and ``(traced above)`` after that."""
    lines = [_artifact(root.artifact)]
    lines.extend(_trace_lines(root, "", set()))
    raw = root.raw_inputs()
    lines.append("")
    lines.append(f"raw inputs ({len(raw)}):")
    lines.extend(f"  {_artifact(a)}" for a in raw)
    return "\n".join(lines)


def _trace_lines(node: TraceNode, prefix: str, shown: set[int]) -> Iterable[str]:
    if node.producer is None:
        return
    shown.add(id(node))
    producer = node.producer
    run = f", run {producer.run_id}" if producer.run_id else ""
    code = f", code {producer.code_version[:12]}" if producer.code_version else ""
    yield f"{prefix}{_LAST}produced by {_execution(producer)}{run}{code}"
    inner = prefix + _GAP
    for i, child in enumerate(node.inputs):
        last = i == len(node.inputs) - 1
        if child.producer is None:
            note = "  [raw input]"
        elif id(child) in shown:
            note = "  (traced above)"
        else:
            note = ""
        yield f"{inner}{_LAST if last else _TEE}{_artifact(child.artifact)}{note}"
        if not note:
            yield from _trace_lines(child, inner + (_GAP if last else _PIPE), shown)
