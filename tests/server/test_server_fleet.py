"""The fleet routes through FastAPI's TestClient: token scopes, strict input, bounds, lag, ageing
with an injected clock, and the Prometheus series."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deltasync.server import Settings, create_app

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
REP = "report-token-0123"
D1, D2, D3 = "1" * 32, "2" * 32, "3" * 32


def auth(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


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
    opts: dict[str, Any] = {"publish_token": PUB, "subscribe_token": SUB, "fleet_ttl_s": 30.0, **settings}
    return TestClient(create_app(Settings(**opts), clock=clock))


@pytest.fixture
def client(clock: Clock) -> Iterator[TestClient]:
    with make(clock) as c:
        yield c


def put(c: TestClient, replica: str, body: dict[str, Any], tok: str = SUB, run: str = "r") -> Any:
    return c.put(f"/v1/runs/{run}/replicas/{replica}", json=body, headers=auth(tok))


def publish(c: TestClient, step: int, digest: str, run: str = "r") -> None:
    r = c.post(f"/v1/runs/{run}/commits", json={"step": step, "manifest_digest": digest}, headers=auth(PUB))
    assert r.status_code == 201, r.text


def fleet(c: TestClient, run: str = "r", tok: str = SUB) -> dict[str, Any]:
    r = c.get(f"/v1/runs/{run}/fleet", headers=auth(tok))
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


# ------------------------------------------------------------------ auth


def test_reporting_takes_the_subscribe_scope_without_a_report_token(client: TestClient) -> None:
    body = {"step": 1, "state": "serving"}
    assert client.put("/v1/runs/r/replicas/a", json=body).status_code == 401
    assert put(client, "a", body, tok="wrong-token-0123").status_code == 403
    assert put(client, "a", body, tok=SUB).status_code == 200
    assert put(client, "b", body, tok=PUB).status_code == 200  # publish grants every scope
    assert client.get("/v1/runs/r/fleet").status_code == 401
    assert client.get("/v1/runs/r/fleet", headers=auth("wrong-token-0123")).status_code == 403
    assert [r["replica"] for r in fleet(client, tok=SUB)["replicas"]] == ["a", "b"]
    assert client.delete("/v1/runs/r/replicas/a").status_code == 401
    assert client.delete("/v1/runs/r/replicas/a", headers=auth(SUB)).status_code == 204


def test_a_report_token_is_the_only_receiver_token_that_reports(clock: Clock) -> None:
    with make(clock, report_token=REP) as c:
        body = {"step": 1, "state": "serving"}
        assert put(c, "a", body, tok=SUB).status_code == 403  # a reader cannot speak for replicas
        assert put(c, "a", body, tok=REP).status_code == 200
        assert put(c, "b", body, tok=PUB).status_code == 200
        assert c.get("/v1/runs/r/fleet", headers=auth(REP)).status_code == 403  # reporting is not reading
        assert len(fleet(c, tok=SUB)["replicas"]) == 2


def test_open_scopes_take_reports_and_reads_without_a_token(clock: Clock) -> None:
    with make(clock, publish_token=None, subscribe_token=None) as c:
        assert c.put("/v1/runs/r/replicas/a", json={"state": "starting"}).status_code == 200
        assert c.get("/v1/runs/r/fleet").json()["replicas"][0]["state"] == "starting"


def test_an_unauthenticated_request_learns_nothing_about_its_input(client: TestClient) -> None:
    assert client.put("/v1/runs/r/replicas/a", content=b"{not json").status_code == 401
    assert client.put("/v1/runs/r/replicas/%2F..", json={}).status_code in (401, 404, 422)
    assert client.get("/v1/runs/r/fleet?bogus=1").status_code == 401


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"step": 1},
        {"step": 1, "state": "running"},
        {"step": -1, "state": "serving"},
        {"step": "1", "state": "serving"},
        {"step": 1.5, "state": "serving"},
        {"step": True, "state": "serving"},
        {"step": 1, "state": "serving", "digest": "XYZ"},
        {"step": 1, "state": "serving", "digest": "1" * 31},
        {"step": 1, "state": "serving", "last_error": "x" * 2001},
        {"step": 1, "state": "serving", "ttl_s": 0},
        {"step": 1, "state": "serving", "ttl_s": 1e9},
        {"step": 1, "state": "serving", "extra": 1},
        {"step": 10**20, "state": "serving"},
        [],
        "serving",
    ],
)
def test_invalid_reports_are_422_and_change_nothing(client: TestClient, body: Any) -> None:
    r = put(client, "a", body)
    assert r.status_code == 422, r.text
    assert fleet(client)["replicas"] == []


@pytest.mark.parametrize("replica", ["-a", ".a", "a" * 129, "a b", "a%2Fb", "%C3%A9"])
def test_invalid_replica_ids_are_refused(client: TestClient, replica: str) -> None:
    r = put(client, replica, {"step": 1, "state": "serving"})
    assert r.status_code in (404, 422), r.text
    assert fleet(client)["replicas"] == []


def test_strict_json_and_unknown_query_parameters_are_refused(client: TestClient) -> None:
    raw = b'{"step": 1, "step": 2, "state": "serving"}'
    r = client.put("/v1/runs/r/replicas/a", content=raw, headers={**auth(SUB), "Content-Type": "application/json"})
    assert r.status_code == 422
    assert client.get("/v1/runs/r/fleet?stale=1", headers=auth(SUB)).status_code == 422
    assert client.get("/v1/runs/bad run/fleet", headers=auth(SUB)).status_code == 422


def test_a_full_fleet_refuses_new_replicas_with_429_until_one_leaves_or_ages_out(clock: Clock) -> None:
    with make(clock, max_replicas=2, max_fleet_runs=2) as c:
        body = {"step": 1, "state": "serving"}
        assert put(c, "a", body).status_code == 200
        clock.t += 20
        assert put(c, "b", body).status_code == 200
        r = put(c, "c", body)
        assert r.status_code == 429 and "max_replicas" in r.json()["detail"]
        assert put(c, "a", body).status_code == 200  # a known replica still reports
        assert c.delete("/v1/runs/r/replicas/a", headers=auth(SUB)).status_code == 204
        assert put(c, "c", body).status_code == 200
        assert put(c, "x", body, run="r2").status_code == 200
        assert put(c, "x", body, run="r3").status_code == 429  # max_fleet_runs
        clock.t += 31  # b, c and x age out
        assert put(c, "x", body, run="r3").status_code == 200
        metrics = c.get("/metrics").text
        assert "deltasync_fleet_reports_refused_total 2" in metrics
        assert "deltasync_fleet_expired_total 3" in metrics


def test_deleting_an_unknown_replica_is_404(client: TestClient) -> None:
    r = client.delete("/v1/runs/r/replicas/ghost", headers=auth(SUB))
    assert r.status_code == 404 and "ghost" in r.json()["detail"]


# --------------------------------------------------------- the view itself


def test_lag_is_behind_the_head_and_digests_are_checked_against_the_commits(client: TestClient) -> None:
    assert fleet(client) == {"run": "r", "head": None, "time": 1_000_000.0, "replicas": []}
    put(client, "early", {"step": None, "state": "starting"})
    publish(client, 3, D1)
    publish(client, 5, D2)
    put(client, "slow", {"step": 3, "state": "failed", "digest": D1, "last_error": "UpdateRolledBack: disk full"})
    put(client, "fast", {"step": 5, "state": "serving", "digest": D2})
    put(client, "odd", {"step": 5, "state": "serving", "digest": D3})
    view = fleet(client)
    assert view["head"] == 5
    rows = {r["replica"]: r for r in view["replicas"]}
    assert list(rows) == ["early", "fast", "odd", "slow"]
    assert (rows["early"]["step"], rows["early"]["lag"], rows["early"]["digest_ok"]) == (None, None, None)
    assert (rows["slow"]["lag"], rows["slow"]["state"], rows["slow"]["digest_ok"]) == (2, "failed", True)
    assert rows["slow"]["last_error"] == "UpdateRolledBack: disk full"
    assert (rows["fast"]["lag"], rows["fast"]["digest_ok"]) == (0, True)
    assert rows["odd"]["digest_ok"] is False  # not the digest this server recorded for step 5
    publish(client, 6, D3)
    assert {r["replica"]: r["lag"] for r in fleet(client)["replicas"]}["fast"] == 1  # the head moved on


def test_replicas_age_out_after_their_ttl_and_a_heartbeat_keeps_them(client: TestClient, clock: Clock) -> None:
    publish(client, 1, D1)
    put(client, "a", {"step": 1, "state": "serving"})
    put(client, "b", {"step": 1, "state": "serving", "ttl_s": 100})
    first_seen = clock.t
    clock.t += 25
    put(client, "a", {"step": 1, "state": "serving"})  # heartbeat
    clock.t += 25  # b: 50 s silent (its ttl 100), a: 25 s
    rows = {r["replica"]: r for r in fleet(client)["replicas"]}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["since"] == first_seen and rows["a"]["last_seen"] == first_seen + 25
    assert rows["a"]["age_s"] == 25 and rows["b"]["age_s"] == 50
    clock.t += 10  # a: 35 s silent > 30
    assert [r["replica"] for r in fleet(client)["replicas"]] == ["b"]
    clock.t += 51
    assert fleet(client)["replicas"] == []
    put(client, "a", {"step": 1, "state": "serving"})  # it comes back: joins again
    assert fleet(client)["replicas"][0]["since"] == clock.t


def test_runs_have_separate_fleets(client: TestClient) -> None:
    put(client, "a", {"step": 1, "state": "serving"}, run="r1")
    put(client, "a", {"step": 2, "state": "serving"}, run="r2")
    assert [r["step"] for r in fleet(client, run="r1")["replicas"]] == [1]
    assert [r["step"] for r in fleet(client, run="r2")["replicas"]] == [2]


def test_prometheus_series_count_replicas_by_state_and_the_max_lag(client: TestClient, clock: Clock) -> None:
    publish(client, 7, D1)
    put(client, "a", {"step": 7, "state": "serving"})
    put(client, "b", {"step": 4, "state": "failed"})
    put(client, "c", {"step": 2, "state": "needs_replacement"})
    put(client, "d", {"step": None, "state": "starting"})
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="r",state="serving"} 1' in text
    assert 'deltasync_fleet_replicas{run="r",state="failed"} 1' in text
    assert 'deltasync_fleet_replicas{run="r",state="needs_replacement"} 1' in text
    assert 'deltasync_fleet_replicas{run="r",state="starting"} 1' in text
    assert 'deltasync_fleet_max_lag{run="r"} 5' in text
    assert "deltasync_fleet_reports_total 4" in text
    assert "deltasync_fleet_joined_total 4" in text
    clock.t += 31
    text = client.get("/metrics").text
    assert 'deltasync_fleet_replicas{run="r"' not in text and 'deltasync_fleet_max_lag{run="r"}' not in text
