"""Replica identity on the signal server (TestClient, injected clock): replica tokens bind a replica id
to its reports, shared tokens cannot frame, mask, overwrite or remove a bound replica, leases keep
two unbound reporters off one id, and the fleet groups with the run's own policy, never a report's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deltasync.protocol.audit import AuditPolicy, AuditReport, fingerprint
from deltasync.protocol.probes import ProbeSet
from deltasync.run import write_probes
from deltasync.server import Settings, create_app
from deltasync.signal import LEASE_HEADER, derive_replica_key, new_lease, replica_token
from deltasync.storage import MemoryStore

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
REP = "report-token-0123"
KEY = derive_replica_key(PUB)
DIGEST = "ab" * 16


class Clock:
    """The server's wall clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **settings: Any) -> TestClient:
    opts: dict[str, Any] = {"publish_token": PUB, "subscribe_token": SUB, "report_token": REP, **settings}
    return TestClient(create_app(Settings(**opts), clock=clock))


@pytest.fixture
def client(clock: Clock) -> Iterator[TestClient]:
    with make(clock) as c:
        yield c


def headers(tok: str | None, lease: str | None = None) -> dict[str, str]:
    out = {} if tok is None else {"Authorization": f"Bearer {tok}"}
    if lease is not None:
        out[LEASE_HEADER] = lease
    return out


def put(
    c: TestClient, replica: str, body: dict[str, Any], tok: str | None, lease: str | None = None, run: str = "r"
) -> Any:
    return c.put(f"/v1/runs/{run}/replicas/{replica}", json=body, headers=headers(tok, lease))


def delete(c: TestClient, replica: str, tok: str | None, lease: str | None = None, run: str = "r") -> Any:
    return c.delete(f"/v1/runs/{run}/replicas/{replica}", headers=headers(tok, lease))


def view(c: TestClient, run: str = "r") -> dict[str, dict[str, Any]]:
    r = c.get(f"/v1/runs/{run}/fleet", headers=headers(SUB))
    assert r.status_code == 200, r.text
    return {x["replica"]: x for x in r.json()["replicas"]}


def lp(delta: float) -> list[list[float]]:
    return [[-5.0 - 0.1 * i + delta for i in range(8)] for _ in range(2)]


def serving(step: int, delta: float, tolerance: float | None = None) -> dict[str, Any]:
    audit = AuditReport(step, fingerprint(DIGEST, lp(delta))).to_dict()
    if tolerance is not None:
        audit["tolerance"] = tolerance
    return {"step": step, "state": "serving", "audit": audit}


def tok(replica: str, run: str = "r", key: bytes = KEY) -> str:
    return replica_token(key, run, replica)


# ---------------------------------------------------------------- framing and masking


def test_three_fake_replicas_cannot_frame_an_honest_bound_one(client: TestClient) -> None:
    assert put(client, "honest", serving(4, 0.0), tok("honest")).status_code == 200
    for i in range(3):  # the shared report token: they agree with each other on another fingerprint
        assert put(client, f"fake-{i}", serving(4, 0.5), REP, new_lease()).status_code == 200
    v = view(client)
    assert (v["honest"]["state"], v["honest"]["odd_one_out"]) == ("serving", False)
    # the bound replica decides: the fakes disagree with it, so they are the odd ones out
    assert {v[f"fake-{i}"]["state"] for i in range(3)} == {"diverged"}


def test_without_a_replica_token_the_same_three_fakes_frame_it(client: TestClient) -> None:
    """The attack the tokens stop: among unbound replicas the majority decides."""
    assert put(client, "honest", serving(4, 0.0), REP, new_lease()).status_code == 200
    for i in range(3):
        assert put(client, f"fake-{i}", serving(4, 0.5), REP, new_lease()).status_code == 200
    assert view(client)["honest"]["state"] == "diverged"


