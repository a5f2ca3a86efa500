"""The audit in the fleet from the receivers' and the trainer's side, against a real signal server on
127.0.0.1: a FleetReporter's audit reaches the fleet view (typed back as an AuditReport), the odd one
out is shown diverged, and the staleness gate counts a diverged replica as holding its step unless
``healthy_only``, where it waits for it (released when it is healthy again, else a timeout that names
it). Waits are on events and injected clocks; nothing asserts a duration."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import ThreadServer

from deltasync.errors import StalenessTimeout
from deltasync.protocol.audit import AuditReport, Divergence, fingerprint
from deltasync.signal import FleetReporter, FleetView, ReplicaStatus, SignalClient, fleet_ready, wait_for_fleet

PUB = "publish-token-audit"
SUB = "subscribe-token-audit"
D = [f"{i:032x}" for i in range(10)]
PROBES = "cd" * 16
WAIT = 30.0


def audit(step: int, delta: float = 0.0, div: Divergence | None = None) -> AuditReport:
    return AuditReport(step, fingerprint(PROBES, [[-4.0 - 0.2 * i + delta for i in range(8)]]), div)


def reporter(server: ThreadServer, run: str, replica: str) -> FleetReporter:
    return FleetReporter(server.url, run, SUB, replica=replica)


def test_reported_audits_come_back_typed_and_the_odd_one_out_is_diverged(
    server: ThreadServer, trainer: SignalClient, run: str
) -> None:
    trainer.publish(run, 2, D[2])
    div = Divergence(0.01, 0.05, 0.0001)
    with reporter(server, run, "a") as a, reporter(server, run, "b") as b, reporter(server, run, "c") as c:
        a.update(2, digest=D[2], audit=audit(2, div=div))
        b.update(2, digest=D[2], audit=audit(2, 0.002))
        c.update(2, digest=D[2], audit=audit(2, 0.4))  # e.g. served from a stale prefix cache
        assert a.wait_reported(WAIT) and b.wait_reported(WAIT) and c.wait_reported(WAIT)
        assert a.served.audit == audit(2, div=div)
        view = trainer.fleet(run)
        by = {r.replica: r for r in view.replicas}
        assert by["a"].audit == audit(2, div=div) and by["b"].audit == audit(2, 0.002)
        assert [(r.replica, r.state, r.odd_one_out) for r in view.replicas] == [
            ("a", "serving", False),
            ("b", "serving", False),
            ("c", "diverged", True),
        ]
        assert [r.replica for r in view.diverged()] == ["c"]
        # the gate: by default a diverged replica holds its step; healthy_only does not count it
        assert wait_for_fleet(trainer, run, 2, timeout=0).replicas
        with pytest.raises(StalenessTimeout) as info:
            wait_for_fleet(trainer, run, 2, healthy_only=True, timeout=0)
        msg = str(info.value)
        assert "healthy ones only" in msg and "c: step 2" in msg and "state diverged" in msg
        assert wait_for_fleet(trainer, run, 2, healthy_only=True, quorum=2, timeout=0).replicas
        # a gate waiting for healthy replicas is released when c is audited healthy again
        with ThreadPoolExecutor(1) as pool:
            gate = pool.submit(wait_for_fleet, trainer, run, 2, healthy_only=True, timeout=WAIT, poll=0.01)
            c.update(2, digest=D[2], audit=audit(2, 0.001))
            view = gate.result(WAIT)
        assert {r.state for r in view.replicas} == {"serving"}


def test_readiness_with_healthy_only_counts_serving_replicas_only() -> None:
    def view(*states: str) -> FleetView:
        return FleetView(
            "r",
            5,
            0.0,
            tuple(ReplicaStatus(f"e{i}", 5, 0, s) for i, s in enumerate(states)),  # type: ignore[arg-type]
        )

    fleet = view("serving", "diverged", "failed")
    assert fleet_ready(fleet, 5)  # diverged and failed still hold step 5
    assert not fleet_ready(fleet, 5, healthy_only=True)
    assert fleet_ready(fleet, 5, healthy_only=True, quorum=1)
    assert not fleet_ready(fleet, 5, healthy_only=True, quorum=2)
    assert [r.replica for r in fleet.behind(5, healthy_only=True)] == ["e1", "e2"] and fleet.behind(5) == []


def test_the_fleet_table_shows_each_replicas_audit(server: ThreadServer, trainer: SignalClient, run: str) -> None:
    with reporter(server, run, "a") as a, reporter(server, run, "b") as b, reporter(server, run, "c") as c:
        a.update(2, audit=audit(2, div=Divergence(0.0016, 0.0053, 2e-6)))
        b.update(2, audit=audit(2))
        c.update(2, audit=audit(2, 0.4))
        assert a.wait_reported(WAIT) and b.wait_reported(WAIT) and c.wait_reported(WAIT)
        lines = trainer.fleet(run).table().splitlines()
    assert lines[0].split() == ["replica", "step", "lag", "state", "last", "seen", "audit", "last", "error"]
    assert lines[1].endswith("step 2 group 0, |d| 0.0016/0.0053 kl 2e-06")
    assert lines[2].endswith("step 2 group 0")
    assert "diverged" in lines[3] and lines[3].endswith("step 2 group 1 odd one out")
