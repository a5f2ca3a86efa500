"""The fleet's behavioural audit on the signal server (TestClient): reports carry an audit, the fleet
groups replicas by (audited step, agreeing fingerprint), shows a serving odd one out ``diverged``,
exposes each replica's divergence per audited step in the metrics, and refuses hostile audits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deltasync.protocol.audit import AuditReport, Divergence, fingerprint
from deltasync.server import Settings, create_app

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
DIGEST = "ab" * 16


def auth(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(publish_token=PUB, subscribe_token=SUB))) as c:
        yield c


def lp(delta: float = 0.0) -> list[list[float]]:
    return [[-5.0 - 0.1 * i + delta for i in range(8)] for _ in range(2)]


def audit(step: int, delta: float = 0.0, div: Divergence | None = None) -> dict[str, Any]:
    return AuditReport(step, fingerprint(DIGEST, lp(delta)), div).to_dict()


def put(c: TestClient, replica: str, body: dict[str, Any], run: str = "r") -> Any:
    return c.put(f"/v1/runs/{run}/replicas/{replica}", json=body, headers=auth(SUB))


def fleet(c: TestClient, run: str = "r") -> dict[str, dict[str, Any]]:
    r = c.get(f"/v1/runs/{run}/fleet", headers=auth(SUB))
    assert r.status_code == 200, r.text
    return {x["replica"]: x for x in r.json()["replicas"]}


def test_the_odd_one_out_at_a_step_is_shown_diverged_and_the_rest_are_unaffected(client: TestClient) -> None:
    small = Divergence(0.004, 0.02, 0.00001).to_dict()
    assert (
        put(client, "a", {"step": 4, "state": "serving", "audit": audit(4, div=Divergence(**small))}).status_code == 200
    )
    assert put(client, "b", {"step": 4, "state": "serving", "audit": audit(4, 0.001)}).status_code == 200
    r = put(client, "c", {"step": 4, "state": "serving", "audit": audit(4, 0.5)})
    assert r.status_code == 200 and r.json()["audit"]["fingerprint"] == audit(4, 0.5)["fingerprint"]
    put(client, "d", {"step": 3, "state": "serving"})  # no audit: no group, as reported
    view = fleet(client)
    assert {k: (v["state"], v["fingerprint_group"], v["odd_one_out"]) for k, v in view.items()} == {
        "a": ("serving", 0, False),
        "b": ("serving", 0, False),
        "c": ("diverged", 1, True),
        "d": ("serving", None, False),
    }
    assert view["a"]["audit"] == {
        "audited_step": 4,
        "fingerprint": audit(4)["fingerprint"],
        "divergence": small,
        "tolerance": 0.02,
    }
    assert view["d"]["audit"] is None
    # c catches up with the others: the fleet shows it serving again
    put(client, "c", {"step": 4, "state": "serving", "audit": audit(4)})
    assert fleet(client)["c"]["state"] == "serving"
    # a replica that reports itself diverged (over the thresholds) stays diverged, in the fleet and metrics
    put(client, "b", {"step": 4, "state": "diverged", "audit": audit(4, div=Divergence(3.0, 9.0, 2.5))})
    assert fleet(client)["b"]["state"] == "diverged"
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="r",state="diverged"} 1' in text
    assert 'deltasync_replica_divergence{replica="b",run="r",stat="mean_abs",step="4"} 3' in text
    assert 'deltasync_replica_divergence{replica="b",run="r",stat="kl",step="4"} 2.5' in text
    assert 'deltasync_replica_divergence{replica="a",run="r",stat="max_abs",step="4"} 0.02' in text
    assert 'replica="c"' not in text.split("deltasync_replica_divergence", 1)[1]  # c reported no divergence


def test_the_metrics_count_a_replica_the_fleet_shows_diverged(client: TestClient) -> None:
    for rid, d in (("a", 0.0), ("b", 0.0), ("c", 1.0)):
        put(client, rid, {"step": 9, "state": "serving", "audit": audit(9, d)}, run="m")
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="m",state="diverged"} 1' in text
    assert 'deltasync_fleet_replicas{run="m",state="serving"} 2' in text


@pytest.mark.parametrize(
    "bad",
    [
        {"audited_step": -1, "fingerprint": audit(1)["fingerprint"]},
        {"audited_step": 1, "fingerprint": "fp1-zz"},
        {"audited_step": 1, "fingerprint": "fp1-01234567-" + "0" * 4800},
        {
            "audited_step": 1,
            "fingerprint": audit(1)["fingerprint"],
            "divergence": {"mean_abs": -1, "max_abs": 0, "kl": 0},
        },
        {"audited_step": 1, "fingerprint": audit(1)["fingerprint"], "divergence": {"mean_abs": 0, "max_abs": 0}},
        {"audited_step": 1, "fingerprint": audit(1)["fingerprint"], "tolerance": "0.1"},
        {"audited_step": 1, "fingerprint": audit(1)["fingerprint"], "x": 1},
        {"fingerprint": audit(1)["fingerprint"]},
        "audit",
    ],
)
def test_a_hostile_audit_is_a_422_and_records_nothing(client: TestClient, bad: Any) -> None:
    r = put(client, "h", {"step": 1, "state": "serving", "audit": bad})
    assert r.status_code == 422, r.text
    assert "h" not in fleet(client)