def test_one_fake_reporting_tolerance_100_cannot_mask_a_diverged_bound_one(client: TestClient) -> None:
    for name, delta in (("a", 0.0), ("b", 0.001), ("c", 0.0005), ("bad", 0.7)):
        assert put(client, name, serving(6, delta), tok(name)).status_code == 200
    # it agrees with nobody's fingerprint exactly, and claims a tolerance that would agree with all
    assert put(client, "fake", serving(6, 0.35, tolerance=100), REP, new_lease()).status_code == 200
    v = view(client)
    assert (v["bad"]["state"], v["bad"]["odd_one_out"]) == ("diverged", True)
    assert [v[n]["state"] for n in ("a", "b", "c")] == ["serving"] * 3
    assert v["fake"]["audit"]["tolerance"] == 100  # shown as reported, never used to group


def test_a_reported_tolerance_is_ignored_among_unbound_replicas_too(client: TestClient) -> None:
    for name, delta in (("a", 0.0), ("b", 0.001), ("bad", 0.7)):
        assert put(client, name, serving(6, delta, tolerance=100), REP, new_lease()).status_code == 200
    assert view(client)["bad"]["state"] == "diverged"


# ---------------------------------------------------------------- who may speak for whom


def test_a_replica_token_reports_only_its_own_replica_ids(client: TestClient) -> None:
    body = {"step": 1, "state": "serving"}
    assert put(client, "node3", body, tok("node3")).status_code == 200
    assert put(client, "node3-0", body, tok("node3")).status_code == 200  # identity-<suffix>: a node's replicas
    for other in ("node30", "node", "other", "node3-"):
        r = put(client, other, body, tok("node3"))
        assert r.status_code in (403, 422), (other, r.text)
    r = put(client, "other", body, tok("node3"))
    assert r.status_code == 403 and "for replica 'node3'" in r.json()["detail"]
    assert delete(client, "other", tok("node3")).status_code == 403
    assert put(client, "other", body, tok("other")).status_code == 200
    assert delete(client, "other", tok("node3")).status_code == 403  # another identity cannot remove it either
    assert "other" in view(client)
    assert delete(client, "other", tok("other")).status_code == 204


def test_tokens_for_run_a_do_not_work_for_run_b(client: TestClient) -> None:
    body = {"step": 1, "state": "serving"}
    assert put(client, "x", body, tok("x", run="a"), run="a").status_code == 200
    r = put(client, "x", body, tok("x", run="a"), run="b")
    assert r.status_code == 403 and "for run 'a', not 'b'" in r.json()["detail"]
    assert delete(client, "x", tok("x", run="a"), run="b").status_code == 403


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (replica_token(b"another-servers-key-0123", "r", "x"), "not made with this server's replica key"),
        ("dsr1~r~x~" + "A" * 43, "not made with this server's replica key"),
        ("dsr1~r~x", "not a replica token"),
        ("dsr1~r~x~short", "not a replica token"),
    ],
)
def test_a_forged_or_malformed_replica_token_is_403(client: TestClient, token: str, message: str) -> None:
    r = put(client, "x", {"step": 1, "state": "serving"}, token)
    assert r.status_code == 403 and message in r.json()["detail"]
    assert view(client) == {}


def test_a_server_without_a_key_refuses_replica_tokens(clock: Clock) -> None:
    with make(clock, publish_token=None, subscribe_token=None, report_token=None) as c:
        r = put(c, "x", {"step": 1, "state": "serving"}, tok("x"))
        assert r.status_code == 403 and "DELTASYNC_REPLICA_KEY" in r.json()["detail"]
        assert put(c, "x", {"step": 1, "state": "serving"}, None).status_code == 200  # open: unbound


def test_the_replica_key_setting_replaces_the_derived_key(clock: Clock) -> None:
    own = "a-replica-key-of-32-characters!!"
    with make(clock, replica_key=own) as c:
        assert put(c, "x", {"step": 1, "state": "serving"}, tok("x", key=own.encode())).status_code == 200
        assert put(c, "y", {"step": 1, "state": "serving"}, tok("y")).status_code == 403  # the derived key is not it
    with pytest.raises(ValueError, match="replica_key must be at least 16"):
        Settings(replica_key="short")


