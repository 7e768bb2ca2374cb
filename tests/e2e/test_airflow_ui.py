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

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.tiny_pipeline import tiny_conf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DAG_ID = "slipway_pipeline"
CHROMIUM = os.environ.get("SLIPWAY_CHROMIUM", "/usr/bin/chromium")
# Failed steps' screenshots: in the checkout's out/ (ignored by git), where they outlive
# pytest's rotation of its temporary folders and a CI job can keep them.
SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "test-screenshots"
# What a probe on this kind of machine found it needs: no sandbox as root, and no background
# connections (the closed network refuses them, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (Debian's chromium package)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.set_default_timeout(60_000)
            yield context.new_page()
        finally:
            browser.close()


@contextmanager
def step(page, name: str, out: Path) -> Iterator[None]:
    """Run one step of the scenario; on failure keep a full-page screenshot named for it."""
    try:
        yield
    except BaseException:
        out.mkdir(parents=True, exist_ok=True)
        shot = out / f"{name}.png"
        try:
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot of the failed step {name!r}: {shot}")
        except Exception as exc:  # the browser itself may be what failed
            print(f"no screenshot of {name!r}: {exc}")
        raise


def test_the_default_form_triggers_a_run_that_succeeds(airflow, page):
    af = airflow
    shots = SCREENSHOTS / "default-form"
    shutil.rmtree(shots, ignore_errors=True)  # only this run's failures
    password = af.password()
    with step(page, "1-sign-in", shots):
        page.goto(f"{af.url}/dags/{DAG_ID}")
        page.wait_for_url("**/auth/login**")  # not signed in: Airflow's own login page
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", password)
        page.keyboard.press("Enter")
        page.wait_for_url(f"**/dags/{DAG_ID}**")
        page.wait_for_load_state("networkidle")
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
