"""FastAPI dependencies that hand the routes what :func:`~deltasync.server.app.create_app` built.

Routes never close over the app: they take the hub, settings and metrics from
``request.app.state`` through these functions, so a test can swap any of them
with ``app.dependency_overrides[get_hub] = ...``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from deltasync.server._hub import Hub
from deltasync.server._metrics import Metrics
from deltasync.server._settings import Settings

__all__ = ["HubDep", "MetricsDep", "SettingsDep", "get_hub", "get_metrics", "get_settings"]


def get_settings(request: Request) -> Settings:
    """The app's :class:`Settings`."""
    settings: Settings = request.app.state.settings
    return settings


def get_hub(request: Request) -> Hub:
    """The app's :class:`~deltasync.server._hub.Hub` (heads, history, waiters, webhooks)."""
    hub: Hub = request.app.state.hub
    return hub


def get_metrics(request: Request) -> Metrics:
    """The app's Prometheus :class:`~deltasync.server._metrics.Metrics`."""
    metrics: Metrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
HubDep = Annotated[Hub, Depends(get_hub)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
