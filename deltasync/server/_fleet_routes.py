"""The fleet routes: receivers report what they serve, the trainer reads a run's fleet.

``PUT /v1/runs/{run}/replicas/{replica}`` (scope ``report``) records a replica's step, state
digest, state and last error; ``DELETE`` of the same path removes it (a clean shutdown);
``GET /v1/runs/{run}/fleet`` (scope ``subscribe``) lists the live replicas with their lag behind
the run's head, their last behavioural audit and their fingerprint group (a ``serving`` replica that
is the odd one out at its audited step is shown ``diverged``). See :mod:`deltasync.server._fleet` for ageing and bounds.
``POST /v1/runs/{run}/replicas/{replica}/token`` (scope ``publish``) mints a replica token. Who may
report or remove which replica id (replica tokens, leases) is :mod:`deltasync.server._identity`; the
run's grouping tolerance (its ``probes.json``, never a report's) is :mod:`deltasync.server._policy`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from deltasync.protocol.audit import FingerprintGroup
from deltasync.server._auth import AUTH_RESPONSES, Publish, ReportAuth, Subscribe
from deltasync.server._db import Commit
from deltasync.server._deps import FleetDep, MetricsDep, RelayDep, SettingsDep
from deltasync.server._fleet import FleetFull, Replica, Shown
from deltasync.server._identity import IdentityRefused, ReplicaClaims
from deltasync.server._input import StrictRoute
from deltasync.server._models import AuditBody, FleetOut, Problem, ReplicaIn, ReplicaOut, ReplicaTokenOut
from deltasync.server._policy import RunPolicies
from deltasync.server._relay import CommitRelay
from deltasync.server._routes import RunName
from deltasync.signal import LEASE_HEADER, REPLICA_PATTERN, ReplicaState, replica_token

__all__ = ["ReplicaName", "fleet_router"]

ReplicaName = Annotated[str, Path(pattern=REPLICA_PATTERN, max_length=128, description="replica id")]

#: the reporter's lease secret (:func:`deltasync.signal.new_lease`): only its holder reports or removes
#: an unbound replica id while it is live
LeaseHeader = Annotated[
    str | None,
    Header(
        alias=LEASE_HEADER,
        max_length=256,
        description="the reporter's lease secret, drawn at its start (deltasync.signal.new_lease: 43 random "
        "base64url characters); only its hash is kept. A short one is the reporter's own risk",
    ),
]


async def get_claims(request: Request) -> ReplicaClaims:
    """The app's :class:`~deltasync.server._identity.ReplicaClaims` (who holds each replica id)."""
    claims: ReplicaClaims = request.app.state.claims
    return claims


async def get_policies(request: Request) -> RunPolicies:
    """The app's :class:`~deltasync.server._policy.RunPolicies` (each run's fingerprint tolerance)."""
    policies: RunPolicies = request.app.state.policies
    return policies


ClaimsDep = Annotated[ReplicaClaims, Depends(get_claims)]
PoliciesDep = Annotated[RunPolicies, Depends(get_policies)]

#: The fleet routes; :func:`~deltasync.server.app.create_app` includes them.
fleet_router = APIRouter(route_class=StrictRoute)


def _out(
    r: Replica,
    head: int | None,
    head_digest: str | None,
    now: float,
    state: ReplicaState | None = None,
    group: FingerprintGroup | None = None,
) -> ReplicaOut:
    lag = None if head is None or r.step is None else head - r.step
    digest_ok = None if r.digest is None or head_digest is None else r.digest == head_digest
    return ReplicaOut(
        replica=r.replica,
        step=r.step,
        lag=lag,
        state=r.state if state is None else state,
        digest=r.digest,
        digest_ok=digest_ok,
        last_error=r.last_error,
        since=r.since,
        last_seen=r.last_seen,
        age_s=max(0.0, now - r.last_seen),
        ttl_s=r.ttl_s,
        audit=None if r.audit is None else AuditBody.of(r.audit),
        fingerprint_group=None if group is None else group.group,
        odd_one_out=group is not None and group.odd_one_out,
    )


@fleet_router.put(
    "/v1/runs/{run}/replicas/{replica}",
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
) -> ReplicaOut:
    """Record what ``replica`` of ``run`` serves now (at each change, and as a heartbeat).

    A replica token of the replica (or the publish token) reports it *bound*; the shared report or
    subscribe token *unbound*, refused for an id a bound reporter holds (403) or another lease holds
    (409). The fleet groups fingerprints with the run's own policy (its ``probes.json``), never with
    the report's ``audit.tolerance`` (docs/fleet.md).
    """
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
    return _out(entry, head.step if head else None, digest, entry.last_seen)


@fleet_router.delete(
    "/v1/runs/{run}/replicas/{replica}",
    status_code=204,
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
