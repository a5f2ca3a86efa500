"""Signal server through FastAPI's TestClient: auth, publish rules, store checks, limits, webhooks, persistence."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from deltasync.errors import SignalConflict, SignalRejected, SignalUnavailable, WebhookVerificationError
from deltasync.protocol import xxh3_128
from deltasync.server import Settings, SignalClient, WebhookVerifier, create_app, sign_webhook, verify_webhook
from deltasync.server.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER
from deltasync.storage import MemoryStore

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
D1, D2, D3 = "1" * 32, "2" * 32, "3" * 32
WAIT = 10.0


def auth(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(tmp_path / "s.db"), max_wait_s=2))
    with TestClient(app) as c:
        yield c


class ViaTestClient(httpx.BaseTransport):
    """An httpx transport that sends through a TestClient (the app's own event loop)."""

    def __init__(self, tc: TestClient) -> None:
        self.tc = tc

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.tc.request(request.method, str(request.url), headers=request.headers, content=request.read())
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


def publish(c: TestClient, step: int, digest: str, run: str = "r", tok: str = PUB) -> httpx.Response:
    return c.post(f"/v1/runs/{run}/commits", json={"step": step, "manifest_digest": digest}, headers=auth(tok))


# ------------------------------------------------------------------ auth


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/runs/r/commits", {"step": 1, "manifest_digest": D1}),
        ("POST", "/v1/runs/r/webhooks", {"url": "http://127.0.0.1:9/x", "secret": "s" * 16}),
        ("GET", "/v1/runs/r/webhooks", None),
        ("POST", "/v1/runs/r/rederive", None),
    ],
)
def test_publish_routes_need_the_publish_token(client: TestClient, method: str, path: str, body: Any) -> None:
    r = client.request(method, path, json=body)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    for bad in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer "):
        assert client.request(method, path, json=body, headers={"Authorization": bad}).status_code == 401
    assert client.request(method, path, json=body, headers=auth("wrong-token-xyz")).status_code == 403
    # the subscribe token does not grant publishing
    assert client.request(method, path, json=body, headers=auth(SUB)).status_code == 403
    assert client.request(method, path, json=body, headers=auth(PUB)).status_code not in (401, 403)


@pytest.mark.parametrize(
    "path", ["/v1/runs/r/head", "/v1/runs/r/wait?after=5&timeout=0", "/v1/runs/r/events?limit=1", "/v1/runs/r/commits"]
)
def test_subscribe_routes_take_either_token(client: TestClient, path: str) -> None:
    publish(client, 3, D1)
    assert client.get(path).status_code == 401
    assert client.get(path, headers=auth("nope-nope-nope")).status_code == 403
    assert client.get(path, headers=auth(SUB)).status_code in (200, 204)
    assert client.get(path, headers=auth(PUB)).status_code in (200, 204)


def test_open_server_without_tokens(tmp_path: Path) -> None:
    with TestClient(create_app(Settings())) as c:
        assert c.post("/v1/runs/r/commits", json={"step": 0, "manifest_digest": D1}).status_code == 201
        assert c.get("/v1/runs/r/head").json()["step"] == 0


