"""A replica's ``audit_error`` (why its last behavioural audit could not run) end to end: the report
route keeps it escaped and cut like ``last_error`` and shows it in GET fleet; a report without the
field (an older reporter) clears it and keeps working; the fleet view parses it; ``FleetReporter``
sends it; and a ``healthy_only`` gate does not count a ``serving`` replica that reports one
(docs/fleet.md "Healthy")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_harness import ThreadServer

from deltasync.server import Settings, create_app
from deltasync.signal import FleetReporter, FleetView, ReplicaStatus, SignalClient, fleet_ready

PUB = "publish-token-audit-error"
SUB = "subscribe-token-audit-error"
WAIT = 30.0
WHY = "the probes' reference of step 3 is damaged: row 2 has 31 logprobs for 32 tokens"


class Clock:
    """The server's wall clock (fixed)."""

    def __call__(self) -> float:
        return 1_000_000.0


def auth(tok: str = SUB) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(publish_token=PUB, subscribe_token=SUB), clock=Clock())) as c:
        yield c


def put(c: TestClient, replica: str, **body: Any) -> Any:
    r = c.put(f"/v1/runs/r/replicas/{replica}", json={"step": 3, "state": "serving", **body}, headers=auth())
    assert r.status_code == 200, r.text
    return r.json()


def rows(c: TestClient) -> dict[str, dict[str, Any]]:
    r = c.get("/v1/runs/r/fleet", headers=auth())
    assert r.status_code == 200, r.text
    return {x["replica"]: x for x in r.json()["replicas"]}


def test_the_route_keeps_an_audit_error_escaped_and_cut_and_shows_it(client: TestClient) -> None:
    entry = put(client, "a", audit_error=WHY)
    assert entry["audit_error"] == WHY  # the report's reply shows it too
    put(client, "b", audit_error="x\x1b[31m\u202e\n" + "y" * 1990)  # escaping makes it 2,008 long
    put(client, "c")
    shown = rows(client)
    assert shown["a"]["audit_error"] == WHY and shown["a"]["state"] == "serving"
    b = shown["b"]["audit_error"]
    assert b.startswith("x\\x1b[31m\\u202e\\n") and len(b) == 2000 and b.endswith("...")
    assert shown["c"]["audit_error"] is None
    view = FleetView.from_json(client.get("/v1/runs/r/fleet", headers=auth()).json())
    assert [(r.replica, r.audit_error) for r in view.replicas] == [("a", WHY), ("b", b), ("c", None)]


def test_a_report_without_the_field_clears_it_and_an_old_reporter_keeps_working(client: TestClient) -> None:
    put(client, "a", audit_error=WHY)
    assert rows(client)["a"]["audit_error"] == WHY
    put(client, "a")  # the next audit ran (or an older reporter, which never sends the field)
    assert rows(client)["a"]["audit_error"] is None
    r = client.put("/v1/runs/r/replicas/a", json={"step": 3, "state": "serving", "audit_error": 7}, headers=auth())
    assert r.status_code == 422  # strict: a text or null
    r = client.put(
        "/v1/runs/r/replicas/a", json={"step": 3, "state": "serving", "audit_error": "x" * 2001}, headers=auth()
    )
    assert r.status_code == 422  # over the bound before escaping, as last_error


def status(state: str, audit_error: str | None, step: int = 3) -> ReplicaStatus:
    return ReplicaStatus("r", step, 0, state, audit_error=audit_error)  # type: ignore[arg-type]


def test_a_serving_replica_whose_audit_could_not_run_is_not_healthy() -> None:
    assert status("serving", None).serves_at_least(3, healthy_only=True)
    assert status("serving", None).healthy
    unaudited = status("serving", WHY)
    assert not unaudited.healthy
    assert not unaudited.serves_at_least(3, healthy_only=True)
    assert unaudited.serves_at_least(3)  # it holds the step: the default gate counts it
    assert not status("serving", None, step=2).serves_at_least(3, healthy_only=True)
    view = FleetView("r", 3, 0.0, (status("serving", None), unaudited))
    assert fleet_ready(view, 3) and not fleet_ready(view, 3, healthy_only=True)
    assert fleet_ready(view, 3, healthy_only=True, quorum=1)
    assert "could not run: the probes' reference" in view.table()


@pytest.fixture(scope="module")
def live() -> Iterator[ThreadServer]:
    with ThreadServer(create_app(Settings(publish_token=PUB, subscribe_token=SUB))) as s:
        yield s


def test_a_reporter_sends_it_and_the_healthy_gate_waits_until_an_audit_runs(live: ThreadServer) -> None:
    with SignalClient(live.url, PUB) as trainer:
        trainer.publish("gate", 3, "3" * 32)
        with (
            FleetReporter(live.url, "gate", SUB, replica="good") as good,
            FleetReporter(live.url, "gate", SUB, replica="unaudited") as bad,
        ):
            good.update(3, digest="3" * 32)
            bad.update(3, digest="3" * 32, audit_error=WHY)
            assert good.wait_reported(WAIT) and bad.wait_reported(WAIT)
            view = trainer.fleet("gate")
            assert {r.replica: (r.state, r.audit_error) for r in view.replicas} == {
                "good": ("serving", None),
                "unaudited": ("serving", WHY),
            }
            assert fleet_ready(view, 3) and not fleet_ready(view, 3, healthy_only=True)
            bad.update(3, digest="3" * 32)  # its next audit ran
            assert bad.wait_reported(WAIT)
            assert fleet_ready(trainer.fleet("gate"), 3, healthy_only=True)


def test_the_reporter_cuts_an_audit_error_to_the_server_s_bound(live: ThreadServer) -> None:
    with FleetReporter(live.url, "cut", SUB, replica="long") as rep, SignalClient(live.url, SUB) as reader:
        rep.update(1, audit_error="z" * 5000)
        assert rep.served.audit_error is not None and len(rep.served.audit_error) == 2000
        assert rep.wait_reported(WAIT)
        (r,) = reader.fleet("cut").replicas
        assert r.audit_error == "z" * 1997 + "..."
