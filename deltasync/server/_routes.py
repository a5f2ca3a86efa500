"""The signal server's HTTP routes, on one :data:`router`.

Handlers hold no state of their own: the relay, settings and metrics come from
``request.app.state`` through the dependencies of :mod:`deltasync.server._deps`
(override them in tests with ``app.dependency_overrides``). Every route is a
:class:`~deltasync.server._input.StrictRoute`, so JSON bodies are parsed strictly.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Path, Query, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from deltasync._util.prometheus import CONTENT_TYPE
from deltasync.errors import DeltaSyncError
from deltasync.protocol.keys import MAX_STEP
from deltasync.server._auth import AUTH_RESPONSES, Publish, Subscribe
from deltasync.server._db import Webhook
from deltasync.server._deps import MetricsDep, RelayDep, SettingsDep
from deltasync.server._input import ASCII_FLOAT, ASCII_INT, StrictRoute, parse_last_event_id
from deltasync.server._models import CommitIn, CommitOut, Problem, WebhookIn, WebhookOut, commit_out, webhook_out
from deltasync.server._settings import RUN_PATTERN
from deltasync.server._sse import commit_stream

__all__ = ["RunName", "router"]

RunName = Annotated[str, Path(pattern=RUN_PATTERN, max_length=128, description="run name")]

#: Every route of the signal server; :func:`~deltasync.server.app.create_app` includes it.
router = APIRouter(route_class=StrictRoute)


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict[str, str]:
    """Liveness: the app answers."""
    return {"status": "ok"}


@router.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
async def metrics_route(metrics: MetricsDep) -> PlainTextResponse:
    """Prometheus metrics (text format 0.0.4): from cached figures on the event loop, else (a fleet to
    regroup, figures to rebuild) in a worker thread."""
    text = metrics.render() if metrics.cached() else await run_in_threadpool(metrics.render)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


@router.post(
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
async def publish(run: RunName, body: CommitIn, response: Response, relay: RelayDep) -> CommitOut:
    """Signal that ``step`` of ``run`` is committed with manifest digest ``manifest_digest``."""
    existing = relay.db.get_commit(run, body.step)
    if existing is None or existing.manifest_digest != body.manifest_digest:
        await relay.check_in_store(run, body.step, body.manifest_digest)
    commit, created = relay.publish(run, body.step, body.manifest_digest, body.run_id, body.kind)
    response.status_code = 201 if created else 200
    return commit_out(commit)


@router.post(
    "/v1/runs/{run}/rederive",
    dependencies=[Publish],
    responses={**AUTH_RESPONSES, 404: {"model": Problem}, 502: {"model": Problem}},
    tags=["publish"],
)
async def rederive(run: RunName, relay: RelayDep) -> CommitOut:
    """Record the store's newest committed step as the head (needs a configured store)."""
    if relay.store_for is None:
        raise HTTPException(404, "this server has no store configured")
    try:
        head = await relay.rederive(run)
    except DeltaSyncError as exc:
        raise HTTPException(502, f"cannot read the store: {exc}") from exc
    if head is None:
        raise HTTPException(404, f"run {run!r} has no committed step")
    return commit_out(head)


@router.get(
    "/v1/runs/{run}/head",
    dependencies=[Subscribe],
    responses={**AUTH_RESPONSES, 404: {"model": Problem, "description": "no step signalled yet"}},
    tags=["subscribe"],
)
async def head(run: RunName, relay: RelayDep) -> CommitOut:
    """The newest signalled step of ``run``."""
    c = await relay.head_or_derive(run)
    if c is None:
        raise HTTPException(404, f"run {run!r} has no signalled step yet")
    return commit_out(c)


@router.get("/v1/runs/{run}/commits", dependencies=[Subscribe], responses=AUTH_RESPONSES, tags=["subscribe"])
async def commits(
    run: RunName,
    relay: RelayDep,
    after: Annotated[int, Query(ge=-1, le=MAX_STEP), ASCII_INT] = -1,
    limit: Annotated[int, Query(ge=1, le=1000), ASCII_INT] = 100,
) -> list[CommitOut]:
    """Retained commits newer than ``after``, oldest first."""
    return [commit_out(c) for c in relay.commits_after(run, after, limit)]


@router.get(
    "/v1/runs/{run}/wait",
    dependencies=[Subscribe],
    responses={**AUTH_RESPONSES, 204: {"description": "timed out: nothing newer than after"}},
    tags=["subscribe"],
)
async def wait(
    run: RunName,
    relay: RelayDep,
    settings: SettingsDep,
    after: Annotated[int, Query(ge=-1, le=MAX_STEP, description="the step the caller has"), ASCII_INT] = -1,
    timeout: Annotated[
        float, Query(ge=0, le=3600, description="seconds to wait (capped by the server)"), ASCII_FLOAT
    ] = 30.0,
) -> Any:
    """Long-poll: the head as soon as it is newer than ``after``; 204 after ``timeout`` seconds."""
    await relay.head_or_derive(run)
    c = await relay.wait_after(run, after, min(timeout, settings.max_wait_s))
    if c is None:
        return Response(status_code=204)
    return commit_out(c)


@router.get(
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
    relay: RelayDep,
    settings: SettingsDep,
    after: Annotated[int | None, Query(ge=-1, le=MAX_STEP, description="resume after this step"), ASCII_INT] = None,
    limit: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="close after this many events"), ASCII_INT
    ] = None,
    heartbeat: Annotated[
        float | None, Query(ge=0.2, le=300, description="seconds between keep-alive comments"), ASCII_FLOAT
    ] = None,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> StreamingResponse:
    """Server-Sent Events ``commit`` (id = step). Resumes after ``Last-Event-ID`` (or ``after``).

    Without either, the stream starts with the current head. A comment line
    is sent after ``heartbeat_s`` idle seconds.
    """
    resume = parse_last_event_id(last_event_id)
    start = after if resume is None else resume
    head0 = await relay.head_or_derive(run)
    if start is None:
        start = head0.step - 1 if head0 is not None else -1
    return StreamingResponse(
        commit_stream(relay, run, start, limit, heartbeat or settings.heartbeat_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post(
    "/v1/runs/{run}/webhooks",
    status_code=201,
    dependencies=[Publish],
    responses=AUTH_RESPONSES,
    tags=["webhooks"],
)
async def add_webhook(run: RunName, body: WebhookIn, relay: RelayDep) -> WebhookOut:
    """Register a URL that receives a signed POST for each new commit of ``run``."""
    w = Webhook(secrets.token_hex(8), run, body.url, body.secret, time.time())
    relay.db.add_webhook(w)
    return webhook_out(w)


@router.get("/v1/runs/{run}/webhooks", dependencies=[Publish], responses=AUTH_RESPONSES, tags=["webhooks"])
async def list_webhooks(run: RunName, relay: RelayDep) -> list[WebhookOut]:
    """The run's webhooks (without secrets)."""
    return [webhook_out(w) for w in relay.db.webhooks(run)]


@router.delete(
    "/v1/runs/{run}/webhooks/{hook_id}",
    status_code=204,
    dependencies=[Publish],
    responses={**AUTH_RESPONSES, 404: {"model": Problem}},
    tags=["webhooks"],
)
async def delete_webhook(
    run: RunName, hook_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")], relay: RelayDep
) -> Response:
    """Unregister a webhook."""
    if not relay.db.delete_webhook(run, hook_id):
        raise HTTPException(404, f"run {run!r} has no webhook {hook_id}")
    return Response(status_code=204)
