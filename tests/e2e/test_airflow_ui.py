"""The Airflow UI in a real browser: sign in, open the pipeline, trigger it from the form.

Debian's Chromium (``make browser`` installs it; ``/usr/bin/chromium``, or
``$SLIPWAY_CHROMIUM``), driven by Playwright pointed at that executable: Playwright's own
browser download cannot work offline and is never used. Against the session's
``make airflow`` (``tests/e2e/conftest.py``), whose platform data dir holds tiny corpora.

What a new user does and what broke for one: the trigger form must come up triggerable with
its defaults (an empty required "Corpora folder" kept the Trigger button disabled). The test
signs in through the login page, opens ``slipway_pipeline``, opens the trigger form, checks
that every field's default is accepted (Trigger enabled, the corpora folder pre-filled with
the platform's), gives the tiny-corpora overrides in the form's configuration JSON (the
defaults train on the full real corpora, which this machine does not fetch), presses Trigger,
and follows the run through the REST API to success. A screenshot of the page is kept in
``out/test-screenshots/`` whenever a step fails.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from urllib.parse import unquote

import pytest

from tests.e2e.browser import SCREENSHOTS, sign_in, step
from tests.support.tiny_pipeline import tiny_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DAG_ID = "slipway_pipeline"


def test_the_default_form_triggers_a_run_that_succeeds(airflow, page):
    af = airflow
    shots = SCREENSHOTS / "default-form"
    shutil.rmtree(shots, ignore_errors=True)  # only this run's failures
    with step(page, "1-sign-in", shots):
        sign_in(page, af, f"{af.url}/dags/{DAG_ID}")  # Airflow's own login page first
        page.wait_for_url(f"**/dags/{DAG_ID}**")
    with step(page, "2-open-the-form", shots):
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.get_by_role("dialog")
        dialog.wait_for()
        trigger = dialog.get_by_role("button", name="Trigger")
        # Every default is valid: the form can be submitted as it comes up.
        page.wait_for_function("b => !b.disabled", arg=trigger.element_handle(), timeout=30_000)
        # The form names each Param's input element_<param> (its label is not linked to it).
        assert dialog.get_by_text("Corpora folder").first.is_visible()
        assert dialog.locator("input[name=element_data_dir]").input_value() == str(af.data)
    with step(page, "3-fill-in-the-tiny-run", shots):
        dialog.get_by_role("button", name="Advanced Options").click()
        dialog.get_by_label("Run ID").fill("ui_default_form")
        editor = (
            dialog.get_by_role("group")
            .filter(has=page.get_by_text("Configuration JSON", exact=True))
            .locator(".monaco-editor")
        )
        editor.click()
        page.keyboard.press("Control+A")
        page.keyboard.press("Delete")
        # insert_text, not typing: the editor would close every bracket a second time.
        conf = tiny_conf(af.data)
        conf.pop("data_dir")  # the form's default: the platform's corpora folder
        page.keyboard.insert_text(json.dumps(conf))
        assert trigger.is_enabled()
    with step(page, "4-trigger", shots):
        trigger.click()
        dialog.wait_for(state="hidden")
    with step(page, "5-the-run", shots):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # created by the form's request
            r = af.client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/ui_default_form")
            if r.status_code == 200:
                break
            time.sleep(1)
        run = af.api("GET", f"/dags/{DAG_ID}/dagRuns/ui_default_form")
        assert run["conf"]["steps"] == conf["steps"], run["conf"]
        assert run["run_type"] == "manual"
        state = af.wait_run("ui_default_form")
        tasks = af.task_states("ui_default_form")
        assert state == "success", (tasks, af.log_tail())
        assert set(tasks.values()) == {"success"}, tasks
        # The run used the form's default corpora folder.
        states, nodes, _ = af.lineage("ui_default_form")
        assert states["validate"] == "COMPLETE"
        assert nodes["fetch"].execution.properties["data_dir"] == str(af.data)

    # -- the run's report in the Airflow UI (the Slipway plugin) --------------------------------
    _the_run_report(af, page, "ui_default_form", states, nodes)
    _a_queued_run_in_the_list(af, page)


def _a_queued_run_in_the_list(af, page) -> None:
    """A run triggered while the DAG is paused waits queued (as one does behind a running
    one) and has recorded nothing: the runs list shows it QUEUED, and its page waits and
    says the DAG is paused."""
    shots = SCREENSHOTS / "queued-run"
    shutil.rmtree(shots, ignore_errors=True)
    af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})
    try:
        af.trigger("ui_queued", tiny_conf(af.data))
        with step(page, "10-the-queued-run", shots):
            page.goto(f"{af.url}/slipway/?state=QUEUED")
            link = page.get_by_role("link", name="ui_queued", exact=True)
            cells = page.locator("table#runs tbody tr", has=link).locator("td").all_inner_texts()
            assert cells[1:3] == [DAG_ID, "QUEUED"], cells
            assert cells[3].startswith("queued ") and cells[4:6] == ["queued", "0"], cells
            link.click()
            page.wait_for_url("**/slipway/runs/ui_queued")
            assert "none of its steps has recorded anything yet" in page.content()
            assert page.locator("#paused").inner_text().startswith(f"{DAG_ID} is paused")
    finally:
        af.client.delete(f"/api/v2/dags/{DAG_ID}/dagRuns/ui_queued")
        af.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})


def _the_run_report(af, page, run_id: str, states: dict, nodes: dict) -> None:
    """Open the Slipway entry, the run's page from the list, its step table against lineage,
    its loss plot, and the checkpoint's trace back to the raw corpora."""
    shots = SCREENSHOTS / "run-report"
    shutil.rmtree(shots, ignore_errors=True)
    with step(page, "6-the-slipway-entry", shots):
        page.goto(af.url)
        # exact: the home page also links assets such as "slipway://models/...", and the plugin's
        # nav entry renders after them (Airflow loads plugins asynchronously)
        page.get_by_role("link", name="Slipway", exact=True).first.click()
        # The entry embeds the pages (an external view). Its iframe's sandbox does not let a
        # link navigate the top window: the link to Airflow's page of the run moves the UI.
        frame = page.frame_locator("iframe").first
        frame.locator("table#runs").wait_for()
        frame.get_by_role("link", name=run_id, exact=True).click()
        frame.get_by_role("link", name="the DAG run in Airflow").first.click()
        page.wait_for_url(lambda url: unquote(url).endswith(f"/dags/{DAG_ID}/runs/{run_id}"))
        page.get_by_text("Slipway report").first.wait_for()  # Airflow's own run page
        # Then the pages at their own address.
        page.goto(f"{af.url}/slipway/")
        row = page.locator("table#runs tr", has=page.get_by_role("link", name=run_id))
        assert "COMPLETE" in row.inner_text(), row.inner_text()
        page.get_by_role("link", name=run_id).click()
        page.wait_for_url(f"**/slipway/runs/{run_id}")
    with step(page, "6b-the-dag-runs-tab", shots):
        # Every DAG run has a "Slipway report" tab: the run page, embedded.
        page.goto(f"{af.url}/dags/{DAG_ID}/runs/{run_id}")
        page.get_by_text("Slipway report").first.click()
        embedded = page.frame_locator("iframe").first
        assert embedded.locator("#run-state").inner_text() == "COMPLETE"
        page.goto(f"{af.url}/slipway/runs/{run_id}")
    with step(page, "7-the-step-table", shots):
        assert page.locator("#run-state").inner_text() == "COMPLETE"
        shown = {}
        for tr in page.locator("table#steps tbody tr").all():
            cells = tr.locator("td").all_inner_texts()
            shown[tr.get_attribute("data-step")] = cells
        assert set(shown) == set(states) - {"record"}, (sorted(shown), sorted(states))
        checked = 0
        for name, node in nodes.items():
            for out in node.outputs:
                c = out.artifact.counts or {}
                if "records_in" in c and name in shown:
                    row = page.locator(f'tr[data-step="{name}"]')
                    got = [
                        row.locator(f'td[data-field="{f}"]').inner_text()
                        for f in ("in", "out", "dropped")
                    ]
                    want = [
                        f"{c['records_in']:,}",
                        f"{c['records_out']:,}",
                        f"{sum(c['dropped'].values()):,}",
                    ]
                    assert got == want, (name, got, want)
                    checked += 1
        assert checked >= 5, shown  # the data plane's stages, each against its manifest
    with step(page, "8-the-loss-plot", shots):
        plot = page.locator("img#loss-plot")
        plot.scroll_into_view_if_needed()
        page.wait_for_function(
            "img => img.complete && img.naturalWidth > 0", arg=plot.element_handle()
        )
        from PIL import Image

        shown = Image.open(io.BytesIO(plot.screenshot())).convert("RGB")
        colours = shown.getcolors(maxcolors=1 << 20) or []
        ink = sum(n for n, c in colours if c != (255, 255, 255)) / (shown.width * shown.height)
        # a drawn curve with axes and labels: many colours (anti-aliasing), not a blank box
        assert len(colours) > 20 and ink > 0.02, (len(colours), ink)
        assert page.locator("table#benchmarks").is_visible()
        assert page.locator("#gate").inner_text().startswith("Promoted")
    with step(page, "9-trace-the-checkpoint", shots):
        page.locator("a#trace-checkpoint").click()
        page.wait_for_url("**/slipway/trace?**")
        raw = page.locator("table#raw-inputs tbody tr").all_inner_texts()
        corpora = [o.artifact for o in nodes["fetch"].outputs if o.artifact.type == "dataset"]
        assert corpora, "fetch recorded no corpora"
        for corpus in corpora:  # every one, with the content hash fetch recorded
            assert any(f"{corpus.uri}\t" in r and corpus.content_hash in r for r in raw), (
                corpus.uri,
                raw,
            )
        assert page.locator("#lineage-graph svg g.node").count() >= 8
        # a node of the graph leads on: a raw corpus to its own trace, naming who recorded it
        page.locator("#lineage-graph svg a:has(g.node.raw)").first.click()
        page.wait_for_url("**/slipway/trace?uri=*&version=*")
        assert "written by fetch of run" in page.locator("#resolved").inner_text()
