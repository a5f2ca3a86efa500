"""The fleet routes: receivers report what they serve, the trainer reads a run's fleet.

``PUT /v1/runs/{run}/replicas/{replica}`` (scope ``report``) records a replica's step, state
digest, state and last error; ``DELETE`` of the same path removes it (a clean shutdown);
``GET /v1/runs/{run}/fleet`` (scope ``subscribe``) lists the live replicas with their lag behind
the run's head, their last behavioural audit and their fingerprint group (a ``serving`` replica that
is the odd one out at its audited step is shown ``diverged``). See :mod:`deltasync.server._fleet` for ageing and bounds.
``POST /v1/runs/{run}/replicas/{replica}/token`` (scope ``publish``) mints a replica token. Who may
report or remove which replica id (replica tokens, leases) is :mod:`deltasync.server._identity`; the
run's grouping tolerance (its ``probes.json``, never a report's) is :mod:`deltasync.server._policy`.

A heartbeat is the server's most frequent request (437/s from 4,096 replicas): :class:`ReportLane`
(ASGI middleware) answers a plain report ahead of FastAPI's routing and dependency solving
(:func:`_fast_report`) and hands anything else to the route as declared, and both reply with JSON assembled from the
book's cached members, not through a model (docs/fleet.md "Scale").
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated

from fastapi import APIRouter, FastAPI, Header, HTTPException, Path, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltasync.server._auth import (
    AUTH_RESPONSES,
    Publish,
    ReportAuth,
    ReportCheck,
    ReportCredential,
    ReportRefusal,
    Subscribe,
    report_grant,
)
from deltasync.server._db import Commit
from deltasync.server._deps import ClaimsDep, FleetDep, MetricsDep, PoliciesDep, RelayDep, SettingsDep
from deltasync.server._fleet import FleetBook, FleetFull, Replica, Shown
from deltasync.server._identity import IdentityRefused, ReplicaClaims
from deltasync.server._input import StrictRoute, strict_json_loads
from deltasync.server._metrics import Metrics
from deltasync.server._models import FleetOut, Problem, ReplicaIn, ReplicaOut, ReplicaTokenOut
from deltasync.server._policy import RunPolicies
from deltasync.server._relay import CommitRelay
from deltasync.server._routes import RunName
from deltasync.server._settings import RUN_PATTERN
from deltasync.signal import LEASE_HEADER, REPLICA_PATTERN, replica_token

__all__ = ["ReplicaName", "ReportLane", "fleet_router"]

ReplicaName = Annotated[str, Path(pattern=REPLICA_PATTERN, max_length=128, description="replica id")]

_MAX_LEASE = 256

#: the reporter's lease secret (:func:`deltasync.signal.new_lease`): only its holder reports or removes
#: an unbound replica id while it is live
LeaseHeader = Annotated[
    str | None,
    Header(
        alias=LEASE_HEADER,
        max_length=_MAX_LEASE,
        description="the reporter's lease secret, drawn at its start (deltasync.signal.new_lease: 43 random "
        "base64url characters); only its hash is kept. A short one is the reporter's own risk",
    ),
]


#: The fleet routes; :func:`~deltasync.server.app.create_app` includes them.
fleet_router = APIRouter(route_class=StrictRoute)


def _reply(entry: Replica, fragment: bytes, head: int | None, head_digest: str | None) -> Response:
    """``ReplicaOut`` of a report's entry as JSON (the members GET fleet shows, from the fragment the
    book rendered at the report: no model built, none validated again): its reported state, no group."""
    lag = None if head is None or entry.step is None else head - entry.step
    ok = "null" if entry.digest is None or head_digest is None else ("true" if entry.digest == head_digest else "false")
    tail = (
        f',"lag":{_json_int(lag)},"state":"{entry.state}","digest_ok":{ok},"age_s":0.0,'
        '"fingerprint_group":null,"odd_one_out":false}'
    )
    return Response(b"".join((b"{", fragment, tail.encode())), media_type="application/json")


async def _record(
    run: str,
    replica: str,
    body: ReplicaIn,
    cred: ReportCredential,
    lease: str | None,
    fleet: FleetBook,
    relay: CommitRelay,
    metrics: Metrics,
    claims: ReplicaClaims,
    policies: RunPolicies,
) -> Response:
    """A report, whichever way it came in (:func:`report` or :func:`_fast_report`): the run's policy,
    the replica id's claim, the book, the metrics, the reply."""
    if body.audit is not None:  # the run's policy, read once per run off the event loop
        fleet.set_tolerance(run, await policies.tolerance(run))
    audit = None if body.audit is None else body.audit.report()
    try:
        entry, joined = claims.report(
            run,
            replica,
            bound=cred.bound,
            lease=lease,
            record=lambda: fleet.report(
                run,
                replica,
                step=body.step,
                digest=body.digest,
                state=body.state,
                last_error=body.last_error,
                ttl_s=body.ttl_s,
                audit=audit,
                bound=cred.bound,
                audit_error=body.audit_error,
            ),
            seen=lambda out: (out[0].last_seen, out[0].ttl_s),
        )
    except IdentityRefused as exc:
        metrics.inc("deltasync_fleet_identity_refused_total", status=str(exc.status))
        raise HTTPException(exc.status, exc.detail) from None
    except FleetFull as exc:
        metrics.inc("deltasync_fleet_reports_refused_total")
        raise HTTPException(429, str(exc)) from exc
    metrics.inc("deltasync_fleet_reports_total")
    if joined:
        metrics.inc("deltasync_fleet_joined_total")
    head = relay.head(run)
    digest = None
    if head is not None and entry.step is not None:
        known = relay.db.get_commit(run, entry.step) if entry.step != head.step else head
        digest = known.manifest_digest if known is not None else None
    return _reply(entry, fleet.fragment(run, replica), head.step if head else None, digest)


