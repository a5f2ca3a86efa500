"""Threads are started in one place: :class:`deltasync._util.worker.SerialWorker` (issue 32.6).

Every other background job, loop or blocking wait runs on a worker, one-off ones through
:func:`~deltasync._util.worker.run_in_background`; the demo too.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import pytest

from deltasync._util.worker import run_in_background

REPO = Path(__file__).resolve().parents[2]


def test_only_the_serial_worker_starts_a_thread_by_hand() -> None:
    found = sorted(
        f"{p.relative_to(REPO)}:{n}"
        for folder in ("deltasync", "spaces_demo")
        for p in (REPO / folder).rglob("*.py")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bThread\(", line)
    )
    assert [f.split(":")[0] for f in found] == ["deltasync/_util/worker.py"], found


def test_run_in_background_runs_once_on_a_named_daemon_thread_that_ends() -> None:
    seen: list[threading.Thread] = []
    fut = run_in_background(lambda: seen.append(threading.current_thread()) or 7, "test-one-off")
    assert fut.result(10) == 7
    (thread,) = seen
    assert thread.name == "test-one-off" and thread.daemon
    thread.join(10)
    assert not thread.is_alive()


def test_run_in_background_keeps_and_logs_an_exception(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    seen: list[threading.Thread] = []

    def fail() -> None:
        seen.append(threading.current_thread())
        release.wait(10)
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="deltasync.worker"):
        fut = run_in_background(fail, "test-failing")
        release.set()
        with pytest.raises(ValueError, match="boom"):
            fut.result(10)
        seen[0].join(10)  # the future's callback logs on the worker's thread before it ends
    assert [r.getMessage() for r in caplog.records] == ["test-failing failed"]


def test_the_demo_uses_public_names_and_the_serial_worker() -> None:
    """The demo (run by ``deltasync demo``) imports deltasync's public packages; of the private
    machinery only the worker its threads run on (``RetryPolicy`` is ``deltasync.signal``'s)."""
    private = sorted(
        f"{p.name}: {m}"
        for p in (REPO / "spaces_demo").glob("*.py")
        for m in re.findall(r"^\s*(?:from|import) (deltasync[\w.]*)", p.read_text(encoding="utf-8"), re.M)
        if any(part.startswith("_") for part in m.split(".")) and m != "deltasync._util.worker"
    )
    assert private == []
