"""The signal server: FastAPI routes over :class:`~deltasync.server._hub.Hub`.

Build it with :func:`create_app`; run it with ``deltasync serve`` (uvicorn).
Routes are versioned under ``/v1``; see the README section "Signal server".
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from deltasync.errors import DeltaSyncError
from deltasync.protocol.keys import MAX_STEP
from deltasync.server._db import Commit, Database, Webhook
from deltasync.server._hub import Conflict, Hub, NotInStore, StoreUnavailable
from deltasync.server._metrics import Metrics
from deltasync.server._settings import DIGEST_PATTERN, RUN_PATTERN, Settings
from deltasync.storage import Store, open_store

__all__ = ["create_app"]

log = logging.getLogger("deltasync.server")

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]
RunName = Annotated[str, Path(pattern=RUN_PATTERN, max_length=128, description="run name")]


def _json_integer(v: Any) -> Any:
    # JSON Schema counts 7.0 as an integer; strings and fractions stay rejected (strict models)
    return int(v) if isinstance(v, float) and v.is_integer() else v


StepNo = Annotated[int, BeforeValidator(_json_integer)]


# ---------------------------------------------------------------- models


class CommitIn(BaseModel):
    """Body of ``POST /v1/runs/{run}/commits``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: StepNo = Field(ge=0, le=MAX_STEP)
    manifest_digest: str = Field(pattern=DIGEST_PATTERN, description="xxh3-128 of the step's manifest.json")
    run_id: str | None = Field(default=None, max_length=128, pattern=r"^[\x21-\x7e]+$")
    kind: Literal["anchor", "patch"] | None = None


class CommitOut(BaseModel):
    """A signalled commit; its SSE event id is ``step``."""

    run: str
    step: int
    manifest_digest: str
    run_id: str | None
    kind: str | None
    time: float