def test_healthz_and_metrics_are_open(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    publish(client, 1, D1)
    client.get("/v1/runs/r/head")
    text = client.get("/metrics").text
    assert 'deltasync_commits_total{source="publish"} 1' in text
    assert 'deltasync_head_step{run="r"} 1' in text
    assert 'deltasync_auth_failures_total{reason="missing"} 1' in text
    assert "# TYPE deltasync_sse_subscribers gauge" in text


def test_settings_reject_weak_tokens_and_read_env() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        Settings(publish_token="short")
    s = Settings.from_env({"DELTASYNC_PUBLISH_TOKEN": PUB, "DELTASYNC_SUBSCRIBE_TOKEN": SUB}, db_path="x.db")
    assert (s.publish_token, s.subscribe_token, s.db_path) == (PUB, SUB, "x.db")
    assert Settings.from_env({}).secured is False


# ---------------------------------------------------------------- publish


def test_publish_is_idempotent_and_monotonic(client: TestClient) -> None:
    r = publish(client, 5, D1)
    assert r.status_code == 201 and r.json()["step"] == 5
    assert publish(client, 5, D1).status_code == 200  # a retry of the same commit
    r = publish(client, 5, D2)
    assert r.status_code == 409 and "already published" in r.json()["detail"]
    r = publish(client, 4, D2)
    assert r.status_code == 409 and "older than" in r.json()["detail"]
    assert publish(client, 7, D3).status_code == 201
    assert publish(client, 5, D1).status_code == 200  # a late retry of a recorded older step is still fine
    assert client.get("/v1/runs/r/head", headers=auth(SUB)).json()["step"] == 7
    # runs are independent
    assert publish(client, 1, D1, run="other").status_code == 201
    got = client.get("/v1/runs/r/commits", params={"after": -1}, headers=auth(SUB)).json()
    assert [c["step"] for c in got] == [5, 7]


@pytest.mark.parametrize(
    "body",
    [
        {"step": -1, "manifest_digest": D1},
        {"step": 10**12, "manifest_digest": D1},
        {"step": "1", "manifest_digest": D1},
        {"step": 1.5, "manifest_digest": D1},
        {"step": 1, "manifest_digest": "A" * 32},
        {"step": 1, "manifest_digest": "1" * 31},
        {"step": 1},
        {"step": 1, "manifest_digest": D1, "extra": 1},
        {"step": 1, "manifest_digest": D1, "kind": "full"},
        [1, 2],
    ],
)
def test_publish_rejects_malformed_bodies(client: TestClient, body: Any) -> None:
    assert publish(client, 0, D1).status_code == 201
    assert client.post("/v1/runs/r/commits", json=body, headers=auth(PUB)).status_code == 422
    assert client.get("/v1/runs/r/head", headers=auth(SUB)).json()["step"] == 0  # nothing lost


@pytest.mark.parametrize("run", ["-x", ".hidden", "a" * 129, "a b", "ä"])
def test_bad_run_names(client: TestClient, run: str) -> None:
    assert publish(client, 0, D1, run=run).status_code in (404, 422)


def test_body_size_limit(client: TestClient) -> None:
    big = json.dumps({"step": 1, "manifest_digest": D1, "run_id": "x" * 20000}).encode()
    r = client.post("/v1/runs/r/commits", content=big, headers={**auth(PUB), "Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts streamed bytes
        yield b'{"step": 1, "manifest_digest": "' + D1.encode() + b'", "run_id": "'
        for _ in range(40):
            yield b"y" * 1000
        yield b'"}'

    r = client.post("/v1/runs/r/commits", content=chunks(), headers={**auth(PUB), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert client.get("/v1/runs/r/head", headers=auth(SUB)).status_code == 404


# ------------------------------------------------------------ store checks


def _commit_to(store: MemoryStore, step: int, run_id: str = "run-a") -> str:
    """Write a minimal committed step (a real manifest) and return its digest."""
    from deltasync.protocol import Manifest, Stats, inventory_digest, manifest_key

    m = Manifest(
        run_id=run_id,
        step=step,
        kind="anchor",
        parent_step=None,
        parent_digest=None,
        anchor_step=step,
        inventory=(),
        inventory_digest=inventory_digest(()),
        files=(),
        entries=(),
        tensor_digests={},
        stats=Stats(0, 0, 0),
    )
    body = m.to_json()
    store.put(manifest_key(step), body)
    return xxh3_128(body)


def test_store_checks_published_steps_and_derives_heads(tmp_path: Path) -> None:
    store = MemoryStore("signal")
    d3 = _commit_to(store, 3)
    app = create_app(Settings(publish_token=PUB, db_path=str(tmp_path / "s.db")), store=store)
    with TestClient(app) as c:
        # the head of a run the server never heard of comes from the store
        assert c.get("/v1/runs/r/head").json() == {**c.get("/v1/runs/r/head").json(), "step": 3, "manifest_digest": d3}
        r = publish(c, 5, D1)
        assert r.status_code == 422 and "not committed" in r.json()["detail"][0]["msg"]
        d5 = _commit_to(store, 5)
        r = publish(c, 5, D1)
        assert r.status_code == 409 and d5 in r.json()["detail"]
        assert publish(c, 5, d5).status_code == 201
        d9 = _commit_to(store, 9)  # committed while the signal was lost
        r = c.post("/v1/runs/r/rederive", headers=auth(PUB))
        assert r.json()["step"] == 9 and r.json()["manifest_digest"] == d9
        assert 'reason="not_in_store"' in c.get("/metrics").text


def test_publish_is_503_while_the_store_cannot_be_read(tmp_path: Path) -> None:
    from deltasync.errors import StorageError

    class Flaky(MemoryStore):
        down = True

        def get_many(self, keys: Any) -> dict[str, bytes]:
            if self.down:
                raise StorageError("connection reset")
            return super().get_many(keys)

    store = Flaky("flaky")
    d1 = _commit_to(store, 1)
    with TestClient(create_app(Settings(publish_token=PUB), store=store)) as c:
        r = publish(c, 1, d1)
        assert r.status_code == 503 and "cannot read" in r.json()["detail"]
        store.down = False
        assert publish(c, 1, d1).status_code == 201


def test_rederive_without_store_is_404(client: TestClient) -> None:
    assert client.post("/v1/runs/r/rederive", headers=auth(PUB)).status_code == 404


# -------------------------------------------------------- wait and events


def test_wait_long_polls(client: TestClient) -> None:
    t0 = time.monotonic()
    r = client.get("/v1/runs/r/wait", params={"after": -1, "timeout": 0.3}, headers=auth(SUB))
    assert r.status_code == 204 and time.monotonic() - t0 >= 0.25
    publish(client, 2, D1)
    r = client.get("/v1/runs/r/wait", params={"after": 1, "timeout": 5}, headers=auth(SUB))
    assert r.status_code == 200 and r.json()["step"] == 2
    # a waiter is released by a commit that arrives while it waits
    got: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: got.append(client.get("/v1/runs/r/wait", params={"after": 2, "timeout": 2}, headers=auth(SUB)))
    )
    t.start()
    time.sleep(0.3)  # let the waiter park (the assertion below does not depend on it)
    publish(client, 3, D2)
    t.join(WAIT)
    assert got and got[0].status_code == 200 and got[0].json()["step"] == 3


def _sse_events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields.get("event") == "commit":
            out.append({"id": int(fields["id"]), **json.loads(fields["data"])})
    return out


def test_events_replay_after_last_event_id(client: TestClient) -> None:
    for step, d in ((1, D1), (2, D2), (3, D3)):
        publish(client, step, d)
    r = client.get("/v1/runs/r/events", params={"limit": 2}, headers={**auth(SUB), "Last-Event-ID": "1"})
    assert r.headers["content-type"].startswith("text/event-stream")
    ev = _sse_events(r.text)
    assert [(e["id"], e["step"], e["manifest_digest"]) for e in ev] == [(2, 2, D2), (3, 3, D3)]
    # without Last-Event-ID the stream starts at the current head
    r = client.get("/v1/runs/r/events", params={"limit": 1}, headers=auth(SUB))
    assert [e["step"] for e in _sse_events(r.text)] == [3]
    r = client.get("/v1/runs/r/events", params={"limit": 1}, headers={**auth(SUB), "Last-Event-ID": "x"})
    assert r.status_code == 422


# -------------------------------------------------------------- webhooks


def test_webhook_signature_roundtrip_forgery_and_replay() -> None:
    secret = "a-webhook-secret-123"
    body = json.dumps({"event": "commit", "delivery": "d1", "step": 4}).encode()
    now = 1_800_000_000
    headers = sign_webhook(secret, body, timestamp=now)
    mac = hmac.new(secret.encode(), f"{now}.".encode() + body, hashlib.sha256).hexdigest()
    assert headers == {TIMESTAMP_HEADER: str(now), SIGNATURE_HEADER: f"v1={mac}"}
    assert verify_webhook(secret, headers, body, now=now + 10)["step"] == 4
    lower = {k.lower(): v for k, v in headers.items()}
    assert verify_webhook(secret, lower, body, now=now)["step"] == 4  # header names are case-insensitive
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_webhook("another-secret-xyz", headers, body, now=now)
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_webhook(secret, headers, body.replace(b"4", b"5"), now=now)
    forged = {**headers, TIMESTAMP_HEADER: str(now + 5)}  # fresh timestamp on an old signature
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify_webhook(secret, forged, body, now=now + 5)
    with pytest.raises(WebhookVerificationError, match="replay window"):
        verify_webhook(secret, headers, body, now=now + 301)
    with pytest.raises(WebhookVerificationError, match="replay window"):
        verify_webhook(secret, headers, body, now=now - 301)
    with pytest.raises(WebhookVerificationError, match="lacks"):
        verify_webhook(secret, {TIMESTAMP_HEADER: str(now)}, body, now=now)
    with pytest.raises(WebhookVerificationError, match="malformed"):
        verify_webhook(secret, {**headers, TIMESTAMP_HEADER: "soon"}, body, now=now)
    verifier = WebhookVerifier(secret, clock=lambda: now + 1)
    assert verifier.verify(headers, body)["delivery"] == "d1"
    with pytest.raises(WebhookVerificationError, match="already accepted"):
        verifier.verify(headers, body)  # replayed inside the window


def test_webhooks_are_delivered_signed_and_retried(tmp_path: Path) -> None:
    secret = "receiver-secret-123456"
    verifier = WebhookVerifier(secret)
    attempts: list[httpx.Request] = []
    got: list[dict[str, Any]] = []
    done = threading.Event()

    def receiver(request: httpx.Request) -> httpx.Response:
        attempts.append(request)
        if len(attempts) < 3:
            return httpx.Response(503)  # retried with backoff
        got.append(verifier.verify(request.headers, request.content))
        done.set()
        return httpx.Response(204)

    settings = Settings(publish_token=PUB, db_path=str(tmp_path / "s.db"), webhook_backoff_s=0.01)
    app = create_app(settings, webhook_transport=httpx.MockTransport(receiver))
    with TestClient(app) as c:
        r = c.post("/v1/runs/r/webhooks", json={"url": "http://hooks.invalid/in", "secret": secret}, headers=auth(PUB))
        assert r.status_code == 201 and "secret" not in r.json()
        hook_id = r.json()["id"]
        assert [w["id"] for w in c.get("/v1/runs/r/webhooks", headers=auth(PUB)).json()] == [hook_id]
        assert publish(c, 8, D1).status_code == 201
        assert done.wait(WAIT)
        assert got[0]["step"] == 8 and got[0]["manifest_digest"] == D1 and got[0]["run"] == "r"
        assert len({a.headers[DELIVERY_HEADER] for a in attempts}) == 1  # one delivery, three attempts
        assert 'deltasync_webhook_deliveries_total{outcome="ok"} 1' in c.get("/metrics").text
        assert c.delete(f"/v1/runs/r/webhooks/{hook_id}", headers=auth(PUB)).status_code == 204
        assert c.delete(f"/v1/runs/r/webhooks/{hook_id}", headers=auth(PUB)).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"url": "ftp://x/y", "secret": "s" * 16},
        {"url": "file:///etc/passwd", "secret": "s" * 16},
        {"url": "http://x/y", "secret": "short"},
        {"url": "not a url", "secret": "s" * 16},
    ],
)
def test_webhook_registration_validates(client: TestClient, body: dict[str, str]) -> None:
    assert client.post("/v1/runs/r/webhooks", json=body, headers=auth(PUB)).status_code == 422


# ------------------------------------------------------------ persistence


def test_restart_keeps_heads_history_and_webhooks(tmp_path: Path) -> None:
    settings = Settings(publish_token=PUB, db_path=str(tmp_path / "s.db"))
    with TestClient(create_app(settings)) as c:
        publish(c, 1, D1)
        publish(c, 2, D2)
        c.post("/v1/runs/r/webhooks", json={"url": "http://127.0.0.1:9/h", "secret": "s" * 16}, headers=auth(PUB))
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/runs/r/head").json()["manifest_digest"] == D2
        assert len(c.get("/v1/runs/r/webhooks", headers=auth(PUB)).json()) == 1
        assert publish(c, 2, D3).status_code == 409  # the history survived too
        assert publish(c, 1, D1).status_code == 200


def test_history_is_pruned(tmp_path: Path) -> None:
    with TestClient(create_app(Settings(history=3))) as c:
        for s in range(6):
            c.post("/v1/runs/r/commits", json={"step": s, "manifest_digest": D1})
        assert [x["step"] for x in c.get("/v1/runs/r/commits", params={"after": -1}).json()] == [3, 4, 5]


# ---------------------------------------------------------------- client


def test_client_maps_errors(tmp_path: Path) -> None:
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB))
    with TestClient(app) as tc:
        transport = ViaTestClient(tc)
        pub = SignalClient("http://testserver", PUB, transport=transport)
        assert pub.head("r") is None
        ev = pub.publish("r", 4, D1, run_id="abc", kind="patch")
        assert (ev.step, ev.manifest_digest, ev.run_id, ev.kind) == (4, D1, "abc", "patch")
        assert pub.wait("r", after=3, timeout=1).step == 4  # type: ignore[union-attr]
        with pytest.raises(SignalConflict, match="409"):
            pub.publish("r", 3, D2)
        with pytest.raises(SignalRejected, match="403"):
            SignalClient("http://testserver", SUB, transport=transport).publish("r", 5, D1)
        with pytest.raises(SignalRejected, match="401"):
            SignalClient("http://testserver", transport=transport).head("r")
        with pytest.raises(SignalRejected, match="invalid run name"):
            pub.head("../etc")

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(SignalUnavailable, match="unreachable"):
        SignalClient("http://127.0.0.1:9", transport=httpx.MockTransport(down)).head("r")
    with pytest.raises(SignalUnavailable, match="HTTP 502"):
        SignalClient("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(502))).head("r")
    with pytest.raises(SignalRejected, match="http"):
        SignalClient("ftp://x")


def test_notifier_counts_refusals(tmp_path: Path) -> None:
    from deltasync.server import Notifier

    with TestClient(create_app(Settings(publish_token=PUB))) as tc:
        n = Notifier("http://testserver", "r", PUB, transport=ViaTestClient(tc))
        n.notify(5, D1, kind="anchor")
        assert n.flush(WAIT)
        n.notify(3, D2)  # older than the head: 409, not retried
        assert n.flush(WAIT)
        n.close()
        assert (n.sent, n.rejected, n.failed) == (1, 1, 0)
        assert tc.get("/v1/runs/r/head").json()["kind"] == "anchor"
        bad = Notifier("http://testserver", "r", "wrong-token-123", transport=ViaTestClient(tc))
        bad.notify(6, D1)
        bad.close()
        assert (bad.sent, bad.rejected) == (0, 1)  # 403 is counted, never raised


def test_follow_refuses_a_foreign_directory(tmp_path: Path) -> None:
    from deltasync import DeltaFetcher
    from deltasync.errors import StorageError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(StorageError, match="refusing to follow"):
        DeltaFetcher(MemoryStore("x")).follow(out, until_step=0)
    assert (out / "precious.txt").read_text() == "keep me"


def test_unknown_query_parameters_are_refused(client: TestClient) -> None:
    r = client.get("/v1/runs/r/wait", params={"afer": 3, "timeout": 0}, headers=auth(SUB))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "afer"]
    assert client.get("/v1/runs/r/wait", params={"after": 3, "timeout": 0}, headers=auth(SUB)).status_code == 204


