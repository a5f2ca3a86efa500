"""The demo page in a real headless Chromium (Debian ``chromium``) driven by Playwright.

A ``deltasync demo`` subprocess serves the page on 127.0.0.1; the test watches the
step counter rise, the charts get drawn and the inference copy's answer change,
then writes a screenshot to ``$DELTASYNC_ARTIFACTS/demo.png`` (default
``tests/artifacts/demo.png``).

Playwright's own browser downloads are not reachable here, so the test drives the
Debian package; the session installs it with apt when it is missing and we are root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_process import START_TIMEOUT, Demo

sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
APT_TIMEOUT = 900
PAGE_TIMEOUT_MS = 120_000


def _installed_chromium() -> str | None:
    env = os.environ.get("DELTASYNC_CHROMIUM")
    for c in ([env] if env else []) + list(CHROMIUM_CANDIDATES):
        if c and Path(c).exists():
            return c
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of a Chromium binary; installs Debian's ``chromium`` with apt-get when missing and root."""
    found = _installed_chromium()
    if found:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(
            "the browser test needs Chromium: install Debian's package (apt-get install chromium) "
            "or set DELTASYNC_CHROMIUM to a chromium binary"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=APT_TIMEOUT, env=env, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    found = _installed_chromium()
    if not found:
        pytest.fail("apt-get installed chromium but no binary is at " + " or ".join(CHROMIUM_CANDIDATES))
    return found


@pytest.fixture
def page(chromium: str) -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            pg = browser.new_page(viewport={"width": 1280, "height": 1400})
            pg.set_default_timeout(PAGE_TIMEOUT_MS)
            yield pg
        finally:
            browser.close()


def artifacts_dir() -> Path:
    d = Path(os.environ.get("DELTASYNC_ARTIFACTS") or Path(__file__).parent / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    # a slower pace than the CLI tests, so that the page sees the answer change while it watches
    # (at lr 5e-4 the tiny model's answer keeps changing for ~70 steps, ~17 s at this pace)
    args = ["--store", "store", "--model", "tiny", "--steps", "120", "--step-interval", "0.25", "--lr", "5e-4"]
    d = Demo([*args, "--no-browser"], tmp_path)
    try:
        yield d
    finally:
        d.stop(signal.SIGKILL)


def test_page_shows_steps_charts_and_a_changing_answer(page: Any, demo: Demo) -> None:
    demo.wait_until("/healthz", lambda: demo.client.get("/healthz").status_code == 200, START_TIMEOUT)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    external: list[str] = []
    page.on(
        "request",
        lambda r: None if r.url.startswith(demo.base) or r.url.startswith("data:") else external.append(r.url),
    )
    page.goto(demo.base + "/")

    # the live stream connected and the first step was applied
    page.wait_for_selector("#conn.live")
    page.wait_for_function("document.getElementById('generation').dataset.step !== ''")
    first_text = page.text_content("#generation")
    first_step = int(page.text_content("#trainer-step") or "0")

    # the step counter rises
    page.wait_for_function(f"Number(document.getElementById('trainer-step').textContent) >= {first_step + 10}")
    # charts are drawn: bars in the bytes chart, a density line, heatmap cells, timeline blocks
    page.wait_for_function("document.querySelectorAll('#chart-bytes svg rect').length >= 5")
    page.wait_for_function("document.querySelector('#chart-density svg polyline') !== null")
    page.wait_for_function("document.querySelectorAll('#heatmap svg rect').length >= 10")
    assert page.locator("#timeline svg rect").count() >= 5
    # the inference copy's answer changes as patches land
    page.wait_for_function("(t) => document.getElementById('generation').textContent !== t", arg=first_text)
    page.wait_for_function("document.querySelectorAll('#history li').length >= 2")
    assert page.text_content("#mode") == "self-contained: trainer + store + inference here"
    applied = int(page.text_content("#applied-step") or "-1")
    assert applied > 0
    shot = artifacts_dir() / "demo.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not errors, errors
    assert not external, f"the page loaded from other hosts: {external}"
