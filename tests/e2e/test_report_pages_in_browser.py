"""The report pages as a browser shows them, in Debian's Chromium (no Airflow needed): a
running run's page keeps what the reader opened across its reloads, a wide lineage graph opens
on its middle, where the traced artifact is, and an error of several lines keeps its lines.
The pages are rendered from a real lineage store and loaded from files."""

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


def test_an_error_of_several_lines_keeps_its_lines(store, tmp_path: Path, page):
    """validate lists every problem on its own line: the run page shows them so, in the
    failure box and in the step's error row, not run together."""
    error = (
        "RunConfigError: invalid run:\n  warmup_steps: 20 is more than steps (1)\n"
        "  trainer config: optimizer.warmup_steps: must be in [0, steps=1]"
    )
    ex = store.start_execution("validate", run_id="refused", pipeline="slipway_pipeline")
    store.finish_execution(ex, "FAILED", error=error)
    path = tmp_path / "refused.html"
    path.write_text(pages.run_page(store, "refused", "/s"))
    page.goto(path.as_uri())
    for shown in (
        page.locator("#failed-error"),
        page.locator('tr.error-row[data-error-for="validate"] .failure-text > strong'),
    ):
        lines = shown.inner_text().splitlines()
        assert [line.strip() for line in lines] == [
            "RunConfigError: invalid run:",
            "warmup_steps: 20 is more than steps (1)",
            "trainer config: optimizer.warmup_steps: must be in [0, steps=1]",
        ], lines
