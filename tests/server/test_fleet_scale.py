"""The fleet view at fleet size: the book parses a fingerprint once, regroups only the audited steps an
audit changed (a heartbeat with the same audit regroups nothing, nor does a read), reads never group
on the event loop, the run's tolerance (the book's) decides and not a report's, bound replicas decide
and evict unbound ones from a full run, 4,096 replicas fit by default, and the GET reply assembled
from cached JSON is the ``FleetOut`` the models describe. Work is counted, never timed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import AuditReport, Divergence, FingerprintGroup
from deltasync.server import Settings, create_app
from deltasync.server._fleet import FleetBook, FleetFull, Replica
from deltasync.server._models import AuditBody, FleetOut, ReplicaOut
from deltasync.signal import ReplicaState

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
TAG = "01234567"


class Clock:
    """The server's wall clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def fp(values: list[int] | Any) -> str:
    return f"fp1-{TAG}-" + "".join(f"{int(v) % (1 << 24):06x}" for v in values)


BASE = [100 * i for i in range(8)]
HONEST = fp(BASE)
DIVERGED = fp([v + 2000 for v in BASE])
BETWEEN = fp([v + 1000 for v in BASE])


def book(clock: Clock, max_replicas: int = 4096, **kw: Any) -> FleetBook:
    return FleetBook(ttl_s=30.0, max_replicas=max_replicas, max_runs=8, clock=clock, on_expire=lambda n: None, **kw)


def report(b: FleetBook, rid: str, fingerprint: str | None, step: int = 3, **kw: Any) -> None:
    audit = None if fingerprint is None else AuditReport(step, fingerprint, kw.pop("div", None), kw.pop("tol", 0.02))
    ttl_s = kw.pop("ttl_s", None)
    b.report("r", rid, step=step, digest=None, state="serving", last_error=None, ttl_s=ttl_s, audit=audit, **kw)


def _out(
    r: Replica,
    head: int | None,
    head_digest: str | None,
    now: float,
    state: ReplicaState | None = None,
    group: FingerprintGroup | None = None,
) -> ReplicaOut:
    """The replica as the models render it: what the server's assembled JSON must equal."""
    lag = None if head is None or r.step is None else head - r.step
    digest_ok = None if r.digest is None or head_digest is None else r.digest == head_digest
    return ReplicaOut(
        replica=r.replica,
        step=r.step,
        lag=lag,
        state=r.state if state is None else state,
        digest=r.digest,
        digest_ok=digest_ok,
        last_error=r.last_error,
        since=r.since,
        last_seen=r.last_seen,
        age_s=max(0.0, now - r.last_seen),
        ttl_s=r.ttl_s,
        audit=None if r.audit is None else AuditBody.of(r.audit),
        fingerprint_group=None if group is None else group.group,
        odd_one_out=group is not None and group.odd_one_out,
    )


def states(b: FleetBook, run: str = "r") -> dict[str, tuple[str, int | None]]:
    return {s.replica.replica: (s.state, None if s.group is None else s.group.group) for s in b.view(run)[1]}


# ------------------------------------------------------------------ the book


def test_a_heartbeat_with_the_same_audit_regroups_nothing_and_neither_does_a_read() -> None:
    clock = Clock()
    b = book(clock)
    for rid, f in (("a", HONEST), ("b", HONEST), ("c", DIVERGED)):
        report(b, rid, f)
    assert states(b)["c"] == ("diverged", 1) and b.recomputes == 1
    for _ in range(5):
        clock.t += 1
        for rid, f in (("a", HONEST), ("b", HONEST), ("c", DIVERGED)):
            report(b, rid, f, div=Divergence(0.1, 0.2, 0.01))  # the divergence is shown, not grouped
        assert states(b)["c"] == ("diverged", 1)
        b.state_counts()
    assert b.recomputes == 1
    compared = b.comparisons
    report(b, "c", HONEST)  # c recovers: its step, and only it, is regrouped at the next read
    report(b, "z", HONEST, step=9)
    assert states(b)["c"] == ("serving", 0) and b.recomputes == 3
    assert b.state_counts()["r"]["diverged"] == 0 and b.recomputes == 3
    assert b.comparisons - compared <= 2 * 4  # the two steps' replicas, against their centres