async def report(
    run: RunName,
    replica: ReplicaName,
    body: ReplicaIn,
    cred: ReportAuth,
    fleet: FleetDep,
    relay: RelayDep,
    metrics: MetricsDep,
    claims: ClaimsDep,
    policies: PoliciesDep,
    lease: LeaseHeader = None,
) -> Response:
    """Record what ``replica`` of ``run`` serves now (at each change, and as a heartbeat).

    A replica token of the replica (or the publish token) reports it *bound*; the shared report or
    subscribe token *unbound*, refused for an id a bound reporter holds (403) or another lease holds
    (409). The fleet groups fingerprints with the run's own policy (its ``probes.json``), never with
    the report's ``audit.tolerance`` (docs/fleet.md).
    """
    return await _record(run, replica, body, cred, lease, fleet, relay, metrics, claims, policies)


_RUN = re.compile(RUN_PATTERN)
_REPLICA = re.compile(REPLICA_PATTERN)
_TOKEN = re.compile(rb"[\x21-\x7e]+")
_LEASE = LEASE_HEADER.lower().encode()


async def _fast_report(app: FastAPI, scope: Scope, run: str, replica: str, raw: bytes) -> Response | None:
    """:func:`report` without FastAPI's routing and dependency solving (most of a heartbeat's cost),
    for the request every reporter sends: no query, one ``Authorization: Bearer`` header (or none)
    that :func:`~deltasync.server._auth.report_grant` accepts, ``Content-Type: application/json``, a
    body that :func:`~deltasync.server._input.strict_json_loads` parses and :class:`ReplicaIn`
    validates, at most one non-empty lease header within its bound, and run and replica names that
    match their patterns. Anything else (None) goes through the route as declared, which refuses it
    as it always did: this path accepts nothing the route does not, and records it the same way
    (:func:`_record`)."""
    if scope.get("query_string"):
        return None
    auth = ctype = lease_raw = None
    for k, v in scope["headers"]:
        if k == b"authorization":
            if auth is not None:
                return None
            auth = v
        elif k == b"content-type":
            if ctype is not None:
                return None
            ctype = v
        elif k == _LEASE:
            if lease_raw is not None:
                return None
            lease_raw = v
    if ctype != b"application/json" or not raw:
        return None
    if len(run) > 128 or len(replica) > 128 or not _RUN.fullmatch(run) or not _REPLICA.fullmatch(replica):
        return None
    given = None
    if auth is not None:
        if not auth.startswith(b"Bearer ") or not _TOKEN.fullmatch(auth, 7):
            return None
        given = auth[7:].decode()
    lease = None
    if lease_raw is not None:
        lease = lease_raw.decode("latin-1")
        if not 0 < len(lease) <= _MAX_LEASE:
            return None
    s = app.state
    cred = report_grant(s.settings, given, run, replica)
    if isinstance(cred, ReportRefusal):
        return None
    try:
        parsed = strict_json_loads(raw)
        if not isinstance(parsed, dict):
            return None
        body = ReplicaIn.model_validate(parsed)
    except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
        return None
    return await _record(run, replica, body, cred, lease, s.fleet, s.relay, s.metrics, s.claims, s.policies)