class FakeClock(threading.Event):
    """A ``stop`` Event for follow() that is also its clock: each ``wait(t)`` advances ``now`` by ``t``
    at once (recorded in ``waits``); the Event sets itself after ``ticks`` waits."""

    def __init__(self, ticks: int) -> None:
        super().__init__()
        self.now = 1000.0
        self.ticks = ticks
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None and timeout > 0, "follow() must never wait unbounded or spin"
        self.waits.append(timeout)
        self.now += timeout
        if len(self.waits) >= self.ticks:
            self.set()
        return self.is_set()


def test_follow_with_an_unreachable_server_polls_at_its_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync import DeltaFetcher
    from deltasync.fetcher import _follow
    from deltasync.fetcher._follow import FollowStats

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    clock = FakeClock(ticks=6)
    monkeypatch.setattr(_follow, "time", clock)  # follow()'s monotonic() is the fake clock's
    stats = FollowStats()
    got = DeltaFetcher(MemoryStore("empty")).follow(
        {},
        signal_url="http://127.0.0.1:9",
        stop=clock,
        poll_interval=0.1,
        reconnect_backoff=(0.05, 0.2),
        transport=httpx.MockTransport(down),
        stats=stats,
    )
    assert got is None  # an empty run: nothing to apply, no error
    # paced by poll_interval, not a busy loop: one store poll per wait of poll_interval (plus the first)
    assert clock.waits == [0.1] * 6 and stats.polls == 7
    # with a run name the stream is tried (and fails) with backoff, polling in between
    clock = FakeClock(ticks=8)
    monkeypatch.setattr(_follow, "time", clock)
    stats = FollowStats()
    DeltaFetcher(MemoryStore("empty")).follow(
        {},
        signal_url="http://127.0.0.1:9",
        run="r",
        stop=clock,
        poll_interval=0.1,
        reconnect_backoff=(0.05, 0.2),
        transport=httpx.MockTransport(down),
        stats=stats,
    )
    assert stats.polls == len(clock.waits) + 1 == 9  # the store is polled between reconnects
    assert all(0 < w <= 0.1 for w in clock.waits)  # never longer than poll_interval, never a spin
    # reconnects back off (0.05, 0.1, 0.2, 0.2 ... of fake time), so they get rarer than the polls
    assert 2 <= stats.signal_failures < stats.polls