def test_leaving_ageing_out_and_a_new_binding_regroup_their_step() -> None:
    clock = Clock()
    b = book(clock)
    for rid in "abc":
        report(b, rid, HONEST)
    report(b, "d", DIVERGED)
    report(b, "e", DIVERGED, ttl_s=5)
    assert states(b)["d"] == ("diverged", 1)
    n = b.recomputes
    clock.t += 6  # e ages out
    assert "e" not in states(b) and b.recomputes == n + 1
    assert b.leave("r", "a") and states(b)["d"] == ("diverged", 1)  # 2 of 3 still agree
    assert b.leave("r", "b") and states(b)["d"] == ("serving", 1)  # 1 against 1: no strict majority
    assert b.recomputes == n + 3
    report(b, "d", DIVERGED, bound=True)  # d is now the only bound replica at step 3: it decides
    assert states(b) == {"c": ("diverged", 1), "d": ("serving", 0)} and b.recomputes == n + 4


def test_the_runs_tolerance_decides_and_a_reports_tolerance_cannot_mask_a_diverged_replica() -> None:
    clock = Clock()
    b = book(clock)
    for rid in "abc":
        report(b, rid, HONEST)
    report(b, "d", DIVERGED)
    report(b, "fake", BETWEEN, tol=100.0)  # agrees with everyone, if its tolerance counted
    assert states(b)["d"] == ("diverged", 1) and states(b)["fake"] == ("diverged", 2)
    n = b.recomputes
    b.set_tolerance("r", 0.5)  # the run's policy: 2000 quanta (0.49 nats) agree
    assert {g for _, g in states(b).values()} == {0} and b.recomputes == n + 1 and b.tolerance("r") == 0.5
    b.set_tolerance("r", 0.5)  # unchanged: nothing to regroup
    states(b)
    assert b.recomputes == n + 1
    for bad in (-0.1, 101.0, float("nan")):
        with pytest.raises(ProtocolError, match="tolerance"):
            b.set_tolerance("r", bad)


def test_bound_replicas_decide_and_three_unbound_fakes_cannot_frame_one_honest() -> None:
    b = book(Clock())
    report(b, "honest", HONEST, bound=True)
    for rid in ("f1", "f2", "f3"):
        report(b, rid, DIVERGED)
    shown = states(b)
    assert shown["honest"] == ("serving", 0)
    assert {shown[f] for f in ("f1", "f2", "f3")} == {("diverged", 1)}


def test_a_full_run_lets_a_bound_replica_evict_the_unbound_one_seen_longest_ago() -> None:
    clock = Clock()
    evicted: list[int] = []
    b = book(clock, max_replicas=3, on_evict=evicted.append)
    for rid in ("u1", "u2", "u3"):
        report(b, rid, HONEST)
        clock.t += 1
    report(b, "u1", HONEST)  # u1 heartbeats: u2 is now the one seen longest ago
    with pytest.raises(FleetFull, match="max_replicas"):
        report(b, "u4", HONEST)  # an unbound newcomer waits
    report(b, "b1", DIVERGED, bound=True)
    assert sorted(states(b)) == ["b1", "u1", "u3"] and evicted == [1]
    report(b, "b2", DIVERGED, bound=True)
    report(b, "b3", DIVERGED, bound=True)
    assert sorted(states(b)) == ["b1", "b2", "b3"] and evicted == [1, 1, 1]
    with pytest.raises(FleetFull):
        report(b, "b4", HONEST, bound=True)  # only bound replicas left: nobody is evicted


def test_4096_replicas_with_distinct_maximum_length_fingerprints_fit_by_default() -> None:
    assert Settings().max_replicas == 4096
    clock = Clock()
    b = book(clock, max_replicas=Settings().max_replicas)
    rng = np.random.default_rng(0)
    for i in range(4096):
        report(b, f"r{i:04d}", fp(rng.integers(-(1 << 22), 1 << 22, size=256)))
    with pytest.raises(FleetFull):
        report(b, "one-more", HONEST)
    now, rows = b.view("r")
    assert len(rows) == 4096 and b.recomputes == 1
    assert b.comparisons <= 18 * 4096  # O(n): not the 8.4 M pairs of a pairwise grouping
    assert {s.group.size for s in rows if s.group is not None} == {1}
    assert not any(s.group is not None and s.group.odd_one_out for s in rows)
    b.view("r")
    assert b.recomputes == 1


# ------------------------------------------------------------------ through the server


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(publish_token=PUB, subscribe_token=SUB), clock=Clock())) as c:
        yield c


