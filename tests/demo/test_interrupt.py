"""Ctrl-C in the demo: the trainer and the follower stop while the page's server (and the in-process
signal server on it) still answers, so the trainer's last commit signals are delivered; the process
says it is stopping, then "interrupted", once, last."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the demo extra is part of the test extra")

from demo_process import START_TIMEOUT, Demo  # noqa: E402


def test_ctrl_c_mid_run_stops_in_order_with_every_signal_delivered(tmp_path: Path) -> None:
    demo = Demo(["--model", "tiny", "--steps", "5000", "--step-interval", "0.05", "--no-browser"], tmp_path)
    try:
        demo.wait_until(
            "three applied steps", lambda: (demo.state().get("applied") or {}).get("step", 0) >= 3, START_TIMEOUT
        )
    finally:
        rc = demo.stop(signal.SIGINT)
    log = demo.log()
    assert rc == 130, log
    lines = log.splitlines()
    stopping = lines.index("stopping the trainer and the follower (Ctrl-C again to quit at once)")
    assert lines[-1] == "interrupted" and lines.count("interrupted") == 1, log
    assert stopping < len(lines) - 1
    assert "not delivered" not in log and "Traceback" not in log, log
