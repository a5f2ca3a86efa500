"""The one follow loop (watch -> act -> report -> back off), driven by a StepWatcher over scripted
store polls with an injected clock and wait: one poll per second of fake time, no sleeping, no
wall-clock asserts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import pytest

from deltasync._util.retry import RetryPolicy
from deltasync.errors import ChecksumMismatch, InventoryMismatch, SignalError
from deltasync.signal import Attempt, FollowLoop, StepSeen, StepWatcher

BACKOFF = RetryPolicy(retries=0, backoff=1.0, max_backoff=8.0)


class Run:
    """A run whose head follows ``heads`` (one entry per poll, the last one repeated), observed
    once a second of fake time for ``polls`` polls; ``on_poll(n)`` changes the world before poll n."""

    def __init__(self, heads: Sequence[int | None], polls: int, on_poll: Callable[[int], None] | None = None) -> None:
        self.heads = heads
        self.left = polls
        self.on_poll = on_poll
        self.t = 0.0
        self.n = 0
        self.stop = threading.Event()

    def poll(self) -> int | None:
        if self.on_poll is not None:
            self.on_poll(self.n)
        head = self.heads[min(self.n, len(self.heads) - 1)]
        self.n += 1
        self.left -= 1
        if self.left <= 0:
            self.stop.set()
        return head

    def wait(self, seconds: float) -> None:
        self.t += seconds

    def watcher(self) -> StepWatcher:
        return StepWatcher(self.poll, poll_interval=1.0, stop=self.stop, wait=self.wait, clock=lambda: self.t)


class Receiver:
    """Holds a step; ``act`` reaches a step unless it is in ``broken`` (then ChecksumMismatch)."""

    def __init__(self) -> None:
        self.held: int | None = None
        self.broken: set[int] = set()
        self.acts: list[tuple[float, int]] = []
        self.reports: list[Attempt] = []

    def loop(self, run: Run, **kw: object) -> FollowLoop:
        def act(step: int) -> None:
            self.acts.append((run.t, step))
            if step in self.broken:
                raise ChecksumMismatch(f"step {step}: bad patch")
            self.held = step

        return FollowLoop(run.watcher(), act, held=lambda: self.held, report=self.reports.append, **kw)  # type: ignore[arg-type]


def test_a_failing_step_backs_off_and_a_success_resets_the_backoff() -> None:
    r = Receiver()
    r.broken = {5}

    def world(n: int) -> None:
        if n == 20:  # step 5 is repaired: its next try works
            r.broken = set()
        if n == 25:  # a new bad step: the backoff starts over
            r.broken = {7}

    run = Run([5] * 25 + [7], polls=31, on_poll=world)
    assert r.loop(run, retry=BACKOFF).run() == 5
    # the watcher polls twice at 0 s, then once a second; step 5 at 0, 1, 3, 7, 15 (doubling), 23
    # (capped at 8 s) where it works; step 7 at once, then 1 and 2 s later
    assert r.acts == [(0.0, 5), (1.0, 5), (3.0, 5), (7.0, 5), (15.0, 5), (23.0, 5), (24.0, 7), (25.0, 7), (27.0, 7)]
    assert [(a.step, a.ok, a.retry_in) for a in r.reports] == [
        (5, False, 1.0),
        (5, False, 2.0),
        (5, False, 4.0),
        (5, False, 8.0),
        (5, False, 8.0),
        (5, True, None),
        (7, False, 1.0),
        (7, False, 2.0),
        (7, False, 4.0),
    ]
    assert isinstance(r.reports[0].error, ChecksumMismatch)


def test_without_a_backoff_a_failed_step_is_tried_at_every_observation() -> None:
    r = Receiver()
    r.broken = {3}
    run = Run([3], polls=5)
    assert r.loop(run).run() is None
    assert r.acts == [(0.0, 3), (0.0, 3), (1.0, 3), (2.0, 3)]


def test_a_newer_step_is_tried_at_once_while_an_older_one_backs_off() -> None:
    r = Receiver()
    r.broken = {3}
    run = Run([3, 3, 3, 4], polls=5)
    assert r.loop(run, retry=BACKOFF).run() == 4
    assert r.acts == [(0.0, 3), (1.0, 3), (2.0, 4)]


def test_the_receiver_is_brought_to_the_newest_step_seen_never_an_older_one() -> None:
    r = Receiver()
    # steps 1 and 2 land between two polls; then a poll answers an older head (a stale HEAD hint)
    run = Run([None, 3, 1, None, 4], polls=6)
    assert r.loop(run).run() == 4
    assert r.acts == [(0.0, 3), (3.0, 4)]  # 3 once (held afterwards), 1 never, 4 at once


def test_a_step_already_held_is_not_acted_on() -> None:
    r = Receiver()
    r.held = 9
    run = Run([7, 9], polls=3)
    assert r.loop(run).run() == 9
    assert r.acts == []


def test_until_ends_the_loop_once_held_and_stop_ends_it_at_the_next_observation() -> None:
    r = Receiver()
    run = Run([1, 2, 3, 4, 5], polls=100)
    assert r.loop(run, until=3).run() == 3
    assert [s for _, s in r.acts] == [1, 2, 3] and run.n == 3  # no poll past the target
    r2 = Receiver()
    run2 = Run([1, 2, 3], polls=100)

    def act(step: int) -> None:
        r2.held = step
        run2.stop.set()  # e.g. Ctrl-C while acting

    assert FollowLoop(run2.watcher(), act, held=lambda: r2.held).run() == 1


class Closing(StepWatcher):
    """A watcher that counts its closes."""

    closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


def test_a_fatal_error_or_one_not_retried_ends_the_loop_and_closes_the_watcher() -> None:
    run = Run([2], polls=10)

    def mismatch(step: int) -> None:
        raise InventoryMismatch(f"the target cannot hold step {step}")

    def bug(step: int) -> None:
        raise KeyError(step)

    for act, error in ((mismatch, InventoryMismatch), (bug, KeyError)):
        watcher = Closing(run.poll, stop=run.stop, wait=run.wait, clock=lambda: run.t)
        with pytest.raises(error):
            FollowLoop(watcher, act, held=lambda: None, fatal=(InventoryMismatch,)).run()
        assert watcher.closed == 1


def test_observations_are_reported_first_and_a_lost_stream_is_not_acted_on() -> None:
    events: list[str] = []
    seen = [
        StepSeen("store", 2),
        StepSeen("lost", error=SignalError("down")),
        StepSeen("heartbeat"),
        StepSeen("signal", 3),
    ]
    stop = threading.Event()

    class Scripted(StepWatcher):
        def watch(self, resume: Callable[[], int | None] = lambda: None) -> Iterator[StepSeen]:
            for s in seen:
                events.append(f"resume {resume()}")
                yield s

    held: list[int | None] = [None]
    fails = {2}

    def act(step: int) -> None:
        events.append(f"act {step}")
        if step in fails:
            fails.clear()
            raise ChecksumMismatch("bad")
        held[0] = step

    loop = FollowLoop(
        Scripted(None, stop=stop),
        act,
        held=lambda: held[0],
        observe=lambda s: events.append(f"observe {s.kind}"),
        report=lambda a: events.append(f"report {a.step} {a.ok}"),
    )
    assert loop.run() == 3
    assert events == [
        "resume None",
        "observe store",
        "act 2",
        "report 2 False",
        "resume None",
        "observe lost",  # not retried here: a lost stream says nothing about the run
        "resume None",
        "observe heartbeat",
        "act 2",  # retried at the next observation
        "report 2 True",
        "resume 2",  # a stream resumes after the step held
        "observe signal",
        "act 3",
        "report 3 True",
    ]


def test_a_background_act_is_not_repeated_while_it_runs_or_after_it_worked() -> None:
    futures: list[tuple[int, Future[int]]] = []

    def act(step: int) -> Future[int]:
        fut: Future[int] = Future()
        futures.append((step, fut))
        return fut

    reports: list[Attempt] = []

    def on_poll(n: int) -> None:
        if n == 2:
            futures[0][1].set_result(5)  # prepared (the receiver does not hold it yet)
        if n == 4:  # step 6 is cancelled in its queue: it may be asked again
            assert futures[1][1].cancel()
        if n == 6:
            futures[2][1].set_exception(ChecksumMismatch("bad"))  # and fails: backed off

    run = Run([5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6], polls=11, on_poll=on_poll)
    loop = FollowLoop(run.watcher(), act, held=lambda: None, report=reports.append, retry=BACKOFF)
    loop.run()
    assert [s for s, _ in futures] == [5, 6, 6, 6]
    assert [(a.step, a.ok, a.retry_in) for a in reports] == [(5, True, None), (6, False, 1.0)]
