"""The data plane without Airflow: the pipeline's step graph walked up to the token stores.

What ``make demo-data`` runs. The same table (:mod:`operators.pipeline`), the same steps and
versions (:func:`operators.graph.build_graph`), the same stage command lines
(:func:`operators.graph.stage_options`) and the same step runner (:mod:`operators.steps`) as
the DAG's tasks, in one process on the DirectRunner: outputs land under ``{root}/steps``
exactly where a DAG run with the same form would put them, so either one's outputs are the
other's cache hits, and a second walk is all cache hits.

    python -m operators.dataplane [--conf JSON|@file] [--root DIR] [beam pipeline options]

``--conf`` is a run form, as for ``airflow dags test -c`` (defaults: the DAG's); training and
evaluation are left to the DAG.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from operators.graph import Graph, StageStep, build_graph, run_split, stage_argv, stage_options
from operators.pipeline import PIPELINE, Role
from operators.steps import Outcome, StepRunner, StepSpec

log = logging.getLogger("operators.dataplane")

WALKED = (Role.BEAM, Role.SPLIT)  # the roles of the data plane


@dataclass(frozen=True)
class StepRun:
    """One step of the walk: its outcome, output, counts and time."""

    task_id: str
    step: str  # the step's key (name-version)
    outcome: Outcome
    output: str
    records_in: int
    records_out: int
    dropped: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # tokens, vocabulary, split counts
    seconds: float = 0.0


def _stage_main(stage: str) -> Callable[[Sequence[str]], Any]:
    return importlib.import_module(f"pipelines.{stage}").main


def _counts(task_id: str, output: str) -> tuple[int, int, dict[str, int], dict[str, Any]]:
    from pipelines.manifest import read_manifest

    if task_id == "split":
        with open(f"{output}/split.json") as f:
            split = json.load(f)
        total = sum(n["train"] + n["heldout"] for n in split["sources"].values())
        return total, total, {}, {"sources": split["sources"]}
    manifest = read_manifest(f"{output}/output")
    return manifest.records_in, manifest.records_out, dict(manifest.dropped), manifest.extra


def walk(
    graph: Graph, root: str, beam_args: Sequence[str] = (), runner: StepRunner | None = None
) -> list[StepRun]:
    """Run every data-plane step of ``graph`` under ``root``, in the pipeline's order."""
    runner = runner or StepRunner(root)
    steps = graph.task_steps()
    stage_steps: dict[str, StageStep] = {
        s.step.name: s for group in graph.stages.values() for s in group
    }
    runs = []
    for task in PIPELINE:
        if task.role not in WALKED:
            continue
        for step in steps[task.task_id]:
            log.info("== %s (%s)", step.key, task.task_id)
            started = time.monotonic()
            if task.role is Role.SPLIT:
                fn = run_split
            else:
                fn = _stage_fn(stage_steps[step.name], root, beam_args)
            result = runner.run(step, fn)
            out = result.spec.output_path
            records_in, records_out, dropped, extra = _counts(task.task_id, out)
            runs.append(
                StepRun(
                    task.task_id,
                    step.key,
                    result.outcome,
                    out,
                    records_in,
                    records_out,
                    dropped,
                    extra,
                    time.monotonic() - started,
                )
            )
    return runs


def _stage_fn(
    stage_step: StageStep, root: str, beam_args: Sequence[str]
) -> Callable[[StepSpec], Any]:
    def run(spec: StepSpec) -> None:
        argv = stage_argv(stage_options(stage_step, spec, root))
        _stage_main(stage_step.stage)([*argv, *beam_args])

    return run


def format_walk(runs: Sequence[StepRun]) -> str:
    """The walk as a table: per step, records in/out/dropped, the top drop reasons, time."""
    lines = [
        f"{'step':<34}{'outcome':>9}{'in':>8}{'out':>8}{'dropped':>8}{'s':>7}  drop reasons",
        "-" * 110,
    ]
    for r in runs:
        ranked = sorted(r.dropped.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = ", ".join(f"{k}={v}" for k, v in ranked[:4])
        if len(ranked) > 4:
            reasons += f", +{len(ranked) - 4} more (manifest.json)"
        lines.append(
            f"{r.step:<34}{r.outcome!s:>9}{r.records_in:>8}{r.records_out:>8}"
            f"{sum(r.dropped.values()):>8}{r.seconds:>7.1f}  {reasons}"
        )
    for r in runs:
        for key in ("num_tokens", "vocab_size", "tokenizer_sha256"):
            if key in r.extra:
                lines.append(f"{r.step}: {key} = {r.extra[key]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from operators.params import RunConfigError, form_values
    from operators.settings import steps_root

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conf", default="{}", help="run form as JSON, or @file")
    parser.add_argument("--root", default=None, help="steps root (default: $SLIPWAY_HOME/steps)")
    args, beam_args = parser.parse_known_args(argv)
    text = args.conf
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as handle:
            text = handle.read()
    try:
        params = form_values(json.loads(text))
    except (json.JSONDecodeError, RunConfigError) as exc:
        print(f"slipway: --conf: {exc}", file=sys.stderr)
        return 2
    _fetch(params)
    root = args.root or steps_root()
    runs = walk(build_graph(params), root, beam_args)
    print()
    print(format_walk(runs))
    print(f"\noutputs under {root}")
    return 0


def _fetch(params: dict[str, Any]) -> None:
    """Fetch the run's missing corpora, as the DAG's ``fetch`` task does (local folders)."""
    from operators.graph import missing_corpora
    from operators.settings import data_dir
    from pipelines.corpora import fetch

    data = data_dir(params.get("data_dir"))
    if "://" in data:
        raise SystemExit("slipway: the data-plane walker reads local corpora; use the DAG")
    missing = missing_corpora(params)
    if missing:
        log.info("fetching %s into %s", missing, data)
        fetch.fetch(data, only=missing)


if __name__ == "__main__":
    sys.exit(main())
