#!/usr/bin/env python3
"""Refresh ``docs/demo.png``: run ``deltasync demo`` as a user does (default model and steps unless
given), wait until the run has ended and the copy was checked bit-exact, then photograph the page in
headless Chromium (Debian's ``chromium`` through Playwright, both from the ``test`` extra's setup).

    python scripts/screenshot_demo.py [--out docs/demo.png] [--width 1400] [-- DEMO ARGS...]

The demo runs on 127.0.0.1 on a free port with a store in a temporary dir (removed after). Prints the
run's end-of-run summary and the time to the page, to the answer and to the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(base: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(base + "/api/state", timeout=5) as r:
            out: dict[str, object] = json.load(r)
            return out
    except OSError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "demo.png", help="where the PNG goes")
    ap.add_argument("--width", type=int, default=1400, help="viewport width in CSS pixels")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the run to end")
    ap.add_argument("demo_args", nargs="*", help="more `deltasync demo` arguments (after --)")
    args = ap.parse_args()
    chromium = next((c for c in CHROMIUM if Path(c).exists()), None)
    if chromium is None:
        sys.exit("needs Debian's chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    script = Path(sys.executable).with_name("deltasync")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="deltasync-shot-"))
    cmd = [str(script), "demo", "--no-browser", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--store", str(tmp / "store"), *args.demo_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
    try:
        first_page = first_answer = None
        deadline = t0 + args.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"the demo exited with {proc.returncode}")
            state = _state(base)
            if state is not None:
                first_page = first_page or time.monotonic() - t0
                info = state.get("info") if isinstance(state.get("info"), dict) else state
                assert isinstance(info, dict)
                if info.get("bit_exact") is not None:
                    break
            time.sleep(1.0)
        else:
            sys.exit(f"the run did not end within {args.timeout:.0f} s")
        ended = time.monotonic() - t0
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": args.width, "height": 1400})
            page.goto(base + "/")
            page.wait_for_selector("#conn.live", timeout=60_000)
            page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=60_000)
            page.wait_for_timeout(2_000)  # the charts' last frame
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            first_answer = page.text_content("#generation")
            browser.close()
        print(f"page up after {first_page:.1f} s, run ended after {ended:.1f} s; final answer: {first_answer!r}")
        print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        print(out[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
