"""Fail fast when a network store's endpoint cannot be reached at all.

huggingface_hub retries a refused or unroutable connection inside every call (5 retries,
1+2+4+8+8 s), so with no network an ``hf://`` command used to hang 24-27 s before failing.
:func:`check_reachable` asks the endpoint once (two short attempts) before a store's first
call: any HTTP answer, whatever its status, means reachable and the client's own retries stay
in charge of real transient errors (429, 5xx, a connection lost mid-run); no connection at all
raises :class:`~deltasync.errors.TransientStorageError` within a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from deltasync.errors import TransientStorageError

__all__ = ["check_reachable"]


def check_reachable(
    endpoint: str,
    *,
    what: str,
    hint: str,
    attempts: int = 2,
    pause: float = 0.5,
    timeout: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Return the attempt (1-based) at which ``endpoint`` answered; raise when none did.

    Each attempt is one ``HEAD endpoint`` with a ``timeout``-second connect limit (proxy
    variables apply, as for the client itself), ``pause`` seconds apart: at most
    ``attempts * timeout + (attempts - 1) * pause`` seconds in all. ``what`` starts the
    error message, ``hint`` ends it (which variables to check).
    """
    last: Exception | None = None
    with httpx.Client(timeout=httpx.Timeout(timeout), transport=transport, follow_redirects=False) as client:
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                sleep(pause)
            try:
                client.head(endpoint)
                return attempt
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol) as exc:
                last = exc
            except httpx.HTTPError:
                return attempt  # it connected: slow or odd, but there; the client's retries handle it
    raise TransientStorageError(
        f"{what}: cannot reach {endpoint} ({type(last).__name__}: {last}; {attempts} attempts): no network "
        f"connection, or a wrong {hint}. Check the connection and those settings"
    ) from last