class WebhookIn(BaseModel):
    """Body of ``POST /v1/runs/{run}/webhooks``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(
        max_length=2048,
        pattern=r"^https?://[A-Za-z0-9._~-]+(:[0-9]{1,5})?(/[\x21-\x7e]*)?$",
        description="http(s) URL that receives signed POSTs",
    )
    secret: str = Field(min_length=16, max_length=256, description="HMAC-SHA256 key of the signatures")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or not v.isprintable() or " " in v:
            raise ValueError("url must be an absolute http:// or https:// URL")
        return v


class WebhookOut(BaseModel):
    """A registered webhook (its secret is never sent back)."""

    id: str
    run: str
    url: str
    created: float


class Problem(BaseModel):
    """An error reply."""

    detail: str


def _out(c: Commit) -> CommitOut:
    return CommitOut(**c.to_dict())  # type: ignore[arg-type]


def _hook_out(w: Webhook) -> WebhookOut:
    return WebhookOut(id=w.id, run=w.run, url=w.url, created=w.created)


# ----------------------------------------------------------------- auth

_bearer = HTTPBearer(auto_error=False, description="publish or subscribe token")


def _same(given: str, expected: str) -> bool:
    # hash first: compare_digest is constant-time only for equal lengths
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def _auth_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status, detail, headers={"WWW-Authenticate": 'Bearer realm="deltasync"'})


_ALLOWED_QUERY: dict[int, frozenset[str]] = {}


def _no_unknown_query(request: Request) -> None:
    """422 for query parameters the route does not declare (a typo like ``?afer=`` must not pass silently)."""
    route = request.scope.get("route")
    if not request.query_params or not isinstance(route, APIRoute):
        return
    allowed = _ALLOWED_QUERY.get(id(route))
    if allowed is None:
        names: set[str] = set()
        todo = [route.dependant]
        while todo:
            dep = todo.pop()
            names.update(p.alias for p in dep.query_params)
            todo.extend(dep.dependencies)
        allowed = _ALLOWED_QUERY[id(route)] = frozenset(names)
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("query", name),
                    "msg": f"unknown query parameter; this route takes {sorted(allowed)}",
                    "input": request.query_params[name],
                }
                for name in unknown
            ]
        )


def _require(scope: Literal["publish", "subscribe"]) -> Callable[..., Awaitable[None]]:
    async def check(request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        _no_unknown_query(request)
        s: Settings = request.app.state.settings
        wanted = [s.publish_token] if scope == "publish" else [s.subscribe_token, s.publish_token]
        if scope == "subscribe" and s.subscribe_token is None:
            return  # reading is open
        if wanted[0] is None:
            return
        if cred is None:
            request.app.state.metrics.inc("deltasync_auth_failures_total", reason="missing")
            raise _auth_error(401, f"this route needs a bearer token of scope {scope!r}")
        ok = False
        for tok in wanted:
            if tok is not None:
                ok |= _same(cred.credentials, tok)  # no short-circuit: same work for every token
        if not ok:
            request.app.state.metrics.inc("deltasync_auth_failures_total", reason="wrong")
            raise _auth_error(403, f"the bearer token does not grant scope {scope!r}")

    return check


Publish = Depends(_require("publish"))
Subscribe = Depends(_require("subscribe"))

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is not parseable JSON"},
    401: {"model": Problem, "description": "no bearer token"},
    403: {"model": Problem, "description": "the token lacks this scope"},
    413: {"model": Problem, "description": "request body too large"},
}


# ------------------------------------------------------ body size limit


def limit_body(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 (declared or streamed)."""

    async def too_large(send: Callable[[Any], Awaitable[None]]) -> None:
        body = json.dumps({"detail": f"request body exceeds {max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def middleware(
        scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length" and (not v.isdigit() or int(v) > max_bytes):
                await too_large(send)
                return
        seen = 0
        started = False
        refused = False

        async def limited_receive() -> Any:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > max_bytes:
                    # answer 413 now and tell the app the client went away; whatever it sends is dropped
                    refused = True
                    if not started:
                        await too_large(send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Any) -> None:
            nonlocal started
            if refused:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await app(scope, limited_receive, guarded_send)

    return middleware


# ------------------------------------------------------------------ app


def _store_factory(settings: Settings, store: Store | None) -> tuple[Callable[[str], Store] | None, list[Store]]:
    opened: list[Store] = []
    if store is not None:
        fixed = store
        return (lambda run: fixed), opened
    if settings.store_url is None:
        return None, opened
    url = settings.store_url
    if "{run}" not in url:
        single = open_store(url)
        opened.append(single)
        return (lambda run: single), opened
    cache: dict[str, Store] = {}

    def per_run(run: str) -> Store:
        if run not in cache:
            cache[run] = open_store(url.replace("{run}", run))
            opened.append(cache[run])
        return cache[run]

    return per_run, opened


def create_app(
    settings: Settings | None = None,
    store: Store | None = None,
    *,
    webhook_transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The signal server as a FastAPI app.

    ``store`` (or ``settings.store_url``) makes the server check every published
    step against the store and derive unknown runs' heads from it.
    ``webhook_transport`` replaces the network for webhook deliveries (tests).
    """
    settings = settings or Settings()
    metrics = Metrics()
    metrics.declare("deltasync_commits_total", "counter", "Commits recorded (source: publish or store).")
    metrics.declare("deltasync_commits_rejected_total", "counter", "Publishes refused with 409/422, by reason.")
    metrics.declare("deltasync_head_step", "gauge", "Newest recorded step per run.")
    metrics.declare("deltasync_auth_failures_total", "counter", "Requests refused with 401 or 403.")
    metrics.declare("deltasync_sse_events_sent_total", "counter", "Commit events written to SSE streams.")
    metrics.declare("deltasync_webhook_deliveries_total", "counter", "Webhook deliveries by final outcome.")
    metrics.declare("deltasync_webhook_attempts_failed_total", "counter", "Failed webhook attempts (incl. retried).")
    db = Database(settings.db_path)
    store_for, opened = _store_factory(settings, store)
    hub = Hub(settings, db, store_for, metrics, webhook_transport)
    for run in db.runs():
        head0 = db.head(run)
        if head0 is not None:
            metrics.set("deltasync_head_step", head0.step, run=run)
    metrics.gauge_callback(
        "deltasync_sse_subscribers",
        "Open SSE streams per run.",
        lambda: {(("run", r),): float(n) for r, n in hub.subscribers.items()},
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await hub.aclose()
        for s in opened:
            s.close()
        db.close()

    app = FastAPI(
        title="deltasync signal server",
        version="1",
        description="Tells fetchers that a step is committed. A hint: the store stays the source of truth.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.hub = hub

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        # Starlette names only the first route of the path in Allow; list every method of the path
        methods: set[str] = set()
        for route in request.app.router.routes:
            if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE:
                methods |= route.methods or set()
        return JSONResponse(
            {"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": ", ".join(sorted(methods))}
        )

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(NotInStore)
    async def _not_in_store(request: Request, exc: NotInStore) -> JSONResponse:
        hub.metrics.inc("deltasync_commits_rejected_total", reason="not_in_store")
        # the shape of FastAPI's validation errors, so that 422 has one documented schema
        detail = [{"type": "not_in_store", "loc": ["body", "step"], "msg": str(exc), "input": None}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: the app answers."""
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def metrics_route() -> PlainTextResponse:
        """Prometheus metrics (text format 0.0.4)."""
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/v1/runs/{run}/commits",
        status_code=201,
        dependencies=[Publish],
        responses={
            **AUTH_RESPONSES,
            200: {"model": CommitOut, "description": "already recorded (idempotent repeat)"},
            409: {"model": Problem, "description": "older than the head, or another digest for this step"},
            422: {"description": "invalid body, or the step is not committed in the configured store"},
            503: {"model": Problem, "description": "the configured store could not be read; retry"},
        },
        tags=["publish"],
    )
    async def publish(run: RunName, body: CommitIn, response: Response) -> CommitOut:
        """Signal that ``step`` of ``run`` is committed with manifest digest ``manifest_digest``."""
        existing = hub.db.get_commit(run, body.step)
        if existing is None or existing.manifest_digest != body.manifest_digest:
            await hub.check_in_store(run, body.step, body.manifest_digest)
        commit, created = hub.publish(run, body.step, body.manifest_digest, body.run_id, body.kind)
        response.status_code = 201 if created else 200
        return _out(commit)

    @app.post(
        "/v1/runs/{run}/rederive",
        dependencies=[Publish],
        responses={**AUTH_RESPONSES, 404: {"model": Problem}, 502: {"model": Problem}},
        tags=["publish"],
    )
    async def rederive(run: RunName) -> CommitOut:
        """Record the store's newest committed step as the head (needs a configured store)."""
        if hub.store_for is None:
            raise HTTPException(404, "this server has no store configured")
        try:
            head = await hub.rederive(run)
        except DeltaSyncError as exc:
            raise HTTPException(502, f"cannot read the store: {exc}") from exc
        if head is None:
            raise HTTPException(404, f"run {run!r} has no committed step")
        return _out(head)

    @app.get(
        "/v1/runs/{run}/head",
        dependencies=[Subscribe],
        responses={**AUTH_RESPONSES, 404: {"model": Problem, "description": "no step signalled yet"}},
        tags=["subscribe"],
    )
    async def head(run: RunName) -> CommitOut:
        """The newest signalled step of ``run``."""
        c = await hub.head_or_derive(run)
        if c is None:
            raise HTTPException(404, f"run {run!r} has no signalled step yet")
        return _out(c)

    @app.get("/v1/runs/{run}/commits", dependencies=[Subscribe], responses=AUTH_RESPONSES, tags=["subscribe"])
    async def commits(
        run: RunName,
        after: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[CommitOut]:
        """Retained commits newer than ``after``, oldest first."""
        return [_out(c) for c in hub.commits_after(run, after, limit)]

    @app.get(
        "/v1/runs/{run}/wait",
        dependencies=[Subscribe],
        responses={**AUTH_RESPONSES, 204: {"description": "timed out: nothing newer than after"}},
        tags=["subscribe"],
    )
    async def wait(
        run: RunName,
        after: Annotated[int, Query(ge=-1, le=MAX_STEP, description="the step the caller has")] = -1,
        timeout: Annotated[float, Query(ge=0, le=3600, description="seconds to wait (capped by the server)")] = 30.0,
    ) -> Any:
        """Long-poll: the head as soon as it is newer than ``after``; 204 after ``timeout`` seconds."""
        await hub.head_or_derive(run)
        c = await hub.wait_after(run, after, min(timeout, settings.max_wait_s))
        if c is None:
            return Response(status_code=204)
        return _out(c)

    @app.get(
        "/v1/runs/{run}/events",
        dependencies=[Subscribe],
        responses={
            **AUTH_RESPONSES,
            200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events, one per commit"},
        },
        response_class=StreamingResponse,
        tags=["subscribe"],
    )
    async def events(
        run: RunName,
        request: Request,
        after: Annotated[int | None, Query(ge=-1, le=MAX_STEP, description="resume after this step")] = None,
        limit: Annotated[int | None, Query(ge=1, le=1_000_000, description="close after this many events")] = None,
        heartbeat: Annotated[
            float | None, Query(ge=0.2, le=300, description="seconds between keep-alive comments")
        ] = None,
        last_event_id: Annotated[str | None, Header(max_length=20)] = None,
    ) -> StreamingResponse:
        """Server-Sent Events ``commit`` (id = step). Resumes after ``Last-Event-ID`` (or ``after``).

        Without either, the stream starts with the current head. A comment line
        is sent after ``heartbeat_s`` idle seconds.
        """
        start = after
        if last_event_id is not None and last_event_id.strip():
            if not last_event_id.strip().isdigit():
                raise HTTPException(422, "Last-Event-ID must be a step number")
            start = int(last_event_id)
        head0 = await hub.head_or_derive(run)
        if start is None:
            start = head0.step - 1 if head0 is not None else -1
        return StreamingResponse(
            _stream(hub, run, start, limit, heartbeat or settings.heartbeat_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post(
        "/v1/runs/{run}/webhooks",
        status_code=201,
        dependencies=[Publish],
        responses=AUTH_RESPONSES,
        tags=["webhooks"],
    )
    async def add_webhook(run: RunName, body: WebhookIn) -> WebhookOut:
        """Register a URL that receives a signed POST for each new commit of ``run``."""
        w = Webhook(secrets.token_hex(8), run, body.url, body.secret, time.time())
        hub.db.add_webhook(w)
        return _hook_out(w)

    @app.get("/v1/runs/{run}/webhooks", dependencies=[Publish], responses=AUTH_RESPONSES, tags=["webhooks"])
    async def list_webhooks(run: RunName) -> list[WebhookOut]:
        """The run's webhooks (without secrets)."""
        return [_hook_out(w) for w in hub.db.webhooks(run)]

    @app.delete(
        "/v1/runs/{run}/webhooks/{hook_id}",
        status_code=204,
        dependencies=[Publish],
        responses={**AUTH_RESPONSES, 404: {"model": Problem}},
        tags=["webhooks"],
    )
    async def delete_webhook(run: RunName, hook_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]) -> Response:
        """Unregister a webhook."""
        if not hub.db.delete_webhook(run, hook_id):
            raise HTTPException(404, f"run {run!r} has no webhook {hook_id}")
        return Response(status_code=204)

    app.add_middleware(_BodyLimit, max_bytes=settings.max_body_bytes)
    return app


class _BodyLimit:
    """Starlette-style middleware class around :func:`limit_body`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._inner = limit_body(app, max_bytes)

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        await self._inner(scope, receive, send)


@lru_cache(maxsize=1024)
def _sse(c: Commit) -> bytes:  # encoded once per commit, not once per subscriber
    data = json.dumps(c.to_dict(), separators=(",", ":"))
    return f"id: {c.step}\nevent: commit\ndata: {data}\n\n".encode()


async def _stream(hub: Hub, run: str, after: int, limit: int | None, heartbeat: float) -> AsyncIterator[bytes]:
    hub.subscribers[run] = hub.subscribers.get(run, 0) + 1
    sent = 0
    last = after
    try:
        yield b"retry: 1000\n\n"
        while not hub.closing:
            ev = hub.changed(run)
            for c in hub.commits_after(run, last):
                yield _sse(c)
                hub.metrics.inc("deltasync_sse_events_sent_total")
                last = c.step
                sent += 1
                if limit is not None and sent >= limit:
                    return
            try:
                await asyncio.wait_for(ev.wait(), heartbeat)
            except asyncio.TimeoutError:
                yield b": keepalive\n\n"
    finally:
        hub.subscribers[run] -= 1