def test_follow_with_a_refused_token_warns_once_with_the_fix_then_stays_quiet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong subscribe token is refused at every reconnect: one warning naming the fix, then DEBUG only
    while the refusals go on (the store is still polled); once the server accepts, one line says so, and
    a later refusal warns again. Driven by the fake clock: no sleeping, no wall-clock asserts."""
    import logging

    from deltasync import DeltaFetcher
    from deltasync.fetcher import _follow
    from deltasync.fetcher._follow import FollowStats

    accept_after = 6  # the first 6 stream requests are refused (403), the 7th accepted, then refused again
    asked: list[str | None] = []

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("authorization"))
        if len(asked) == accept_after + 1:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b": hb\n\n")
        return httpx.Response(403, json={"detail": "the bearer token does not grant scope 'subscribe'"})

    clock = FakeClock(ticks=40)
    monkeypatch.setattr(_follow, "time", clock)
    stats = FollowStats()
    with caplog.at_level(logging.DEBUG, logger="deltasync.follow"):
        DeltaFetcher(MemoryStore("empty")).follow(
            {},
            signal_url="http://signal.test",
            token="wrong-token",
            run="r",
            stop=clock,
            poll_interval=0.1,
            reconnect_backoff=(0.05, 0.2),
            transport=httpx.MockTransport(server),
            stats=stats,
        )
    assert len(asked) > accept_after + 2 and set(asked) == {"Bearer wrong-token"}
    assert stats.signal_failures == len(asked)  # every refusal counted (metrics see them all), and the stream's end
    records = [r for r in caplog.records if r.name == "deltasync.follow"]
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    expected = [
        "signal server refused the stream; following by polling the store every 0.1 s",  # once, with the fix
        "signal server accepts the stream now: following its signals",
        "signal stream lost, polling the store meanwhile: ",  # the accepted stream ended
        "signal server refused the stream; following by polling",  # refused again after it had been accepted
    ]
    assert len(warnings) == len(expected) and all(w.startswith(e) for w, e in zip(warnings, expected, strict=True)), (
        warnings
    )
    assert "set DELTASYNC_SUBSCRIBE_TOKEN to the server's subscribe token" in warnings[0]
    quiet = [r for r in records if r.levelno == logging.DEBUG and "still refuses the stream" in r.getMessage()]
    assert len(quiet) == stats.signal_failures - 3  # the repeats, at DEBUG only
    assert stats.polls > len(asked)  # the store was polled all along


# ------------------------------------------------------ dependency overrides


def test_routes_take_state_through_overridable_dependencies(tmp_path: Path) -> None:
    from deltasync.server._db import Commit
    from deltasync.server._deps import get_relay, get_settings

    app = create_app(Settings(publish_token=PUB, db_path=str(tmp_path / "s.db")))
    with TestClient(app) as c:
        assert publish(c, 1, D1).status_code == 201
        # another token, swapped in without rebuilding the app: the auth dependency reads it
        app.dependency_overrides[get_settings] = lambda: Settings(publish_token="rotated-token-456")
        assert publish(c, 2, D2).status_code == 403
        assert publish(c, 2, D2, tok="rotated-token-456").status_code == 201

        class StubRelay:
            async def head_or_derive(self, run: str) -> Commit | None:
                return Commit(run, 42, D3, "stub", "anchor", 0.0)

        app.dependency_overrides[get_relay] = StubRelay
        got = c.get("/v1/runs/anything/head").json()
        assert (got["run"], got["step"], got["manifest_digest"], got["run_id"]) == ("anything", 42, D3, "stub")
        app.dependency_overrides.clear()
        assert c.get("/v1/runs/r/head").json()["step"] == 2  # the real relay again


# ------------------------------------------------------------- run reader


def test_store_checks_read_each_manifest_once_through_one_run_reader(tmp_path: Path) -> None:
    from deltasync.testing.counting import CountingStore

    store = CountingStore(MemoryStore("counted"))
    d3 = _commit_to(store.inner, 3)  # type: ignore[arg-type]
    app = create_app(Settings(publish_token=PUB, db_path=str(tmp_path / "s.db")), store=store)
    with TestClient(app) as c:
        assert publish(c, 3, D1, run="a").status_code == 409
        read = store.objects_read
        assert read >= 1
        # a digest the cache refuses is checked once more against the store (was it rewritten?)
        assert publish(c, 3, D2, run="a").status_code == 409
        assert store.objects_read == read + 1
        assert publish(c, 3, d3, run="b").status_code == 201  # another run on the same store: same reader
        assert store.objects_read == read + 1  # an accepted digest comes from the cache
        relay = app.state.relay
        assert relay.reader("a") is relay.reader("b")


def test_a_store_emptied_and_written_again_under_the_server_is_read_afresh(tmp_path: Path) -> None:
    # what `deltasync demo --loop` does under its signal server: the same steps, other content,
    # published under a new run name (demo-0, demo-1, ...)
    store = MemoryStore("loop")
    old = {s: _commit_to(store, s, run_id="run-a") for s in range(3)}
    with TestClient(create_app(Settings(publish_token=PUB, db_path=str(tmp_path / "s.db")), store=store)) as c:
        for s in range(3):
            assert publish(c, s, old[s], run="demo-0").status_code == 201
        store.delete_many([o.key for o in store.list("")])
        new = {s: _commit_to(store, s, run_id="run-b") for s in range(2)}
        assert new[0] != old[0] and new[1] != old[1]
        # the server's reader cached step 0 of the first run; the new run's digest is the store's now
        assert publish(c, 0, new[0], run="demo-1").status_code == 201
        # a digest that is not the store's current manifest is still refused, naming the right one
        r = publish(c, 1, old[1], run="demo-1")
        assert r.status_code == 409 and new[1] in r.json()["detail"]
        r = publish(c, 1, D1, run="demo-1")
        assert r.status_code == 409 and new[1] in r.json()["detail"]
        assert publish(c, 1, new[1], run="demo-1").status_code == 201

        # emptied again: the head of a run the server never heard of is derived from the store as it
        # is now (step 0 of a third run), not from the steps the reader cached before
        store.delete_many([o.key for o in store.list("")])
        d0 = _commit_to(store, 0, run_id="run-c")
        got = c.get("/v1/runs/demo-2/head").json()
        assert (got["step"], got["manifest_digest"], got["run_id"]) == (0, d0, "run-c")
        assert publish(c, 0, d0, run="demo-2").status_code == 200  # the derived head, published again
        d1 = _commit_to(store, 1, run_id="run-c")
        assert publish(c, 1, d1, run="demo-2").status_code == 201
        # the first runs' signalled history is kept as it was
        assert c.get("/v1/runs/demo-0/head").json()["manifest_digest"] == old[2]


def test_derived_head_skips_a_step_fenced_off_by_a_newer_writer(tmp_path: Path) -> None:
    from deltasync.run.claims import claim_epoch

    store = MemoryStore("fenced")
    d3 = _commit_to(store, 3)
    claim_epoch(store, "newer-writer", 3)  # a newer uploader took over after step 3 ...
    _commit_to(store, 9)  # ... so the old one's step 9 (epoch 0) does not belong to the run
    with TestClient(create_app(Settings(publish_token=PUB), store=store)) as c:
        got = c.get("/v1/runs/r/head").json()
        assert (got["step"], got["manifest_digest"]) == (3, d3)