_PATH = re.compile(r"/v1/runs/([^/]+)/replicas/([^/]+)")


class ReportLane:
    """ASGI middleware: a heartbeat (``PUT /v1/runs/{run}/replicas/{replica}``) answered by
    :func:`_fast_report` ahead of the app's routing, body limit and exception middleware; every other
    request, and a report it does not take, goes to the app unchanged (the body it read is replayed).

    A body over ``max_bytes`` (declared or streamed), a disconnect, ``app.state.fast_reports`` False
    or an overridden dependency: the app's own route answers. An ``HTTPException`` of the report
    (403, 409, 429) is answered by the app's own handler of it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # docstring inherited
        m = None
        if scope["type"] == "http" and scope["method"] == "PUT" and not scope.get("root_path"):
            m = _PATH.fullmatch(scope["path"])
        fastapi_app = scope.get("app")
        if (
            m is None
            or not isinstance(fastapi_app, FastAPI)
            or not fastapi_app.state.fast_reports
            or fastapi_app.dependency_overrides
            or any(
                k == b"content-length" and (not v.isdigit() or len(v) > 20 or int(v) > self.max_bytes)
                for k, v in scope["headers"]
            )
        ):
            await self.app(scope, receive, send)
            return
        read: list[Message] = []
        size = 0
        while True:
            msg = await receive()
            read.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes or not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        whole = read[-1]["type"] == "http.request" and size <= self.max_bytes and not read[-1].get("more_body", False)
        reply = None
        if whole:
            raw = b"".join(msg.get("body", b"") for msg in read)
            try:
                reply = await _fast_report(fastapi_app, scope, m[1], m[2], raw)
            except StarletteHTTPException as exc:
                handler = fastapi_app.exception_handlers[StarletteHTTPException]
                made = handler(Request(scope, replay), exc)
                reply = made if isinstance(made, Response) else await made
            if reply is not None:
                read.clear()
        if reply is None:
            await self.app(scope, replay, send)
        else:
            await reply(scope, replay, send)


fleet_router.add_api_route(
    "/v1/runs/{run}/replicas/{replica}",
    report,
    methods=["PUT"],
    response_model=ReplicaOut,
    dependencies=[ReportCheck],
    responses={
        **AUTH_RESPONSES,
        403: {
            "model": Problem,
            "description": "the token lacks this scope, or the replica id is held by a replica token",
        },
        409: {"model": Problem, "description": "the replica id is held by another reporter (another lease)"},
        429: {"model": Problem, "description": "the run's fleet (or the server) is full"},
    },
    tags=["fleet"],
)


@fleet_router.delete(
    "/v1/runs/{run}/replicas/{replica}",
    status_code=204,
    dependencies=[ReportCheck],
    responses={
        **AUTH_RESPONSES,
        403: {
            "model": Problem,
            "description": "the token lacks this scope, or the replica id is held by a replica token",
        },
        404: {"model": Problem, "description": "no such live replica"},
        409: {"model": Problem, "description": "the replica id is held by another reporter (another lease)"},
    },
    tags=["fleet"],
)
async def leave(
    run: RunName,
    replica: ReplicaName,
    cred: ReportAuth,
    fleet: FleetDep,
    metrics: MetricsDep,
    claims: ClaimsDep,
    lease: LeaseHeader = None,
) -> Response:
    """Remove ``replica`` from the run's fleet (it shut down cleanly; else it ages out).

    Its own replica token, the lease it reported with, or the publish token (an operator) may remove it.
    """
    try:
        gone = claims.leave(run, replica, bound=cred.bound, lease=lease, remove=lambda: fleet.leave(run, replica))
    except IdentityRefused as exc:
        metrics.inc("deltasync_fleet_identity_refused_total", status=str(exc.status))
        raise HTTPException(exc.status, exc.detail) from None
    if not gone:
        raise HTTPException(404, f"run {run!r} has no live replica {replica!r}")
    return Response(status_code=204)


@fleet_router.post(
    "/v1/runs/{run}/replicas/{replica}/token",
    dependencies=[Publish],
    responses={**AUTH_RESPONSES, 409: {"model": Problem, "description": "the server has no replica key"}},
    tags=["fleet"],
)
async def mint_token(run: RunName, replica: ReplicaName, settings: SettingsDep) -> ReplicaTokenOut:
    """The replica token of identity ``replica`` of ``run`` (scope ``publish``): it reports that replica id
    and every ``replica-<suffix>`` of the run, bound (docs/fleet.md). The same as ``deltasync replica-token``
    computes offline from the server's replica key."""
    key = settings.replica_token_key
    if key is None:
        raise HTTPException(
            409, "this server has no replica key: start it with DELTASYNC_REPLICA_KEY (or a publish token)"
        )
    return ReplicaTokenOut(token=replica_token(key, run, replica), run=run, replica=replica)


