"""The one retry policy: exponential backoff whose waits a stop event cuts short.

Every loop that retries (the uploader's store writes, the notifier's publishes, webhook
deliveries, the step watcher's reconnects, the vLLM prefetcher's failed steps) takes a
:class:`RetryPolicy` and waits with :meth:`RetryPolicy.wait` or :func:`retry_call` on a
``threading.Event`` that its owner's ``close()`` sets, so closing never sits out a backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "RetryPolicy", "retry_call"]

log = logging.getLogger("deltasync.retry")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``retries`` extra attempts after the first, waiting ``backoff * 2**i`` seconds (capped)."""

    retries: int = 4
    backoff: float = 0.5
    max_backoff: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("retry backoff must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return float(min(self.max_backoff, self.backoff * (2**attempt)))

    def backoff_state(self) -> Backoff:
        """A fresh :class:`Backoff` following this policy (for loops that retry forever)."""
        return Backoff(self)


class Backoff:
    """The running backoff of an open-ended loop (reconnects, a step that keeps failing):
    :meth:`next_delay` grows by the policy, :meth:`reset` after a success."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.attempt = 0

    def next_delay(self) -> float:
        """The wait before the next attempt; each call doubles the following one (capped)."""
        d = self.policy.delay(self.attempt)
        self.attempt += 1
        return d

    def reset(self) -> None:
        """Back to the first delay (after a success)."""
        self.attempt = 0


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    retry_on: tuple[type[BaseException], ...],
    stop: threading.Event | None = None,
    give_up: Callable[[BaseException, int, bool], BaseException] | None = None,
    logger: logging.Logger = log,
    wait: Callable[[float], object] | None = None,
) -> T:
    """Call ``fn``; on an exception of ``retry_on`` wait ``policy.delay(i)`` and call again.

    Waits are ``stop.wait(delay)`` (``wait`` replaces it in tests; a true return means stopped):
    when ``stop`` is set (its owner is closing) the loop ends at once. On the last failure, or a stop, raises ``give_up(exc, attempts, stopped)`` when
    given (chained from the cause), else the last exception itself.
    """
    if wait is None:
        wait = (stop if stop is not None else threading.Event()).wait
    attempt = 0
    while True:
        try:
            return fn()
        except retry_on as exc:
            stopped = stop is not None and stop.is_set()
            if attempt >= policy.retries or stopped:
                if give_up is None:
                    raise
                raise give_up(exc, attempt + 1, stopped) from exc
            delay = policy.delay(attempt)
            logger.warning("%s: %s; retry %d/%d in %.2f s", what, exc, attempt + 1, policy.retries, delay)
            if wait(delay):
                if give_up is None:
                    raise
                raise give_up(exc, attempt + 1, True) from exc
            attempt += 1
