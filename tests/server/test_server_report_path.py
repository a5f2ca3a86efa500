"""The fleet report route's fast path (``deltasync.server._fleet_routes``): a heartbeat is answered
without FastAPI's dependency solving, and nothing else is. Every request below goes to two apps
with the same clock, one with the fast path and one without (``app.state.fast_reports = False``):
the status, the reply, the fleet and the metrics come out the same, whichever path answered, and
the fast path answers exactly the plain reports. The fleet routes authenticate before they look at
the body (401/403 before 413/422), as every other route of the server."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deltasync.protocol.audit import AuditReport, Divergence
from deltasync.server import Settings, _fleet_routes, create_app
from deltasync.signal import LEASE_HEADER, derive_replica_key, replica_token

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
KEY = derive_replica_key(PUB)
LIMIT = 4096
FP = "fp1-01234567-" + "".join(f"{100 * i:06x}" for i in range(8))
PLAIN = {
    "step": 3,
    "state": "serving",
    "digest": "1" * 32,
    "ttl_s": 60,
    "audit": AuditReport(3, FP, Divergence(1e-05, 0.5, 3.25)).to_dict(),
}


class Clock:
    """The servers' wall clock (fixed: both apps see the same times)."""

    def __call__(self) -> float:
        return 1_000_000.0


Headers = list[tuple[str, str]]


def auth(
    tok: str | None, lease: str | None = "lease-0123456789-0123456789", ctype: str = "application/json"
) -> Headers:
    out = [] if tok is None else [("Authorization", f"Bearer {tok}")]
    if lease is not None:
        out.append((LEASE_HEADER, lease))
    if ctype:
        out.append(("Content-Type", ctype))
    return out


def body(**changes: Any) -> bytes:
    return json.dumps({**PLAIN, **changes}).encode()


#: (name, method, url, headers, body, whether the fast path answers it): in this order, to both apps
CASES: list[tuple[str, str, str, Headers, bytes, bool]] = [
    ("plain report", "PUT", "/v1/runs/r/replicas/a", auth(SUB), body(), True),
    ("heartbeat", "PUT", "/v1/runs/r/replicas/a", auth(SUB), body(), True),
    ("no audit, no lease", "PUT", "/v1/runs/r/replicas/b", auth(SUB, None), body(audit=None), True),
    ("publish token: bound", "PUT", "/v1/runs/r/replicas/c", auth(PUB, None), body(), True),
    ("replica token: bound", "PUT", "/v1/runs/r/replicas/d-0", auth(replica_token(KEY, "r", "d"), None), body(), True),
    (
        "error escaped",
        "PUT",
        "/v1/runs/r/replicas/e",
        auth(SUB, "l-e"),
        body(state="failed", last_error="x\x1b\u202e"),
        True,
    ),
    (
        "audit could not run",
        "PUT",
        "/v1/runs/r/replicas/e",
        auth(SUB, "l-e"),
        body(audit=None, audit_error="reference damaged\x1b\u202e"),
        True,
    ),
    ("another lease: 409", "PUT", "/v1/runs/r/replicas/a", auth(SUB, "another-lease"), body(), True),
    ("shared token on a bound id: 403", "PUT", "/v1/runs/r/replicas/c", auth(SUB, None), body(), True),
    ("full run: 429", "PUT", "/v1/runs/r/replicas/f", auth(SUB, "l-f"), body(), True),
    # everything else goes through the route as declared
    ("no token", "PUT", "/v1/runs/r/replicas/a", auth(None), body(), False),
    ("wrong token", "PUT", "/v1/runs/r/replicas/a", auth("wrong-token-xyz"), body(), False),
    ("replica token of another id", "PUT", "/v1/runs/r/replicas/x", auth(replica_token(KEY, "r", "d")), body(), False),
    (
        "lowercase scheme",
        "PUT",
        "/v1/runs/s/replicas/a",
        [("Authorization", f"bearer {SUB}"), ("Content-Type", "application/json")],
        body(),
        False,
    ),
    (
        "two spaces",
        "PUT",
        "/v1/runs/s/replicas/a",
        [("Authorization", f"Bearer  {SUB}"), ("Content-Type", "application/json")],
        body(),
        False,
    ),
    ("two tokens", "PUT", "/v1/runs/s/replicas/a", [("Authorization", "Bearer x"), *auth(SUB)], body(), False),
    ("query", "PUT", "/v1/runs/s/replicas/a?x=1", auth(SUB), body(), False),
    ("charset", "PUT", "/v1/runs/s/replicas/g", auth(SUB, "l-g", "application/json; charset=utf-8"), body(), False),
    ("text/plain", "PUT", "/v1/runs/s/replicas/h", auth(SUB, "l-h", "text/plain"), body(), False),
    ("no content type", "PUT", "/v1/runs/s/replicas/i", auth(SUB, "l-i", ""), body(), False),
    ("empty lease", "PUT", "/v1/runs/s/replicas/j", auth(SUB, ""), body(), False),
    ("long lease", "PUT", "/v1/runs/s/replicas/a", auth(SUB, "l" * 257), body(), False),
    ("two leases", "PUT", "/v1/runs/s/replicas/a", [(LEASE_HEADER, "l-1"), *auth(SUB, "l-2")], body(), False),
    ("bad replica id", "PUT", "/v1/runs/s/replicas/-a", auth(SUB), body(), False),
    ("long run name", "PUT", f"/v1/runs/{'r' * 129}/replicas/a", auth(SUB), body(), False),
    ("unknown field", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(evil=1), False),
    ("bad state", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(state="fine"), False),
    (
        "bad fingerprint",
        "PUT",
        "/v1/runs/s/replicas/a",
        auth(SUB),
        body(audit={"audited_step": 1, "fingerprint": "fp1-x"}),
        False,
    ),
    ("audit_error not a text", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(audit_error=7), False),
    ("ttl out of range", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(ttl_s=0), False),
    ("step as a string", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(step="3"), False),
    ("NaN", "PUT", "/v1/runs/s/replicas/a", auth(SUB), b'{"state": "serving", "step": NaN}', False),
    ("duplicate key", "PUT", "/v1/runs/s/replicas/a", auth(SUB), b'{"state": "serving", "state": "failed"}', False),
    (
        "lone surrogate",
        "PUT",
        "/v1/runs/s/replicas/a",
        auth(SUB),
        b'{"state": "serving", "last_error": "\\ud800"}',
        False,
    ),
    ("null body", "PUT", "/v1/runs/s/replicas/a", auth(SUB), b"null", False),
    ("list body", "PUT", "/v1/runs/s/replicas/a", auth(SUB), b"[]", False),
    ("empty body", "PUT", "/v1/runs/s/replicas/a", auth(SUB), b"", False),
    ("body over the limit", "PUT", "/v1/runs/s/replicas/a", auth(SUB), body(last_error="x" * 2 * LIMIT), False),
    ("goodbye", "DELETE", "/v1/runs/r/replicas/b", auth(SUB, None, ""), b"", False),
]