@fleet_router.get(
    "/v1/runs/{run}/fleet",
    dependencies=[Subscribe],
    responses=AUTH_RESPONSES,
    tags=["fleet"],
    response_model=FleetOut,
)
async def fleet_view(run: RunName, fleet: FleetDep, relay: RelayDep) -> Response:
    """The run's live replicas, each with its step, lag behind the head, state and last error.

    The book regroups only the audited steps that changed since the last read, in a worker thread
    (docs/fleet.md "Scale"); with nothing to regroup the reply is assembled on the event loop from
    each replica's pre-rendered members rather than through a model per replica (yielding to the
    loop between slices of it made the reply 4x slower under load: each yield waits behind the
    queued reports).
    """
    head = await relay.head_or_derive(run)
    if fleet.grouped(run):  # nothing to regroup: cheaper here (~20 ms for 4,096) than a thread hop under load
        body = _render(run, head, *fleet.view(run), relay)
    else:
        body = await run_in_threadpool(lambda: _render(run, head, *fleet.view(run), relay))
    return Response(body, media_type="application/json")


def _json_str(v: str | None) -> str:
    return "null" if v is None else json.dumps(v)


def _json_int(v: int | None) -> str:
    return "null" if v is None else str(int(v))


def _json_float(v: float) -> str:
    return repr(float(v)) if math.isfinite(v) else "null"


#: replicas rendered per list of parts
_SLICE = 512


def _render(run: str, head: Commit | None, now: float, rows: list[Shown], relay: CommitRelay) -> bytes:
    """``FleetOut`` as JSON bytes, built without a model per replica: each replica's members that
    change only with a report come pre-rendered (:attr:`Shown.fragment`), the rest (lag, shown state,
    digest check, age, group) are added here."""
    digests = _digests(run, head, rows, relay)
    parts = [_head(run, head, now)]
    for lo in range(0, len(rows), _SLICE):
        parts += _members(rows[lo : lo + _SLICE], head, digests, now)
    return _close(parts)


def _digests(run: str, head: Commit | None, rows: list[Shown], relay: CommitRelay) -> dict[int, str]:
    digests: dict[int, str] = {}
    for s in {r.replica.step for r in rows if r.replica.step is not None and r.replica.digest is not None}:
        c = head if head is not None and head.step == s else relay.db.get_commit(run, s)
        if c is not None:
            digests[s] = c.manifest_digest
    return digests


def _head(run: str, head: Commit | None, now: float) -> bytes:
    head_step = None if head is None else head.step
    return f'{{"run":{_json_str(run)},"head":{_json_int(head_step)},"time":{_json_float(now)},"replicas":['.encode()


def _members(rows: list[Shown], head: Commit | None, digests: dict[int, str], now: float) -> list[bytes]:
    head_step = None if head is None else head.step
    parts: list[bytes] = []
    for row in rows:
        r, g = row.replica, row.group
        lag = None if head_step is None or r.step is None else head_step - r.step
        known = None if r.step is None else digests.get(r.step)
        ok = "null" if r.digest is None or known is None else ("true" if r.digest == known else "false")
        parts += (
            b"{",
            row.fragment,
            (
                f',"lag":{_json_int(lag)},"state":"{row.state}","digest_ok":{ok},'
                f'"age_s":{_json_float(max(0.0, now - r.last_seen))},'
                f'"fingerprint_group":{_json_int(None if g is None else g.group)},'
                f'"odd_one_out":{"true" if g is not None and g.odd_one_out else "false"}}},'
            ).encode(),
        )
    return parts


def _close(parts: list[bytes]) -> bytes:
    if len(parts) > 1:
        parts[-1] = parts[-1][:-1]  # no comma after the last replica
    return b"".join((*parts, b"]}"))
