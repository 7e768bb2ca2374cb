"""Each run's self-contained ``report.html`` (``{root}/runs/<run folder>/report.html``): the run
page with its loss plot inline and no links, for users without the Airflow UI. The ``record``
task writes it after the run summary (``operators/record.py``) and records it as an output of
type ``REPORT_ARTIFACT`` (:mod:`operators.reports.view`, where the run page finds it); the
end-of-run summary names it.
"""

from __future__ import annotations

from datetime import datetime

from operators.lineage.store import LineageStore
from operators.reports.pages import run_page

REPORT_FILE = "report.html"


def report_path(run_id: str) -> str:
    from operators.settings import run_file

    return run_file(run_id, REPORT_FILE)


def write_run_report(
    store: LineageStore, run_id: str, *, started_at: datetime | None = None
) -> str:
    """Render the run's report from lineage and write it (local or object store); its path.

    ``started_at``: when Airflow started the DAG run, shown instead of lineage's first start,
    as the live page shows it: a cleared run's is its rerun's (the duration runs from it to
    the start of the task writing the report)."""
    from operators.settings import write_run_text

    page = run_page(store, run_id, base=None, started_at=started_at)
    return write_run_text(run_id, REPORT_FILE, page)
