"""FastAPI dependencies that hand the routes what :func:`~deltasync.server.app.create_app` built.

Routes never close over the app: they take the relay, settings and metrics from
``request.app.state`` through these functions, so a test can swap any of them
with ``app.dependency_overrides[get_relay] = ...``. They are ``async``: FastAPI runs a plain
``def`` dependency in a worker thread, a hop per dependency per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from deltasync.server._fleet import FleetBook
from deltasync.server._identity import ReplicaClaims
from deltasync.server._metrics import Metrics
from deltasync.server._policy import RunPolicies
from deltasync.server._relay import CommitRelay
from deltasync.server._settings import Settings

__all__ = [
    "ClaimsDep",
    "FleetDep",
    "MetricsDep",
    "PoliciesDep",
    "RelayDep",
    "SettingsDep",
    "get_claims",
    "get_fleet",
    "get_metrics",
    "get_policies",
    "get_relay",
    "get_settings",
]


async def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings`."""
    settings: Settings = request.app.state.settings
    return settings


async def get_relay(request: Request) -> CommitRelay:
    """The app's :class:`~deltasync.server._relay.CommitRelay` (heads, history, waiters, webhooks)."""
    relay: CommitRelay = request.app.state.relay
    return relay


async def get_metrics(request: Request) -> Metrics:
    """The app's Prometheus :class:`~deltasync.server._metrics.Metrics`."""
    metrics: Metrics = request.app.state.metrics
    return metrics


async def get_fleet(request: Request) -> FleetBook:
    """The app's :class:`~deltasync.server._fleet.FleetBook` (what each replica reported)."""
    fleet: FleetBook = request.app.state.fleet
    return fleet


SettingsDep = Annotated[Settings, Depends(get_settings)]
RelayDep = Annotated[CommitRelay, Depends(get_relay)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
FleetDep = Annotated[FleetBook, Depends(get_fleet)]


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
