"""The report pages' two bits of script, in Debian's Chromium (no Airflow needed): a running
run's page keeps what the reader opened across its reloads, and a wide lineage graph opens on
its middle, where the traced artifact is. The pages are rendered from a real lineage store
and loaded from files."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.lineage import LineageStore
from operators.reports import pages
from tests.support.report_runs import record_run


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPWAY_HOME", str(tmp_path))
    with LineageStore(f"sqlite:///{tmp_path}/lineage.db") as s:
        record_run(s, "good", tmp_path)
        yield s


def test_what_the_reader_opened_stays_open_across_reloads(store, tmp_path: Path, page):
    running = pages.run_page(store, "good", "/s", dag_run=pages.DagRun("RUNNING"))
    path = tmp_path / "running.html"
    path.write_text(running)
    page.goto(path.as_uri())
    settings = page.locator("details#settings")
    assert settings.get_attribute("open") is None
    settings.locator("summary").click()
    page.reload()
    assert page.locator("details#settings").get_attribute("open") is not None
    page.locator("details#settings summary").click()  # closed again: stays closed
    page.reload()
    assert page.locator("details#settings").get_attribute("open") is None
    # a finished run's page neither reloads nor carries the script
    assert "sessionStorage" not in pages.run_page(store, "good", "/s")


def test_a_wide_lineage_graph_opens_on_its_middle(store, tmp_path: Path, page):
    ingest = store.start_execution("ingest", run_id="wide", pipeline="slipway_pipeline")
    for i in range(12):  # twelve corpus files side by side: wider than the window
        store.record_input(ingest, f"file:///data/corpus-{i:02d}.txt", "dataset")
    store.record_output(ingest, "/steps/ingest-wide", "dataset", version="w")
    store.finish_execution(ingest)
    path = tmp_path / "trace.html"
    path.write_text(pages.trace_page(store.trace("/steps/ingest-wide"), "/s"))
    page.goto(path.as_uri())
    box = page.locator("#lineage-graph")
    scroll_width, client_width, left = box.evaluate(
        "b => [b.scrollWidth, b.clientWidth, b.scrollLeft]"
    )
    assert scroll_width > client_width  # it does scroll
    assert abs(left - (scroll_width - client_width) / 2) <= 1  # on the middle
    artifact = page.locator("#lineage-graph g.node.artifact rect")
    assert artifact.is_visible() and artifact.bounding_box()["x"] < client_width