def make(fast: bool) -> TestClient:
    s = Settings(publish_token=PUB, subscribe_token=SUB, max_replicas=5, max_body_bytes=LIMIT)
    app = create_app(s, clock=Clock())
    app.state.fast_reports = fast
    return TestClient(app)


@pytest.fixture
def apps() -> Iterator[tuple[TestClient, TestClient]]:
    with make(True) as fast, make(False) as declared:
        for c in (fast, declared):
            r = c.post("/v1/runs/r/commits", json={"step": 3, "manifest_digest": "1" * 32}, headers=auth(PUB))
            assert r.status_code == 201
        yield fast, declared


def test_both_paths_answer_every_request_the_same_and_the_fast_one_only_plain_reports(
    apps: tuple[TestClient, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, declared = apps
    answered_by: list[str] = []
    record = _fleet_routes._record

    async def spy(*args: Any) -> Any:
        answered_by.append(sys._getframe(1).f_code.co_name)
        return await record(*args)

    monkeypatch.setattr(_fleet_routes, "_record", spy)
    for name, method, url, headers, content, quick in CASES:
        got = []
        for c in (fast, declared):
            answered_by.clear()
            r = c.request(method, url, headers=headers, content=content)
            got.append((r.status_code, r.headers.get("content-type"), r.json() if r.content else None))
            if c is fast and quick:
                assert answered_by == ["_fast_report"], name
            else:
                assert "_fast_report" not in answered_by, name
        assert got[0] == got[1], name
        if quick:
            assert got[0][0] in (200, 403, 409, 429), (name, got[0])
    views = [c.get("/v1/runs/r/fleet", headers=auth(SUB)).json() for c in (fast, declared)]
    assert views[0] == views[1] and {x["replica"] for x in views[0]["replicas"]} == {"a", "c", "d-0", "e"}
    metrics = [c.get("/metrics").text for c in (fast, declared)]
    assert metrics[0] == metrics[1]
    assert 'deltasync_auth_failures_total{reason="missing"} 1' in metrics[0]
    assert 'deltasync_fleet_identity_refused_total{status="409"} 1' in metrics[0]
    assert "deltasync_fleet_reports_refused_total 1" in metrics[0]


HOSTILE = {
    "malformed": b"{step: 6,,}",
    "unknown field": body(evil=1),
    "NaN": b'{"state": "serving", "step": NaN}',
    "over the limit": body(last_error="x" * 2 * LIMIT),
    "empty": b"",
}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "declared"])
@pytest.mark.parametrize("method", ["PUT", "DELETE"])
@pytest.mark.parametrize("name", HOSTILE)
def test_the_fleet_routes_authenticate_before_they_look_at_the_body(fast: bool, method: str, name: str) -> None:
    with make(fast) as c:
        for tok, status in ((None, 401), ("wrong-token-xyz", 403), (replica_token(KEY, "r", "zz"), 403)):
            r = c.request(method, "/v1/runs/r/replicas/a", headers=auth(tok), content=HOSTILE[name])
            assert r.status_code == status, (tok, r.status_code, r.text[:200])
            assert r.headers["www-authenticate"].startswith("Bearer")
        if method == "PUT":
            r = c.request(method, "/v1/runs/r/replicas/a", headers=auth(SUB), content=HOSTILE[name])
            assert r.status_code == (413 if name == "over the limit" else 422), (r.status_code, r.text[:200])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "declared"])
def test_a_streamed_report_is_bounded_and_replayed_to_the_route(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    answered_by: list[str] = []
    record = _fleet_routes._record

    async def spy(*args: Any) -> Any:
        answered_by.append(sys._getframe(1).f_code.co_name)
        return await record(*args)

    monkeypatch.setattr(_fleet_routes, "_record", spy)
    plain = body()
    over = body(last_error="x" * 2 * LIMIT)
    with make(fast) as c:
        for tok, content, status in (
            (SUB, plain, 200),
            (None, plain, 401),
            (None, over, 401),
            ("wrong-token-xyz", over, 403),
            (SUB, over, 413),
            (SUB, b"{" + plain, 422),
        ):
            answered_by.clear()
            chunks = iter([content[:100], content[100:]])  # no Content-Length: streamed in two chunks
            r = c.put("/v1/runs/r/replicas/a", headers=auth(tok), content=chunks)
            assert r.status_code == status, (tok, len(content), r.status_code, r.text[:200])
            assert answered_by == (["_fast_report" if fast else "report"] if status == 200 else []), answered_by
