"""Fail fast when a network store's endpoint cannot be reached at all.

huggingface_hub retries a refused or unroutable connection inside every call (5 retries,
1+2+4+8+8 s), so with no network an ``hf://`` command used to hang 24-27 s before failing.
:func:`check_reachable` asks the endpoint once (two short attempts) before a store's first
call: any HTTP answer, whatever its status, means reachable and the client's own retries stay
in charge of real transient errors (429, 5xx, a connection lost mid-run); no connection at all
raises :class:`~deltasync.errors.TransientStorageError` within a few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

from deltasync._util.retry import RetryPolicy, retry_call
from deltasync.errors import TransientStorageError

__all__ = ["check_reachable"]

_NO_CONNECTION = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol)
# the final error names every attempt; a line per retry of a two-attempt probe is noise (and would
# land on a CLI's stderr before its one error line)
_quiet = logging.getLogger("deltasync.storage.reach")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())


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
    ``attempts * timeout + (attempts - 1) * pause`` seconds in all (the shared
    :func:`~deltasync._util.retry.retry_call`, with a constant ``pause``; ``sleep`` is its wait).
    ``what`` starts the error message, ``hint`` ends it (which variables to check).
    """
    policy = RetryPolicy(retries=max(0, attempts - 1), backoff=pause, max_backoff=pause)
    tried = 0

    def probe() -> int:
        nonlocal tried
        tried += 1
        try:
            client.head(endpoint)
        except _NO_CONNECTION:
            raise
        except httpx.HTTPError:
            pass  # it connected: slow or odd, but there; the client's retries handle it
        return tried

    def give_up(exc: BaseException, n: int, stopped: bool) -> TransientStorageError:
        return TransientStorageError(
            f"{what}: cannot reach {endpoint} ({type(exc).__name__}: {exc}; {n} attempts): no network "
            f"connection, or a wrong {hint}. Check the connection and those settings"
        )

    with httpx.Client(timeout=httpx.Timeout(timeout), transport=transport, follow_redirects=False) as client:
        return retry_call(probe, policy, what, retry_on=_NO_CONNECTION, give_up=give_up, logger=_quiet, wait=sleep)
