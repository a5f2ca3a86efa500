"""The vLLM prefetcher without vLLM: a failing step is retried with a growing backoff, not at every
poll, and a success resets it (injected clock and wait: no sleeping, no wall-clock asserts)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from deltasync.errors import ChecksumMismatch
from deltasync.serving.engine.prefetch import Prefetcher, PrefetchOptions


class FakeMirror:
    """A mirror whose run's head is ``latest`` and whose prepares fail while ``broken`` holds the step."""

    def __init__(self) -> None:
        self.serving: int | None = 0
        self.latest = 0
        self.broken: set[int] = set()
        self.asked: list[tuple[float, int]] = []
        self.heard: list[int] = []  # steps the prefetcher told the mirror it saw committed
        self.clock = 0.0

    def latest_step(self) -> int | None:
        return self.latest

    def seen(self, step: int, at: float | None = None) -> None:
        self.heard.append(step)

    def prepare(self, step: int | None = None, *, coalesce: str | None = None) -> Future[int | None]:
        assert step is not None and coalesce == "prefetch"
        self.asked.append((self.clock, step))
        fut: Future[int | None] = Future()
        if step in self.broken:
            fut.set_exception(ChecksumMismatch(f"step {step}: bad patch"))
        else:
            fut.set_result(step)
        return fut


def drive(mirror: FakeMirror, polls: int, on_poll: Callable[[int], None] | None = None) -> Prefetcher:
    """Run a prefetcher's watch for ``polls`` polls, one poll interval (1 s) of fake time apart."""
    n = 0
    stop = threading.Event()

    def wait(seconds: float) -> None:
        nonlocal n
        mirror.clock += seconds
        n += 1
        if on_poll is not None:
            on_poll(n)
        if n >= polls:
            stop.set()

    p = Prefetcher(lambda: mirror, poll_interval=1.0, clock=lambda: mirror.clock, wait=wait, stop=stop)
    p.run()
    return p


def test_a_failing_step_backs_off_and_a_success_resets_the_backoff() -> None:
    mirror = FakeMirror()
    mirror.latest, mirror.broken = 5, {5}

    def run_changes(n: int) -> None:
        if n == 40:  # step 5 is repaired (a re-upload): its next try succeeds
            mirror.broken = set()
        if n == 64:  # a new bad step: the backoff starts over
            mirror.latest, mirror.broken = 7, {7}

    p = drive(mirror, 70, run_changes)
    # one poll a second for 70 s: step 5 is tried at 0, 1, 3, 7, 15, 31 (each wait twice the one
    # before, not once per poll) and 63 (it works); step 7 at once, then 1 and 2 s later
    assert mirror.asked == [(0.0, 5), (1.0, 5), (3.0, 5), (7.0, 5), (15.0, 5), (31.0, 5), (63.0, 5)] + [
        (64.0, 7),
        (65.0, 7),
        (67.0, 7),
    ]
    assert p.failures == 9 and p.attempts == 10


def test_a_newer_step_is_tried_at_once_while_an_older_one_backs_off() -> None:
    mirror = FakeMirror()
    mirror.latest, mirror.broken = 3, {3}

    def newer_at(n: int) -> None:
        if n == 2:
            mirror.latest = 4

    p = drive(mirror, 4, newer_at)
    assert mirror.asked == [(0.0, 3), (1.0, 3), (2.0, 4)]
    assert p.failures == 2 and p.attempts == 3


def test_a_served_or_prepared_step_is_not_asked_again() -> None:
    mirror = FakeMirror()
    mirror.latest = 2
    drive(mirror, 5)
    assert mirror.asked == [(0.0, 2)]
    mirror.serving = mirror.latest = 9
    drive(mirror, 3)
    assert mirror.asked == [(0.0, 2)]


def test_close_cuts_the_poll_wait_short() -> None:
    mirror = FakeMirror()
    p = Prefetcher(lambda: mirror, poll_interval=3600.0)
    p.start()
    assert p.close(timeout=30)  # the watch ended: its hour-long wait was cut short
    assert p.stop.is_set()


def test_a_commit_the_signal_server_announces_is_prepared_without_waiting_for_a_poll(tmp_path: Any) -> None:
    """Issue 34: with a signal server the prefetch wakes on each commit it announces. The store poll here
    comes once an hour (and never sees step 1), so only the real server's SSE event can ask for step 1."""
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app
    from deltasync.signal import SignalClient

    app = create_app(
        Settings(publish_token="pub-token-1", subscribe_token="sub-token-1", db_path=str(tmp_path / "s.db"))
    )
    mirror = FakeMirror()
    asked = threading.Event()
    real_prepare = mirror.prepare

    def prepare(step: int | None = None, *, coalesce: str | None = None) -> Future[int | None]:
        fut = real_prepare(step, coalesce=coalesce)
        asked.set()
        return fut

    mirror.prepare = prepare  # type: ignore[method-assign]
    with ThreadServer(app) as srv:
        options = PrefetchOptions(
            poll_interval=3600.0, signal_url=srv.url, signal_token="sub-token-1", run="r", heartbeat=0.5
        )
        p = Prefetcher(lambda: mirror, options)
        p.start()
        try:
            publisher = SignalClient(srv.url, "pub-token-1")
            try:
                publisher.publish("r", 1, "0" * 32)
            finally:
                publisher.close()
            assert asked.wait(60), "the prefetch did not wake on the signal"
        finally:
            assert p.close(timeout=30)
    assert [s for _, s in mirror.asked] == [1]
    assert 1 in mirror.heard  # its prepare latency counts from the signal