def test_the_shared_tokens_cannot_overwrite_or_remove_a_bound_replica(client: TestClient) -> None:
    assert put(client, "a", {"step": 5, "state": "serving"}, tok("a")).status_code == 200
    r = put(client, "a", {"step": 1, "state": "failed"}, REP, new_lease())
    assert "held by its replica token" in r.json()["detail"] and "deltasync replica-token" in r.json()["detail"]
    assert delete(client, "a", REP).status_code == 403
    assert (view(client)["a"]["step"], view(client)["a"]["state"]) == (5, "serving")
    assert delete(client, "a", PUB).status_code == 204  # the operator may remove any replica
    assert view(client) == {}


def test_a_bound_replica_takes_its_id_back_from_an_unbound_squatter(client: TestClient) -> None:
    squat = new_lease()
    assert put(client, "a", {"step": 1, "state": "failed"}, REP, squat).status_code == 200
    assert put(client, "a", {"step": 5, "state": "serving"}, tok("a")).status_code == 200
    assert put(client, "a", {"step": 1, "state": "failed"}, REP, squat).status_code == 403
    assert view(client)["a"]["state"] == "serving"


def test_a_bound_replica_restarting_with_the_same_token_continues(client: TestClient, clock: Clock) -> None:
    first = put(client, "a", {"step": 5, "state": "serving"}, tok("a"), new_lease())
    assert first.status_code == 200
    clock.t += 3
    again = put(client, "a", {"step": 5, "state": "serving"}, tok("a"), new_lease())  # a new process, a new lease
    assert again.status_code == 200 and again.json()["since"] == first.json()["since"]


# ---------------------------------------------------------------- leases of unbound replicas


def test_two_unbound_reporters_of_one_id_conflict_until_the_first_leaves_or_ages_out(
    client: TestClient, clock: Clock
) -> None:
    one, two = new_lease(), new_lease()
    body = {"step": 1, "state": "serving", "ttl_s": 10}
    assert put(client, "x", body, REP, one).status_code == 200
    r = put(client, "x", body, REP, two)
    assert r.status_code == 409 and "held by another reporter" in r.json()["detail"] and "ttl_s" in r.json()["detail"]
    assert put(client, "x", body, REP, None).status_code == 409  # no lease is another lease
    assert delete(client, "x", REP, two).status_code == 409
    assert put(client, "x", body, REP, one).status_code == 200  # the holder goes on
    clock.t += 11  # it stopped reporting: its lease ages out with it
    assert put(client, "x", body, REP, two).status_code == 200
    assert put(client, "x", body, REP, one).status_code == 409
    assert delete(client, "x", REP, two).status_code == 204  # leaving frees the id at once
    assert put(client, "x", body, REP, one).status_code == 200


def test_a_reporter_without_a_lease_protects_nothing_as_before(client: TestClient) -> None:
    body = {"step": 1, "state": "serving"}
    assert put(client, "x", body, REP).status_code == 200
    assert put(client, "x", body, REP).status_code == 200  # an old client, twice: as before leases
    lease = new_lease()
    assert put(client, "x", body, REP, lease).status_code == 200  # a lease takes an unleased id
    assert put(client, "x", body, REP).status_code == 409


def test_an_overlong_lease_is_422_after_authentication(client: TestClient) -> None:
    body = {"step": 1, "state": "serving"}
    assert put(client, "x", body, "wrong-token-0123", "x" * 257).status_code == 403
    r = put(client, "x", body, REP, "x" * 257)
    assert r.status_code == 422 and "deltasync-lease" in r.text.lower()
    assert view(client) == {}


def test_the_refusals_are_counted(client: TestClient) -> None:
    assert put(client, "a", {"step": 1, "state": "serving"}, tok("a")).status_code == 200
    assert put(client, "a", {"step": 1, "state": "serving"}, REP, new_lease()).status_code == 403
    text = client.get("/metrics").text
    assert 'deltasync_fleet_identity_refused_total{status="403"} 1' in text


# ---------------------------------------------------------------- minting


def test_the_publish_scope_mints_the_same_token_as_offline(client: TestClient) -> None:
    url = "/v1/runs/r/replicas/node3/token"
    assert client.post(url, headers=headers(REP)).status_code == 403
    assert client.post(url, headers=headers(SUB)).status_code == 403
    r = client.post(url, headers=headers(PUB))
    assert r.status_code == 200, r.text
    assert r.json() == {"token": tok("node3"), "run": "r", "replica": "node3"}
    assert put(client, "node3-1", {"step": 1, "state": "serving"}, r.json()["token"]).status_code == 200


