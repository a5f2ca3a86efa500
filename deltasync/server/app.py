"""The signal server: :func:`create_app` wires the routes to a :class:`~deltasync.server._relay.CommitRelay`.

Run it with ``deltasync serve`` (uvicorn). Routes are versioned under ``/v1``; see
docs/signal-server.md. The parts live in their own modules:
request/response models (``_models``), token scopes (``_auth``), strict input
parsing (``_input``), the body limit (``_limits``), the SSE stream (``_sse``)
and the routes (``_routes``, which read the relay and settings from ``app.state``
through the dependencies in ``_deps``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from deltasync._util.prometheus import sample
from deltasync.server._db import Database
from deltasync.server._fleet import FleetBook
from deltasync.server._fleet_routes import ReportLane, fleet_router
from deltasync.server._identity import ReplicaClaims
from deltasync.server._input import validation_error_reply
from deltasync.server._limits import BodyLimit, limit_body
from deltasync.server._metrics import Metrics
from deltasync.server._policy import RunPolicies
from deltasync.server._relay import CommitRelay, Conflict, NotInStore, StoreUnavailable
from deltasync.server._routes import router
from deltasync.server._settings import Settings
from deltasync.signal import REPLICA_STATES
from deltasync.storage import Store, open_store

__all__ = ["create_app", "limit_body"]

log = logging.getLogger("deltasync.server")


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


def _metrics() -> Metrics:
    metrics = Metrics()
    metrics.declare("deltasync_commits_total", "counter", "Commits recorded (source: publish or store).")
    metrics.declare("deltasync_commits_rejected_total", "counter", "Publishes refused with 409/422, by reason.")
    metrics.declare("deltasync_head_step", "gauge", "Newest recorded step per run.")
    metrics.declare("deltasync_auth_failures_total", "counter", "Requests refused with 401 or 403.")
    metrics.declare("deltasync_sse_events_sent_total", "counter", "Commit events written to SSE streams.")
    metrics.declare("deltasync_webhook_deliveries_total", "counter", "Webhook deliveries by final outcome.")
    metrics.declare("deltasync_webhook_attempts_failed_total", "counter", "Failed webhook attempts (incl. retried).")
    metrics.declare("deltasync_fleet_reports_total", "counter", "Replica reports recorded (changes and heartbeats).")
    metrics.declare("deltasync_fleet_reports_refused_total", "counter", "Replica reports refused: the fleet is full.")
    metrics.declare("deltasync_fleet_joined_total", "counter", "Replicas that joined a run's fleet.")
    metrics.declare("deltasync_fleet_expired_total", "counter", "Replicas dropped after their time to live.")
    metrics.declare(
        "deltasync_fleet_identity_refused_total",
        "counter",
        "Replica reports or goodbyes refused: the id is held by a replica token (403) or another lease (409).",
    )
    metrics.declare(
        "deltasync_fleet_evicted_total", "counter", "Unbound replicas evicted from a full run by a bound replica."
    )
    return metrics


def _fleet_gauges(metrics: Metrics, fleet: FleetBook, relay: CommitRelay) -> None:
    """``deltasync_fleet_replicas{run,state}`` (the states the fleet view shows),
    ``deltasync_fleet_max_lag{run}`` and ``deltasync_replica_divergence{run,replica,step,stat}``,
    computed when scraped (``/metrics`` renders in a worker thread): the states from the book's
    cached groups, which only the audited steps changed since the last read regroup."""

    def by_state() -> dict[tuple[tuple[str, str], ...], float]:
        out: dict[tuple[tuple[str, str], ...], float] = {}
        for run, counts in fleet.state_counts().items():
            for state in REPLICA_STATES:
                out[(("run", run), ("state", state))] = counts[state]
        return out

    rendered: dict[str, tuple[int, str]] = {}  # run -> (its fleet's version, its divergence lines)
    rendering = threading.Lock()

    def divergence() -> str:
        with rendering:  # scrapes render in worker threads: one at a time here
            return _divergence()

    def _divergence() -> str:
        versions = fleet.versions()
        stale = {run for run, v in versions.items() if rendered.get(run, (-1, ""))[0] != v}
        for run in set(rendered) - set(versions):
            del rendered[run]
        if stale:
            replicas = fleet.runs()[1]
            for run in stale & set(replicas):
                lines = []
                for r in sorted(replicas[run], key=lambda r: r.replica):
                    d = r.audit.divergence if r.audit is not None else None
                    if r.audit is None or d is None:
                        continue
                    for stat, v in d.to_dict().items():
                        labels = (
                            ("replica", r.replica),
                            ("run", run),
                            ("stat", stat),
                            ("step", str(r.audit.audited_step)),
                        )
                        lines.append(sample("deltasync_replica_divergence", v, labels))
                rendered[run] = (versions[run], "".join(lines))
        return "".join(rendered[run][1] for run in sorted(rendered))

    def max_lag() -> dict[tuple[tuple[str, str], ...], float]:
        out: dict[tuple[tuple[str, str], ...], float] = {}
        for run, replicas in fleet.runs()[1].items():
            head = relay.head(run)
            lags = [head.step - r.step for r in replicas if head is not None and r.step is not None]
            if lags:
                out[(("run", run),)] = max(lags)
        return out

    metrics.gauge_callback("deltasync_fleet_replicas", "Live replicas per run and state.", by_state)

    def cached() -> bool:
        with rendering:
            return fleet.counted({run: v for run, (v, _) in rendered.items()})

    metrics.cached = cached  # /metrics renders on the event loop only when this holds
    metrics.text_callback(
        "deltasync_replica_divergence",
        "gauge",
        "Each live replica's last audit against the trainer's reference, per audited step (nats; stat: "
        "mean_abs, max_abs, kl).",
        divergence,
    )
    metrics.gauge_callback(
        "deltasync_fleet_max_lag", "Steps the most stale live replica of a run is behind its head.", max_lag
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
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


async def _conflict(request: Request, exc: Exception) -> Response:
    return JSONResponse({"detail": str(exc)}, status_code=409)


async def _store_down(request: Request, exc: Exception) -> Response:
    return JSONResponse({"detail": str(exc)}, status_code=503)


async def _not_in_store(request: Request, exc: Exception) -> Response:
    request.app.state.metrics.inc("deltasync_commits_rejected_total", reason="not_in_store")
    # the shape of FastAPI's validation errors, so that 422 has one documented schema
    detail = [{"type": "not_in_store", "loc": ["body", "step"], "msg": str(exc), "input": None}]
    return JSONResponse({"detail": detail}, status_code=422)


def create_app(
    settings: Settings | None = None,
    store: Store | None = None,
    *,
    webhook_transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The signal server as a FastAPI app.

    ``store`` (or ``settings.store_url``) makes the server check every published
    step against the store and derive unknown runs' heads from it.
    ``webhook_transport`` replaces the network for webhook deliveries (tests); ``clock`` is the
    wall clock of the fleet view (its ``last_seen`` and ageing; tests inject one).
    The relay, settings and metrics are in ``app.state``; routes reach them through
    :func:`~deltasync.server._deps.get_relay` & co, which ``app.dependency_overrides`` can replace.
    """
    settings = settings or Settings()
    metrics = _metrics()
    db = Database(settings.db_path)
    store_for, opened = _store_factory(settings, store)
    relay = CommitRelay(settings, db, store_for, metrics, webhook_transport)
    for run in db.runs():
        head0 = db.head(run)
        if head0 is not None:
            metrics.set("deltasync_head_step", head0.step, run=run)
    metrics.gauge_callback(
        "deltasync_sse_subscribers",
        "Open SSE streams per run.",
        lambda: {(("run", r),): n for r, n in dict(relay.subscribers).items()},  # a copy: scraped off the loop
    )

    fleet = FleetBook(
        ttl_s=settings.fleet_ttl_s,
        max_replicas=settings.max_replicas,
        max_runs=settings.max_fleet_runs,
        clock=clock,
        on_expire=lambda n: metrics.inc("deltasync_fleet_expired_total", n),
        on_evict=lambda n: metrics.inc("deltasync_fleet_evicted_total", n),
    )
    _fleet_gauges(metrics, fleet, relay)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await relay.aclose()
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
    app.state.relay = relay
    app.state.fleet = fleet
    # who holds each replica id (docs/fleet.md), and each run's audit policy (its probes.json)
    app.state.claims = ReplicaClaims(clock=clock, max_replicas=settings.max_replicas, max_runs=settings.max_fleet_runs)
    app.state.policies = RunPolicies(store_for, clock=clock, max_runs=settings.max_fleet_runs)
    # the report lane (deltasync.server._fleet_routes.ReportLane); False: every report goes through FastAPI
    app.state.fast_reports = True
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, validation_error_reply)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(StoreUnavailable, _store_down)
    app.add_exception_handler(NotInStore, _not_in_store)
    # the fleet routes first: a heartbeat (the most frequent request, ~437/s at 4,096 replicas) is
    # matched without trying every other route first (the paths do not overlap)
    app.include_router(fleet_router)
    app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ReportLane, max_bytes=settings.max_body_bytes)  # outside BodyLimit: it bounds its own read
    return app
