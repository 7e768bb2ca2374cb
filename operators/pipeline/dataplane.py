"""The data plane without Airflow: the pipeline's step graph walked up to the token stores.

What ``make demo-data`` runs. The same table (:mod:`operators.pipeline`), the same steps and
versions (:func:`operators.pipeline.graph.build_graph`), the same stage command lines
(:func:`operators.pipeline.graph.stage_options`) and the same step runner (:mod:`operators.steps`) as
the DAG's tasks, in one process on the DirectRunner: outputs land under ``{root}/steps``
exactly where a DAG run with the same form would put them, so either one's outputs are the
other's cache hits, and a second walk is all cache hits. Each step is recorded in lineage as
the DAG's tasks record it (run ``dataplane__<time>``, pipeline ``slipway_dataplane``), and the
run is printed by the one run printer (:func:`operators.lineage.render.render_run`).

    python -m operators.pipeline.dataplane [--conf JSON|@file] [--root DIR] [beam pipeline options]

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
from datetime import UTC, datetime
from typing import Any

from operators.lineage.describe import describe_stage_output
from operators.pipeline import PIPELINE, Role
from operators.pipeline.graph import (
    DATASET,
    STAGE_OUT,
    Graph,
    StageStep,
    build_graph,
    run_split,
    stage_argv,
    stage_options,
)
from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    split_output_artifacts,
    stage_output_artifacts,
)
from operators.steps import Outcome, StepRunner, StepSpec

log = logging.getLogger("operators.pipeline.dataplane")

WALKED = (Role.BEAM, Role.SPLIT)  # the roles of the data plane
PIPELINE_NAME = "slipway_dataplane"  # the walk's runs in lineage


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
    extra: dict[str, Any] = field(default_factory=dict)  # tokens, vocabulary; split counts
    seconds: float = 0.0


def _stage_main(stage: str) -> Callable[[Sequence[str]], Any]:
    return importlib.import_module(f"pipelines.{stage}").main


def _counts(result: Any) -> tuple[int, int, dict[str, int], dict[str, Any]]:
    """Records in/out/dropped of a finished step, from what it returned (kept in its SUCCESS
    marker, so a cache hit has them too): a stage's described output, the split's counts."""
    if "sources" in result:  # the split: every document goes to train or held-out
        total = sum(n["train"] + n["heldout"] for n in result["sources"].values())
        return total, total, {}, {"sources": result["sources"]}
    counts = dict(result["counts"])
    dropped = dict(counts.pop("dropped", {}))
    return counts.pop("records_in"), counts.pop("records_out"), dropped, counts


class _Task(StepLineageMixin):
    """One task of the walk, recording its steps as the DAG's operator for it would (the same
    :meth:`~operators.step_lineage.StepLineageMixin.run_step`), under pipeline
    :data:`PIPELINE_NAME` in the lineage database at ``lineage_url``."""

    dag_id = PIPELINE_NAME

    def __init__(self, task_id: str, lineage_url: str) -> None:
        self.task_id = task_id
        self.log = log
        self._lineage_url = lineage_url

    def lineage_store(self) -> Any:  # type: ignore[override]
        from operators.lineage import LineageStore

        return LineageStore(self._lineage_url)


def walk(
    graph: Graph,
    root: str,
    beam_args: Sequence[str] = (),
    *,
    lineage_url: str,
    run_id: str,
    runner: StepRunner | None = None,
) -> list[StepRun]:
    """Run every data-plane step of ``graph`` under ``root``, in the pipeline's order, each
    recorded in lineage as run ``run_id``."""
    runner = runner or StepRunner(root)
    steps = graph.task_steps()
    stage_steps: dict[str, StageStep] = {
        s.step.name: s for group in graph.stages.values() for s in group
    }
    context = {"run_id": run_id, "ti": None}
    runs = []
    for task in PIPELINE:
        if task.role not in WALKED:
            continue
        recorder = _Task(task.task_id, lineage_url)
        for step in steps[task.task_id]:
            log.info("== %s (%s)", step.key, task.task_id)
            started = time.monotonic()
            if task.role is Role.SPLIT:
                result = recorder.run_step(
                    context,
                    step,
                    run_split,
                    inputs=[ArtifactRef(step.config["input"], DATASET)],
                    outputs=split_output_artifacts,
                    runner=runner,
                )
            else:
                s = stage_steps[step.name]
                result = recorder.run_step(
                    context,
                    step,
                    _stage_fn(s, root, beam_args),
                    inputs=[
                        ArtifactRef(u, t, r, fields=graph.input_fields(u)) for u, t, r in s.inputs
                    ],
                    outputs=lambda spec, res, s=s: stage_output_artifacts(s.output_type, spec, res),
                    runner=runner,
                    output_subpath=STAGE_OUT,
                )
            out = result.spec.output_path
            records_in, records_out, dropped, extra = _counts(result.result or {})
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
    def run(spec: StepSpec) -> dict[str, Any]:
        options = stage_options(stage_step, spec, root)
        _stage_main(stage_step.stage)([*stage_argv(options), *beam_args])
        return describe_stage_output(options["output"])

    return run


def main(argv: Sequence[str] | None = None) -> int:
    from operators.lineage import LineageStore, lineage_url
    from operators.lineage.render import render_run
    from operators.pipeline.form import RunConfigError, form_values
    from operators.settings import steps_root

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conf", default="{}", help="run form as JSON, or @file")
    parser.add_argument("--root", default=None, help="steps root (default: $SLIPWAY_HOME/steps)")
    parser.add_argument(
        "--run-id", default=None, help="lineage run id (default: dataplane__<time>)"
    )
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
    run_id = args.run_id or f"dataplane__{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%S')}"
    url = lineage_url()
    walk(build_graph(params), root, beam_args, lineage_url=url, run_id=run_id)
    with LineageStore(url) as store:
        graph = store.run_graph(run_id)
        print()
        print(render_run(graph, lineage=store.display_url, outputs_root=root))
    return 0


def _fetch(params: dict[str, Any]) -> None:
    """Fetch the run's missing corpora, as the DAG's ``fetch`` task does (local folders)."""
    from operators.pipeline.graph import missing_corpora
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
