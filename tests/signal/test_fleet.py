"""The fleet from the receivers' and the trainer's side, against a real signal server on 127.0.0.1:
FleetReporter (on change, heartbeat, failures logged once, never blocking the caller, leaving on close)
and the staleness gate wait_for_fleet with two receivers, one slow. Waits are on events and injected
clocks; nothing asserts a duration."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import ThreadServer, free_port

from deltasync._util.retry import RetryPolicy
from deltasync.errors import SignalRejected, StalenessTimeout
from deltasync.signal import FleetReporter, FleetView, SignalClient, fleet_ready, wait_for_fleet

PUB = "publish-token-fleet"
SUB = "subscribe-token-fleet"
D = [f"{i:032x}" for i in range(10)]
WAIT = 30.0


class Gated(httpx.BaseTransport):
    """Sends through ``inner`` once ``open`` is set (or fails while ``down``); counts attempts."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.open.set()
        self.down = False
        self.attempts = 0
        self.reached: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def at(self, n: int) -> threading.Event:
        with self.lock:
            ev = self.reached.setdefault(n, threading.Event())
            if self.attempts >= n:
                ev.set()
            return ev

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.attempts += 1
            for n, ev in self.reached.items():
                if self.attempts >= n:
                    ev.set()
        assert self.open.wait(WAIT)
        if self.down:
            raise httpx.ConnectError("connection refused (test)", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def reporter(server: ThreadServer, run: str, replica: str, **kw: object) -> FleetReporter:
    return FleetReporter(server.url, run, SUB, replica=replica, **kw)  # type: ignore[arg-type]


def rows(view: FleetView) -> dict[str, tuple[int | None, str]]:
    return {r.replica: (r.step, r.state) for r in view.replicas}


# ------------------------------------------------------------------ reporter


def test_a_reporter_reports_starting_then_each_change_then_leaves(
    server: ThreadServer, trainer: SignalClient, run: str
) -> None:
    trainer.publish(run, 4, D[4])
    with reporter(server, run, "engine-0") as rep:
        assert rep.wait_reported(WAIT)
        assert rows(trainer.fleet(run)) == {"engine-0": (None, "starting")}
        rep.update(4, digest=D[4])
        assert rep.wait_reported(WAIT)
        (r,) = trainer.fleet(run).replicas
        assert (r.step, r.lag, r.state, r.digest_ok, r.last_error) == (4, 0, "serving", True, None)
        rep.update(4, "failed", digest=D[4], last_error="UpdateRolledBack: step 5 refused")
        assert rep.wait_reported(WAIT)
        (r,) = trainer.fleet(run).replicas
        assert (r.state, r.last_error) == ("failed", "UpdateRolledBack: step 5 refused")
        assert r.ttl_s == 36  # three heartbeats of the default 10 s and three report timeouts of 2 s
    assert trainer.fleet(run).replicas == ()  # close() left the fleet


def test_heartbeats_repeat_the_report_without_a_change(server: ThreadServer, trainer: SignalClient, run: str) -> None:
    with reporter(server, run, "beat", heartbeat=0.02, ttl_s=60) as rep:
        rep.update(1)
        assert rep.wait_sent(5, WAIT)  # at least four heartbeats after the change
        (r,) = trainer.fleet(run).replicas
        assert (r.step, r.ttl_s) == (1, 60)
        assert r.last_seen > r.since


def test_update_never_blocks_on_a_stuck_server_and_the_newest_state_wins(
    server: ThreadServer, trainer: SignalClient, run: str
) -> None:
    gate = Gated(httpx.HTTPTransport())
    gate.open.clear()
    rep = reporter(server, run, "stuck", transport=gate)
    try:
        assert gate.at(1).wait(WAIT)  # the first report hangs in the transport
        for step in range(1, 50):
            rep.update(step)  # returns at once though the worker is stuck
        assert not gate.open.is_set()
        gate.open.set()
        assert rep.wait_reported(WAIT)
        assert rows(trainer.fleet(run)) == {"stuck": (49, "serving")}
        assert rep.sent < 49  # intermediate states were superseded, not queued
    finally:
        rep.close()


def test_failures_are_logged_once_retried_and_recovered(
    server: ThreadServer, trainer: SignalClient, run: str, caplog: pytest.LogCaptureFixture
) -> None:
    gate = Gated(httpx.HTTPTransport())
    gate.down = True
    caplog.set_level(logging.DEBUG, logger="deltasync.signal.fleet")
    rep = reporter(
        server,
        run,
        "flaky",
        transport=gate,
        heartbeat=0.05,
        retry=RetryPolicy(retries=0, backoff=0.001, max_backoff=0.01),
    )
    try:
        assert gate.at(4).wait(WAIT)
        rep.update(3)  # a change while the server is down: not raised, not lost
        assert gate.at(6).wait(WAIT)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "cannot report replica flaky" in warnings[0].getMessage()
        assert rep.failed >= 4
        gate.down = False
        assert rep.wait_reported(WAIT)
        assert rows(trainer.fleet(run)) == {"flaky": (3, "serving")}
        assert any("reach the signal server again" in r.getMessage() for r in caplog.records)
    finally:
        rep.close()


def test_a_reporter_refuses_bad_names_and_states_at_once(server: ThreadServer) -> None:
    with pytest.raises(SignalRejected, match="invalid replica id"):
        reporter(server, "r", "bad id")
    with pytest.raises(SignalRejected, match="invalid run name"):
        reporter(server, "bad run", "a")
    with reporter(server, "valid-run", "a") as rep, pytest.raises(ValueError, match="state must be one of"):
        rep.update(1, "running")


def test_a_refused_token_is_logged_once_and_never_raised(
    server: ThreadServer, run: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.signal.fleet")
    gate = Gated(httpx.HTTPTransport())
    rep = FleetReporter(
        server.url,
        run,
        "not-the-token",
        replica="a",
        transport=gate,
        heartbeat=0.05,
        retry=RetryPolicy(retries=0, backoff=0.001, max_backoff=0.01),
    )
    try:
        assert gate.at(3).wait(WAIT)
    finally:
        rep.close(leave=False)
    (warning,) = caplog.records
    assert "HTTP 403" in warning.getMessage() and "DELTASYNC_REPORT_TOKEN" in warning.getMessage()


# ---------------------------------------------------------------------- gate


class PollCount:
    """The gate's ``wait``: counts the gate's polls, lets a test know when it has polled ``n`` times."""

    def __init__(self) -> None:
        self.polls = 0
        self.cond = threading.Condition()

    def __call__(self, seconds: float) -> None:
        with self.cond:
            self.polls += 1
            self.cond.notify_all()
            self.cond.wait(min(seconds, 0.01))

    def reached(self, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.polls >= n, WAIT)


def test_the_gate_waits_for_the_slow_replica_and_releases_when_it_catches_up(
    server: ThreadServer, trainer: SignalClient, run: str
) -> None:
    for step in range(6):
        trainer.publish(run, step, D[step])
    with reporter(server, run, "fast") as fast, reporter(server, run, "slow") as slow:
        fast.update(5, digest=D[5])
        slow.update(2, digest=D[2])
        assert fast.wait_reported(WAIT) and slow.wait_reported(WAIT)
        polls = PollCount()
        with ThreadPoolExecutor(1) as pool:
            gate = pool.submit(wait_for_fleet, trainer, run, 5, max_lag=1, timeout=WAIT, poll=0.01, wait=polls)
            assert polls.reached(3)
            assert not gate.done()  # the slow one serves step 2 < 5 - 1
            slow.update(3, digest=D[3])
            assert slow.wait_reported(WAIT)
            assert polls.reached(polls.polls + 2) and not gate.done()  # still 1 behind the floor
            slow.update(4, digest=D[4])
            view = gate.result(WAIT)
        assert rows(view) == {"fast": (5, "serving"), "slow": (4, "serving")}
        assert {r.replica: r.lag for r in view.replicas} == {"fast": 0, "slow": 1}
        # a quorum of one is met by the fast replica alone
        slow.update(0, digest=D[0])
        assert slow.wait_reported(WAIT)
        assert wait_for_fleet(trainer, run, 5, quorum=1, timeout=0).replicas
        assert wait_for_fleet(trainer, run, 5, quorum=0.5, timeout=0).replicas
        with pytest.raises(StalenessTimeout):
            wait_for_fleet(trainer, run, 5, quorum=0.51, timeout=0)


def test_a_replica_that_leaves_while_behind_releases_the_gate_with_a_warning(
    server: ThreadServer, trainer: SignalClient, run: str, caplog: pytest.LogCaptureFixture
) -> None:
    for step in range(3):
        trainer.publish(run, step, D[step])
    with reporter(server, run, "fast") as fast:
        slow = reporter(server, run, "slow")
        fast.update(2, digest=D[2])
        slow.update(0, digest=D[0])
        assert fast.wait_reported(WAIT) and slow.wait_reported(WAIT)
        polls = PollCount()
        with ThreadPoolExecutor(1) as pool:
            gate = pool.submit(wait_for_fleet, trainer, run, 2, timeout=WAIT, poll=0.01, wait=polls)
            assert polls.reached(2) and not gate.done()
            slow.close()  # it stops (or ages out): it serves nothing stale any more
            view = gate.result(WAIT)
    assert rows(view) == {"fast": (2, "serving")}
    assert "replica(s) slow left the fleet while behind step 2" in caplog.text


class FakeTime:
    """Injected clock and wait of the gate: time moves only when the gate waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.t += seconds


def test_the_gate_times_out_with_who_is_behind_and_what_to_do(
    server: ThreadServer, trainer: SignalClient, run: str
) -> None:
    for step in range(9):
        trainer.publish(run, step, D[step])
    ft = FakeTime()
    with (
        reporter(server, run, "fast") as fast,
        reporter(server, run, "slow") as slow,
        reporter(server, run, "broken") as broken,
    ):
        fast.update(8, digest=D[8])
        slow.update(3, "failed", digest=D[3], last_error="UpdateRolledBack: step 4 was not applied (disk full)")
        broken.update(2, "needs_replacement", last_error="WorkerNeedsReplacement: restore failed")
        for rep in (fast, slow, broken):
            assert rep.wait_reported(WAIT)
        with pytest.raises(StalenessTimeout) as info:
            wait_for_fleet(trainer, run, 8, max_lag=2, timeout=120, poll=5, clock=ft.clock, wait=ft.wait)
    assert ft.t == 120  # it polled until the (injected) deadline
    msg = str(info.value)
    assert "timed out after 120 s waiting for run" in msg and "step 6 or newer (step 8, max lag 2" in msg
    assert "1 of 3 live replicas ready, 3 needed; head 8" in msg
    assert "slow: step 3, lag 5, state failed, last seen" in msg
    assert "last error: UpdateRolledBack: step 4 was not applied (disk full)" in msg
    assert "broken: step 2, lag 6, state needs_replacement" in msg
    assert "fast:" not in msg
    assert "what to do:" in msg and "needs_replacement one must be restarted" in msg
    assert isinstance(info.value, TimeoutError)


def test_an_empty_fleet_is_not_ready_and_says_so(trainer: SignalClient, run: str) -> None:
    trainer.publish(run, 1, D[1])
    ft = FakeTime()
    with pytest.raises(StalenessTimeout, match=r"only 0 replicas report to the signal server \(min_replicas=1\)"):
        wait_for_fleet(trainer, run, 1, timeout=3, clock=ft.clock, wait=ft.wait)
    assert fleet_ready(trainer.fleet(run), 1, min_replicas=0)


def test_a_down_server_is_retried_until_the_timeout(run: str) -> None:
    ft = FakeTime()
    with (
        SignalClient(f"http://127.0.0.1:{free_port()}", timeout=1) as down,
        pytest.raises(StalenessTimeout, match="the fleet could not be read from the signal server"),
    ):
        wait_for_fleet(down, run, 1, timeout=2, poll=1, clock=ft.clock, wait=ft.wait)
    assert ft.t == 2


def test_a_refused_read_raises_at_once(server: ThreadServer, run: str) -> None:
    calls: list[float] = []
    wait: Callable[[float], None] = calls.append
    with SignalClient(server.url, "wrong-token-0123") as c, pytest.raises(SignalRejected, match="HTTP 403"):
        wait_for_fleet(c, run, 1, timeout=60, wait=wait)
    assert calls == []


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"quorum": 0}, "quorum"),
        ({"quorum": 1.5}, "quorum"),
        ({"quorum": True}, "quorum"),
        ({"max_lag": -1}, "max_lag"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"timeout": -1}, "timeout"),
    ],
)
def test_the_gate_refuses_bad_arguments(trainer: SignalClient, kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wait_for_fleet(trainer, "r", 1, **kw)  # type: ignore[arg-type]


def test_readiness_counts_ready_replicas_against_the_quorum_among_those_reporting() -> None:
    from deltasync.signal import ReplicaStatus

    def view(*replicas: tuple[int | None, str]) -> FleetView:
        return FleetView("r", 9, 0.0, tuple(ReplicaStatus(f"e{i}", s, None, st) for i, (s, st) in enumerate(replicas)))

    fleet = view((9, "serving"), (8, "failed"), (7, "serving"), (9, "needs_replacement"), (None, "starting"))
    assert fleet_ready(fleet, 9, quorum=1)
    assert not fleet_ready(fleet, 9, quorum=2)  # needs_replacement does not count, whatever its step
    assert fleet_ready(fleet, 9, max_lag=1, quorum=2)  # failed still serves its step
    assert fleet_ready(fleet, 9, max_lag=2, quorum=0.6) and not fleet_ready(fleet, 9, max_lag=2, quorum=0.61)
    assert not fleet_ready(fleet, 9, max_lag=9)  # every live one: the starting one serves nothing
    assert fleet_ready(fleet, 9, quorum=1, min_replicas=5) and not fleet_ready(fleet, 9, quorum=1, min_replicas=6)
    assert not fleet_ready(view(), 0) and fleet_ready(view(), 0, min_replicas=0)
