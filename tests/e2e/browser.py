"""The e2e tests' browser: Debian's Chromium (``make browser`` installs it; ``/usr/bin/chromium``,
or ``$SLIPWAY_CHROMIUM``) driven by Playwright pointed at that executable. Playwright's own
browser download cannot work offline and is never used. The ``page`` fixture is in conftest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def open_page():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).is_file():
        raise AssertionError(
            f"no Chromium at {CHROMIUM}: run `make browser` (Debian's chromium package)"
        )
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


def sign_in(page, af, url: str) -> None:
    """Open ``url`` signed out: Airflow's own login page comes first, then ``url``."""
    page.goto(url)
    page.wait_for_url("**/auth/login**")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", af.password())
    page.keyboard.press("Enter")
    page.wait_for_load_state("networkidle")