def put(c: TestClient, rid: str, body: dict[str, Any]) -> None:
    """Report ``rid``; its reply (assembled from the book's cached JSON) is the ``ReplicaOut`` the models
    render of its entry: the reported state, no group, aged 0."""
    r = c.put(f"/v1/runs/r/replicas/{rid}", json=body, headers={"Authorization": f"Bearer {SUB}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    entry = next(r for r in c.app.state.fleet.runs()[1]["r"] if r.replica == rid)  # type: ignore[attr-defined]
    head = c.app.state.relay.head("r")  # type: ignore[attr-defined]
    known = None if head is None or entry.step is None else c.app.state.relay.db.get_commit("r", entry.step)  # type: ignore[attr-defined]
    want = _out(
        entry, None if head is None else head.step, None if known is None else known.manifest_digest, entry.last_seen
    )
    assert ReplicaOut.model_validate_json(r.content) == want
    assert r.json() == want.model_dump(mode="json")


def test_the_assembled_reply_is_the_fleet_out_the_models_render(client: TestClient) -> None:
    r = client.post(
        "/v1/runs/r/commits", json={"step": 3, "manifest_digest": "1" * 32}, headers={"Authorization": f"Bearer {PUB}"}
    )
    assert r.status_code == 201
    put(client, "a", {"step": 3, "state": "serving", "digest": "1" * 32, "audit": AuditReport(3, HONEST).to_dict()})
    put(
        client,
        "b",
        {
            "step": 3,
            "state": "serving",
            "digest": "2" * 32,
            "ttl_s": 12,
            "audit": AuditReport(3, HONEST, Divergence(1e-05, 0.5, 3.25)).to_dict(),
        },
    )
    put(
        client,
        "c",
        {
            "step": 2,
            "state": "failed",
            "last_error": 'Update "rolled" back\\ é \u202e',
            "audit": AuditReport(3, DIVERGED).to_dict(),
        },
    )
    put(client, "d", {"step": None, "state": "starting"})
    reply = client.get("/v1/runs/r/fleet", headers={"Authorization": f"Bearer {SUB}"})
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    # the first read regrouped in a worker thread; the next, with nothing to regroup, renders on the
    # event loop: the same bytes (the injected clock did not move)
    again = client.get("/v1/runs/r/fleet", headers={"Authorization": f"Bearer {SUB}"})
    assert again.content == reply.content
    got = FleetOut.model_validate_json(reply.content)
    fleet = client.app.state.fleet  # type: ignore[attr-defined]
    head = client.app.state.relay.head("r")  # type: ignore[attr-defined]
    now, rows = fleet.view("r")
    digests = {3: "1" * 32}
    want = FleetOut(
        run="r",
        head=3,
        time=now,
        replicas=[_out(s.replica, head.step, digests.get(s.replica.step or -1), now, s.state, s.group) for s in rows],
    )
    assert got == want
    assert reply.json() == want.model_dump(mode="json")
    by_id = {x.replica: x for x in got.replicas}
    assert (by_id["c"].state, by_id["c"].fingerprint_group, by_id["c"].odd_one_out) == ("failed", 1, True)
    assert by_id["b"].digest_ok is False and by_id["a"].digest_ok is True and by_id["d"].lag is None


def test_reads_and_scrapes_regroup_only_what_changed_and_a_reported_tolerance_masks_nothing(
    client: TestClient,
) -> None:
    fleet = client.app.state.fleet  # type: ignore[attr-defined]
    for rid in "abc":
        put(client, rid, {"step": 3, "state": "serving", "audit": AuditReport(3, HONEST).to_dict()})
    put(client, "d", {"step": 3, "state": "serving", "audit": AuditReport(3, DIVERGED).to_dict()})
    put(client, "fake", {"step": 3, "state": "serving", "audit": AuditReport(3, BETWEEN, None, 100.0).to_dict()})
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="r",state="diverged"} 2' in text and fleet.recomputes == 1
    for _ in range(3):  # heartbeats, reads and scrapes: no regrouping
        put(client, "d", {"step": 3, "state": "serving", "audit": AuditReport(3, DIVERGED).to_dict()})
        view = client.get("/v1/runs/r/fleet", headers={"Authorization": f"Bearer {SUB}"}).json()
        assert {x["replica"]: x["state"] for x in view["replicas"]}["d"] == "diverged"
        client.get("/metrics")
    assert fleet.recomputes == 1
    put(client, "d", {"step": 3, "state": "serving", "audit": AuditReport(3, HONEST).to_dict()})
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="r",state="diverged"} 1' in text and fleet.recomputes == 2
