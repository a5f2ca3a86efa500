"""The staleness gate's policy for replicas reported ``unreachable`` (issue 34.4), against a real signal server.

A sidecar keeps reporting a server it cannot reach as ``unreachable`` at its last step (it never ages
out): by default the gate leaves it out of the live replicas and names it, in a warning when it
releases and in the timeout's report; ``unreachable="wait"`` waits for it as a replica behind.
Time is injected (the gate's clock and wait): nothing sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from server_harness import ThreadServer

from deltasync.errors import StalenessTimeout
from deltasync.server import Settings, create_app
from deltasync.signal import FleetReporter, SignalClient, fleet_ready, wait_for_fleet

PUB = "publish-token-gate-unreachable"
WAIT = 30.0


class FakeTime:
    """Injected clock and wait of the gate: time moves only when the gate waits."""

    def __init__(self) -> None:
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def fleet() -> Iterator[SignalClient]:
    """A signal server where run ``r`` is at step 4: replica ``up`` serves it, ``dead`` is unreachable at step 4."""
    with ThreadServer(create_app(Settings(publish_token=PUB))) as server, SignalClient(server.url, PUB) as trainer:
        for step in range(5):
            trainer.publish("r", step, f"{step:032x}")
        with (
            FleetReporter(server.url, "r", PUB, replica="up") as up,
            FleetReporter(server.url, "r", PUB, replica="dead") as dead,
        ):
            up.update(4, digest=f"{4:032x}")
            dead.update(4, "unreachable", last_error="unreachable: ConnectError: [Errno 111] Connection refused")
            assert up.wait_reported(WAIT) and dead.wait_reported(WAIT)
            yield trainer


def test_an_unreachable_replica_is_not_counted_as_serving_and_is_named(
    fleet: SignalClient, caplog: pytest.LogCaptureFixture
) -> None:
    view = fleet.fleet("r")
    assert {r.replica: r.state for r in view.replicas} == {"dead": "unreachable", "up": "serving"}
    # it reported the step, but it serves nobody: two replicas needed, one counts
    assert not fleet_ready(view, 4, min_replicas=2)
    assert fleet_ready(view, 4)
    assert not fleet_ready(view, 4, unreachable="wait")
    ft = FakeTime()
    with pytest.raises(StalenessTimeout) as info:
        wait_for_fleet(fleet, "r", 4, min_replicas=2, timeout=10, poll=1, clock=ft.clock, wait=ft.wait)
    msg = str(info.value)
    assert "1 of 1 live replicas ready" in msg
    assert "excluded (unreachable: not counted as live, unreachable='exclude'):" in msg
    assert "dead: last step 4" in msg and "Connection refused" in msg
    with caplog.at_level(logging.WARNING, logger="deltasync.signal.fleet"):
        wait_for_fleet(fleet, "r", 4, timeout=10, poll=1, clock=ft.clock, wait=ft.wait)
    assert "released at step 4 without the unreachable replica(s) dead (last step 4" in caplog.text


def test_the_wait_policy_waits_for_an_unreachable_replica_as_one_behind(fleet: SignalClient) -> None:
    ft = FakeTime()
    with pytest.raises(StalenessTimeout) as info:
        wait_for_fleet(fleet, "r", 4, unreachable="wait", timeout=10, poll=1, clock=ft.clock, wait=ft.wait)
    msg = str(info.value)
    assert "1 of 2 live replicas ready, 2 needed" in msg
    assert "dead: step 4, lag 0, state unreachable" in msg and "excluded" not in msg
    with pytest.raises(ValueError, match="unreachable must be one of"):
        wait_for_fleet(fleet, "r", 4, unreachable="ignore", timeout=0)  # type: ignore[arg-type]
