"""The signal server (FastAPI), and re-exports of the httpx client that trainers and fetchers use.

The client lives in :mod:`deltasync.signal` (httpx only; the uploader and fetcher
import it from there, never from this package); ``deltasync.server.client``
re-exports it. ``deltasync.server.webhooks`` needs only the standard library;
:func:`create_app` needs the ``server`` extra (fastapi, uvicorn), which is
imported when it is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.server._settings import Settings, is_loopback
from deltasync.server.webhooks import WebhookVerifier, sign_webhook, verify_webhook
from deltasync.signal import CommitEvent, Notifier, SignalClient

if TYPE_CHECKING:
    from fastapi import FastAPI

    from deltasync.storage import Store

__all__ = [
    "CommitEvent",
    "Notifier",
    "Settings",
    "SignalClient",
    "WebhookVerifier",
    "create_app",
    "is_loopback",
    "sign_webhook",
    "verify_webhook",
]


def create_app(settings: Settings | None = None, store: Store | None = None, **kwargs: Any) -> FastAPI:
    """The signal server app (see :func:`deltasync.server.app.create_app`); needs the ``server`` extra."""
    from deltasync.server.app import create_app as _create_app

    return _create_app(settings, store, **kwargs)
