"""The fleet routes: receivers report what they serve, the trainer reads a run's fleet.

``PUT /v1/runs/{run}/replicas/{replica}`` (scope ``report``) records a replica's step, state
digest, state and last error; ``DELETE`` of the same path removes it (a clean shutdown);
``GET /v1/runs/{run}/fleet`` (scope ``subscribe``) lists the live replicas with their lag behind
the run's head, their last behavioural audit and their fingerprint group (a ``serving`` replica that
is the odd one out at its audited step is shown ``diverged``). See :mod:`deltasync.server._fleet` for ageing and bounds.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Response

from deltasync.protocol.audit import FingerprintGroup
from deltasync.server._auth import AUTH_RESPONSES, Report, Subscribe
from deltasync.server._deps import FleetDep, MetricsDep, RelayDep
from deltasync.server._fleet import FleetFull, Replica, shown
from deltasync.server._input import StrictRoute
from deltasync.server._models import AuditBody, FleetOut, Problem, ReplicaIn, ReplicaOut
from deltasync.server._routes import RunName
from deltasync.signal import REPLICA_PATTERN, ReplicaState

__all__ = ["ReplicaName", "fleet_router"]

ReplicaName = Annotated[str, Path(pattern=REPLICA_PATTERN, max_length=128, description="replica id")]

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
    dependencies=[Report],
    responses={**AUTH_RESPONSES, 429: {"model": Problem, "description": "the run's fleet (or the server) is full"}},
    tags=["fleet"],
)
async def report(
    run: RunName, replica: ReplicaName, body: ReplicaIn, fleet: FleetDep, relay: RelayDep, metrics: MetricsDep
) -> ReplicaOut:
    """Record what ``replica`` of ``run`` serves now (at each change, and as a heartbeat)."""
    try:
        entry, joined = fleet.report(
            run,
            replica,
            step=body.step,
            digest=body.digest,
            state=body.state,
            last_error=body.last_error,
            ttl_s=body.ttl_s,
            audit=None if body.audit is None else body.audit.report(),
        )
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
    dependencies=[Report],
    responses={**AUTH_RESPONSES, 404: {"model": Problem, "description": "no such live replica"}},
    tags=["fleet"],
)
async def leave(run: RunName, replica: ReplicaName, fleet: FleetDep) -> Response:
    """Remove ``replica`` from the run's fleet (it shut down cleanly; else it ages out)."""
    if not fleet.leave(run, replica):
        raise HTTPException(404, f"run {run!r} has no live replica {replica!r}")
    return Response(status_code=204)


@fleet_router.get("/v1/runs/{run}/fleet", dependencies=[Subscribe], responses=AUTH_RESPONSES, tags=["fleet"])
async def fleet_view(run: RunName, fleet: FleetDep, relay: RelayDep) -> FleetOut:
    """The run's live replicas, each with its step, lag behind the head, state and last error."""
    head = await relay.head_or_derive(run)
    now, replicas = fleet.replicas(run)
    digests: dict[int, str] = {}
    steps = {r.step for r in replicas if r.step is not None and r.digest is not None}
    for s in steps:
        c = head if head is not None and head.step == s else relay.db.get_commit(run, s)
        if c is not None:
            digests[s] = c.manifest_digest
    return FleetOut(
        run=run,
        head=head.step if head else None,
        time=now,
        replicas=[
            _out(r, head.step if head else None, digests.get(r.step) if r.step is not None else None, now, state, group)
            for r, state, group in shown(replicas)
        ],
    )
