"""A ``deltasync demo`` subprocess on 127.0.0.1 and an HTTP client for it (used by the CLI and browser tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

START_TIMEOUT = 90.0  # importing torch + transformers on a busy 2-core machine
RUN_TIMEOUT = 120.0

# what a test run adds to the Space's command: a free port, a tiny model, a short run
FAST = ["--model", "tiny", "--steps", "25", "--step-interval", "0.05", "--no-browser"]


def deltasync_cmd() -> list[str]:
    """The installed ``deltasync`` console script (what the Dockerfile's CMD runs)."""
    script = Path(sys.executable).with_name("deltasync")
    return [str(script)] if script.exists() else [sys.executable, "-m", "deltasync.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Demo:
    """A ``deltasync demo`` subprocess and an HTTP client for it."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.cwd = tmp
        self.base = f"http://127.0.0.1:{self.port}"
        self.out = tmp / f"demo-{self.port}.log"
        given = dict(env or {})
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **given}
        # the demo's own variables come only from the test, never from the outer environment
        for var in (
            "DISPLAY",
            "WAYLAND_DISPLAY",
            "DELTASYNC_DEMO_FOLLOW",
            "DELTASYNC_SIGNAL_URL",
            "DELTASYNC_DEMO_LOOP",
        ):
            if var not in given:
                full_env.pop(var, None)
        self._log = self.out.open("wb")
        self.proc = subprocess.Popen(
            [*deltasync_cmd(), "demo", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=tmp,
            env=full_env,
        )
        self.client = httpx.Client(base_url=self.base, timeout=10.0)

    def log(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_until(self, what: str, pred: Callable[[], bool], timeout: float) -> None:
        """Poll ``pred`` until true; fail early if the process died, or after ``timeout`` seconds."""
        done = threading.Event()
        timer = threading.Timer(timeout, done.set)
        timer.start()
        try:
            while not done.is_set():
                if self.proc.poll() is not None:
                    pytest.fail(f"demo exited ({self.proc.returncode}) while waiting for {what}:\n{self.log()}")
                try:
                    if pred():
                        return
                except httpx.TransportError:
                    pass
                done.wait(0.2)
            pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{self.log()}")
        finally:
            timer.cancel()

    def state(self) -> dict[str, Any]:
        r = self.client.get("/api/state")
        r.raise_for_status()
        return dict(r.json())

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.client.close()
        self._log.close()
        return self.proc.returncode
