"""The ``split`` task: clean documents -> per-source train and held-out files.

The split itself is :func:`pipelines.split.split_documents` (a stable hash of each document's
id decides; see there); this operator runs it as the ``split`` step of
:func:`operators.pipeline.graph.build_graph`.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators.step_lineage import (
    ArtifactRef,
    StepLineageMixin,
    resolve_uri,
    split_output_artifacts,
)


class HeldoutSplitOperator(StepLineageMixin, BaseOperator):
    """The ``split`` step of :func:`operators.pipeline.graph.build_graph`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "split")
        super().__init__(**kwargs)

    def planned_io(self, context: Any) -> tuple[list[str], list[str]]:
        from operators.steps import output_path

        root = self.steps_root()
        step = self.step_graph(context).split
        return [resolve_uri(step.config["input"], root)], [output_path(root, step)]

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.pipeline.graph import DATASET, run_split

        step = self.step_graph(context).split

        result = self.run_step(
            context,
            step,
            run_split,
            inputs=[ArtifactRef(step.config["input"], DATASET)],
            outputs=split_output_artifacts,
        )
        return {"outcome": str(result.outcome), **(result.result or {})}
