"""The signal server authenticates before it looks at the input (issue 23, point 7).

Every route behind a scope, sent hostile input (a NaN step, numbers past every range, wrong
types, malformed or truncated JSON, a body over the size limit, unknown or non-ASCII query
parameters, a bad run name) without a valid token, gets 401 (no token) or 403 (a wrong token,
or a token lacking the scope), never 422 or 413: a caller without a token learns nothing about
its input. With the right token the same input is still refused as before (422 / 413).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from server_harness import ThreadServer, raw_status

from deltasync.server import Settings, create_app
from deltasync.server._auth import Publish, Subscribe
from deltasync.server._routes import router

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
D1 = "1" * 32
LIMIT = 4096  # the app's body limit here

HOSTILE_BODIES: dict[str, bytes] = {
    "nan step": b'{"step": NaN, "manifest_digest": "%s"}' % D1.encode(),
    "infinity step": b'{"step": Infinity, "manifest_digest": "%s"}' % D1.encode(),
    "overflowing float": b'{"step": 1e400, "manifest_digest": "%s"}' % D1.encode(),
    "huge int": b'{"step": 1%s, "manifest_digest": "%s"}' % (b"0" * 2000, D1.encode()),
    "body over the limit": b'{"step": 1, "manifest_digest": "%s", "run_id": "%s"}' % (D1.encode(), b"x" * 2 * LIMIT),
    "step as a string": b'{"step": "6", "manifest_digest": "%s"}' % D1.encode(),
    "wrong types": b'{"step": [1], "manifest_digest": 7, "url": {}, "secret": null}',
    "unknown field": b'{"step": 1, "manifest_digest": "%s", "evil": 1}' % D1.encode(),
    "duplicate key": b'{"step": 6, "step": 7, "manifest_digest": "%s"}' % D1.encode(),
    "lone surrogate": b'{"step": 6, "manifest_digest": "\\ud800"}',
    "not UTF-8": b'{"step": 6, "manifest_digest": "\xff\xfe"}',
    "truncated": b'{"step": 6, "manifest_dig',
    "malformed": b"{step: 6,,}",
    "deep nesting": b"[" * 3000 + b"]" * 3000,
    "empty": b"",
}

HOSTILE_QUERIES = ["", "?afer=1", "?after=NaN&timeout=inf", "?after=%C2%B2", "?limit=-5&heartbeat=0"]


def _routes() -> list[tuple[str, str, str]]:
    """(method, path template, scope) of every route of the server that needs a token."""
    found = []
    for route in router.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith("/v1/"):
            continue
        scopes = [s for s, dep in (("publish", Publish), ("subscribe", Subscribe)) if dep in route.dependencies]
        assert len(scopes) == 1, f"{route.path} needs exactly one auth dependency, has {scopes}"
        found += [(method, route.path, scopes[0]) for method in sorted(route.methods)]
    return found


ROUTES = _routes()


def test_the_route_list_is_complete() -> None:
    # a new route is checked here without anyone adding it by hand
    got = {(m, p) for m, p, _ in ROUTES}
    assert got == {
        ("POST", "/v1/runs/{run}/commits"),
        ("GET", "/v1/runs/{run}/commits"),
        ("POST", "/v1/runs/{run}/rederive"),
        ("GET", "/v1/runs/{run}/head"),
        ("GET", "/v1/runs/{run}/wait"),
        ("GET", "/v1/runs/{run}/events"),
        ("POST", "/v1/runs/{run}/webhooks"),
        ("GET", "/v1/runs/{run}/webhooks"),
        ("DELETE", "/v1/runs/{run}/webhooks/{hook_id}"),
    }
    assert {p for m, p, s in ROUTES if s == "subscribe"} == {
        "/v1/runs/{run}/commits",
        "/v1/runs/{run}/head",
        "/v1/runs/{run}/wait",
        "/v1/runs/{run}/events",
    } and ("POST", "/v1/runs/{run}/commits", "publish") in ROUTES


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = tmp_path_factory.mktemp("authfirst") / "s.db"
    s = Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(db), max_wait_s=0.05, max_body_bytes=LIMIT)
    with TestClient(create_app(s)) as c:
        yield c


def _url(path: str, run: str, query: str) -> str:
    return path.replace("{run}", run).replace("{hook_id}", "0123456789abcdef") + query


def _refusals(scope: str) -> list[tuple[dict[str, str], int]]:
    """(headers, the status every hostile request with them must get) for a route of ``scope``."""
    out = [
        ({}, 401),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": "Bearer wrong-token-xyz"}, 403),
    ]
    if scope == "publish":
        out.append(({"Authorization": f"Bearer {SUB}"}, 403))  # a token lacking the scope
    return out


@pytest.mark.parametrize(("method", "path", "scope"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("name", HOSTILE_BODIES)
def test_unauthenticated_hostile_bodies_get_401_or_403(
    client: TestClient, method: str, path: str, scope: str, name: str
) -> None:
    body = HOSTILE_BODIES[name]
    for headers, status in _refusals(scope):
        for ctype in ("application/json", "text/plain"):
            r = client.request(method, _url(path, "r", ""), content=body, headers={**headers, "Content-Type": ctype})
            assert r.status_code == status, (headers, ctype, r.status_code, r.text[:200])
            assert r.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(("method", "path", "scope"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("query", HOSTILE_QUERIES)
@pytest.mark.parametrize("run", ["r", "bad run name", "x" * 300])
def test_unauthenticated_hostile_queries_and_paths_get_401_or_403(
    client: TestClient, method: str, path: str, scope: str, query: str, run: str
) -> None:
    for headers, status in _refusals(scope):
        r = client.request(method, _url(path, run, query), content=HOSTILE_BODIES["nan step"], headers=headers)
        assert r.status_code == status, (headers, r.status_code, r.text[:200])


def test_authenticated_hostile_input_is_still_refused(client: TestClient) -> None:
    pub = {"Authorization": f"Bearer {PUB}", "Content-Type": "application/json"}
    r = client.post("/v1/runs/r/commits", content=HOSTILE_BODIES["nan step"], headers=pub)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid", r.text
    assert "NaN" in r.json()["detail"][0]["ctx"]["error"]
    r = client.post("/v1/runs/r/commits", content=HOSTILE_BODIES["wrong types"], headers=pub)
    assert r.status_code == 422
    assert client.post(
        "/v1/runs/r/commits", content=HOSTILE_BODIES["body over the limit"], headers=pub
    ).status_code == (413)
    sub = {"Authorization": f"Bearer {SUB}"}
    assert client.get("/v1/runs/r/commits?afer=1", headers=sub).status_code == 422
    assert client.get("/v1/runs/bad run/head", headers=sub).status_code == 422
    # the refused requests changed nothing, and good ones still pass
    assert client.post("/v1/runs/r/commits", json={"step": 3, "manifest_digest": D1}, headers=pub).status_code == 201
    assert client.get("/v1/runs/r/head", headers=sub).json()["step"] == 3


def _auth_failures(c: TestClient) -> float:
    lines = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("deltasync_auth_failures_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_refusals_are_counted_as_auth_failures(client: TestClient) -> None:
    before = _auth_failures(client)
    nan = HOSTILE_BODIES["nan step"]
    assert (
        client.post("/v1/runs/r/commits", content=nan, headers={"Content-Type": "application/json"}).status_code == 401
    )
    assert _auth_failures(client) == before + 1


@pytest.fixture(scope="module")
def live_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    db = tmp_path_factory.mktemp("authfirst-live") / "s.db"
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(db), max_body_bytes=LIMIT))
    with ThreadServer(app) as srv:
        yield srv.port


@pytest.mark.parametrize("name", ["nan step", "huge int", "body over the limit", "malformed"])
def test_live_server_authenticates_first(live_port: int, name: str) -> None:
    # raw HTTP/1.1 through uvicorn: a declared Content-Length over the limit is not answered
    # before the token is checked
    body = HOSTILE_BODIES[name]
    head = [b"POST /v1/runs/r/commits HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]

    def status(*extra: bytes) -> int:
        return raw_status(live_port, b"\r\n".join([*head, *extra]) + b"\r\n\r\n" + body)

    assert status() == 401
    assert status(b"Authorization: Bearer " + SUB.encode()) == 403
    assert status(b"Authorization: Bearer " + PUB.encode()) == (413 if name == "body over the limit" else 422)
    assert raw_status(live_port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n") == 200


def test_streamed_body_over_the_limit_without_a_token_is_401(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts streamed bytes
        yield b'{"step": 1, "manifest_digest": "' + D1.encode() + b'", "run_id": "'
        for _ in range(20):
            yield b"y" * 1000
        yield b'"}'

    ctype = {"Content-Type": "application/json"}
    assert client.post("/v1/runs/r/commits", content=chunks(), headers=ctype).status_code == 401
    sub = {**ctype, "Authorization": f"Bearer {SUB}"}
    assert client.post("/v1/runs/r/commits", content=chunks(), headers=sub).status_code == 403
    pub = {**ctype, "Authorization": f"Bearer {PUB}"}
    assert client.post("/v1/runs/r/commits", content=chunks(), headers=pub).status_code == 413


def test_a_cut_body_never_gets_another_answer() -> None:
    # an app that ignores body_cut() and answers 200 with what it read: the middleware replaces it
    # (401/403/404/405 pass, as they say nothing about the body)
    from starlette.requests import Request
    from starlette.responses import Response

    from deltasync.server._limits import body_cut, limit_body

    seen: list[tuple[bytes, int | None]] = []

    async def careless(scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        body = await request.body()
        seen.append((body, body_cut(scope)))
        status = int(request.query_params.get("status", "200"))
        await Response(b"took it", status_code=status)(scope, receive, send)

    c = TestClient(limit_body(careless, 100))  # not entered: the bare app has no lifespan
    r = c.post("/", content=b"x" * 101)
    assert (r.status_code, r.json()) == (413, {"detail": "request body exceeds 100 bytes"})
    assert seen[-1] == (b"", 100)  # a declared length over the limit: nothing of the body was read
    assert c.post("/?status=401", content=b"x" * 101).status_code == 401
    assert c.post("/?status=422", content=b"x" * 101).status_code == 413
    r = c.post("/", content=iter([b"a" * 60, b"b" * 60, b"c" * 60]))  # streamed: cut before the chunk crossing it
    assert r.status_code == 413 and len(seen[-1][0]) <= 100 and seen[-1][1] == 100
    r = c.post("/", content=b"x" * 100)  # at the limit: untouched
    assert (r.status_code, r.content, seen[-1]) == (200, b"took it", (b"x" * 100, None))