def test_minting_without_a_key_is_409(clock: Clock) -> None:
    with make(clock, publish_token=None, subscribe_token=None, report_token=None) as c:
        r = c.post("/v1/runs/r/replicas/x/token")
        assert r.status_code == 409 and "DELTASYNC_REPLICA_KEY" in r.json()["detail"]


# ---------------------------------------------------------------- the run's policy


def test_the_fleet_groups_with_the_runs_policy_from_the_store(clock: Clock) -> None:
    store = MemoryStore("policy")
    probes = ProbeSet(((1, 2, 3, 4, 5, 6),), 16, AuditPolicy(fingerprint_tolerance=0.5))
    write_probes(store, probes)
    settings = Settings(publish_token=PUB, subscribe_token=SUB, report_token=REP)
    with TestClient(create_app(settings, store=store, clock=clock)) as c:
        for name, delta in (("a", 0.0), ("b", 0.001), ("c", 0.3)):  # 0.3 nats off: within the run's 0.5
            assert put(c, name, serving(2, delta, tolerance=0.0), tok(name)).status_code == 200
        assert {v["state"] for v in view(c).values()} == {"serving"}
        assert c.app.state.fleet.tolerance("r") == 0.5
    with make(clock) as c:  # no store: the default tolerance (0.02), whatever the reports say
        for name, delta in (("a", 0.0), ("b", 0.001), ("c", 0.3)):
            assert put(c, name, serving(2, delta, tolerance=0.5), tok(name)).status_code == 200
        assert view(c)["c"]["state"] == "diverged"


def test_a_run_without_probes_gets_the_default_and_is_read_again_later(clock: Clock) -> None:
    store = MemoryStore("late")
    with TestClient(create_app(Settings(publish_token=PUB), store=store, clock=clock)) as c:
        assert put(c, "a", serving(2, 0.0), tok("a")).status_code == 200
        assert c.app.state.fleet.tolerance("r") == 0.02
        write_probes(store, ProbeSet(((1, 2, 3, 4, 5, 6),), 16, AuditPolicy(fingerprint_tolerance=0.25)))
        assert put(c, "a", serving(2, 0.0), tok("a")).status_code == 200
        assert c.app.state.fleet.tolerance("r") == 0.02  # cached until retry_s
        clock.t += 61
        assert put(c, "a", serving(2, 0.0), tok("a")).status_code == 200
        assert c.app.state.fleet.tolerance("r") == 0.25


# ---------------------------------------------------------------- bounds and free text


def test_a_divergence_of_1e308_or_a_tolerance_over_the_bound_is_422(client: TestClient) -> None:
    body = serving(1, 0.0)
    body["audit"]["divergence"] = {"mean_abs": 1e308, "max_abs": 1.0, "kl": 0.1}
    r = put(client, "a", body, tok("a"))
    assert r.status_code == 422 and "less than or equal to 1000000" in r.text
    body = serving(1, 0.0, tolerance=100.5)
    r = put(client, "a", body, tok("a"))
    assert r.status_code == 422 and "less than or equal to 100" in r.text
    assert put(client, "a", serving(1, 0.0, tolerance=100), tok("a")).status_code == 200
    assert view(client)["a"]["audit"]["divergence"] is None


def test_control_and_bidi_characters_of_a_last_error_are_escaped_by_the_server(client: TestClient) -> None:
    raw = "boom\x1b[2J\rover\u202eevil\u2066\nline two\x00"
    r = put(client, "a", {"step": 1, "state": "failed", "last_error": raw}, tok("a"))
    assert r.status_code == 200, r.text
    shown = view(client)["a"]["last_error"]
    assert shown == "boom\\x1b[2J\\rover\\u202eevil\\u2066\\nline two\\x00"
    assert shown.isprintable()
    long = "\x1b" * 2000  # 4 characters each once escaped: cut, never refused
    r = put(client, "b", {"step": 1, "state": "failed", "last_error": long}, tok("b"))
    assert r.status_code == 200 and len(view(client)["b"]["last_error"]) == 2000
