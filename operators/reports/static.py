"""Each run's self-contained ``report.html`` (``{root}/runs/<run_id>/report.html``): the run
page with its loss plot inline and no links, for users without the Airflow UI. The ``record``
task writes it after the run summary (``operators/record.py``); the end-of-run summary names it.
"""

from __future__ import annotations

from operators.lineage.store import LineageStore
from operators.reports.pages import run_page

REPORT_FILE = "report.html"
REPORT_ARTIFACT = "run_report"  # its artifact type in lineage, an output of ``record``


def report_path(run_id: str) -> str:
    from operators.settings import run_folder
    from operators.steps import join

    return join(run_folder(run_id), REPORT_FILE)


def write_run_report(store: LineageStore, run_id: str) -> str:
    """Render the run's report from lineage and write it (local or object store); its path."""
    import fsspec

    body = run_page(store, run_id, base=None)
    path = report_path(run_id)
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, body.encode("utf-8"))
    return path
