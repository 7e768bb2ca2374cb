"""Print what a pipeline run did, from lineage: ``python -m operators.summary [RUN_ID]``.

Documents in/out per stage with drop reasons, tokens per store, loss at start and end,
evaluation metrics, the lineage run id and where the outputs are, then the promotion gate's
outcome and the run's ``report.html``. Exit status 1 when the run failed. The latest run of
``slipway_pipeline`` by default.
``make demo`` calls it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from operators.lineage import (
    LineageConfigError,
    NotFound,
    lineage_url,
)
from operators.lineage.render import render_run, run_failed
from operators.lineage.store import open_for_reading
from operators.lineage.url import redacted
from operators.promotion import gate_line, gate_outcome
from operators.reports.pages import PIPELINE_DAG as PIPELINE
from operators.reports.view import run_view
from operators.settings import storage_root


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_id", nargs="?", help=f"default: the latest {PIPELINE} run")
    args = parser.parse_args(argv)
    try:
        store = open_for_reading(lineage_url())
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
        try:
            graph = store.run_graph(run_id)
        except NotFound as exc:
            print(f"slipway: {exc.args[0]}", file=sys.stderr)
            return 1
        print(render_run(graph, lineage=store.display_url, outputs_root=storage_root()))
        line = gate_line(gate_outcome([node.execution for node in graph.steps]))
        if line is not None:
            print(f"\n{line}")
        report = run_view(graph).report
        if report:
            print(f"\nreport: {report}  (also under Slipway in the Airflow UI)")
    return 1 if run_failed(graph) else 0


if __name__ == "__main__":
    sys.exit(main())
