"""Print what a pipeline run did, from lineage: ``python -m operators.summary [RUN_ID]``.

Documents in/out per stage with drop reasons, tokens per store, loss at start and end,
evaluation metrics, the lineage run id and where the outputs are. Exit status 1 when the run
failed. The latest run of ``slipway_pipeline`` by default. ``make demo`` calls it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from operators.lineage import (
    ExecutionState,
    LineageConfigError,
    LineageStore,
    NotFound,
    lineage_url,
)
from operators.lineage.url import redacted
from operators.settings import storage_root

PIPELINE = "slipway_pipeline"


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def format_run(store: LineageStore, run_id: str) -> tuple[str, bool]:
    graph = store.run_graph(run_id)
    lines = [f"run {run_id}  {graph.run.state}  (lineage: {store.display_url})", ""]
    header = f"{'step':<32}{'state':<10}{'in':>8}{'out':>8}{'dropped':>9}  drop reasons"
    lines += [header, "-" * len(header)]
    tokens, evals, train, outputs, failures = [], [], None, [], []
    latest = {}
    for node in graph.steps:
        latest[node.execution.name] = node
    for name, node in latest.items():
        ex = node.execution
        if ex.state in (ExecutionState.FAILED, ExecutionState.CANCELED):
            failures.append(f"{name}: {ex.state} {ex.error}")
        for out in node.outputs:
            a = out.artifact
            c = dict(a.counts or {})
            if a.type in ("dataset", "token_store", "tokenizer") and "records_in" in c:
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
            if a.type == "token_store":
                tokens.append((name, c.get("num_tokens"), c.get("vocab_size")))
            if a.type == "checkpoint":
                train = (name, ex.state, c, a.uri)
                outputs.append((name, a.uri))
            if a.type == "eval_result":
                evals.append((out.role or a.uri, c))
        if not node.outputs:
            lines.append(f"{name:<32}{ex.state:<10}")
    if tokens:
        lines += ["", "token stores:"]
        lines += [f"  {n:<32} {t} tokens (vocabulary {v})" for n, t, v in tokens]
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
    if failures:
        lines += ["", "failures:", *(f"  {f}" for f in failures)]
    lines += ["", f"outputs under {storage_root()}:"]
    lines += [f"  {n:<32} {u}" for n, u in outputs]
    return "\n".join(lines), graph.run.state is ExecutionState.FAILED or bool(failures)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_id", nargs="?", help=f"default: the latest {PIPELINE} run")
    args = parser.parse_args(argv)
    try:
        store = LineageStore(lineage_url(), create=False)
    except (NotFound, LineageConfigError) as exc:
        print(f"slipway: {exc.args[0]}", file=sys.stderr)
        return 1
    with store:
        run_id = args.run_id
        if run_id is None:
            runs = [r for r in store.runs() if r.pipeline == PIPELINE]
            if not runs:
                print(f"no {PIPELINE} run in {redacted(store.url)}", file=sys.stderr)
                return 1
            run_id = runs[0].run_id
        text, failed = format_run(store, run_id)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
