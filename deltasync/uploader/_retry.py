"""Retrying the commit's store writes, and making a repeated write harmless.

Only :class:`~deltasync.errors.TransientStorageError` is retried (throttling, 5xx,
timeouts, partial batches); anything else fails the commit at once. Writes are
create-only; when a retry finds some of its objects already there (a partial batch,
or a lost reply), :func:`put_idempotent` reads them back: the same bytes count as
written, other bytes are a real conflict (AlreadyExists).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from deltasync.errors import AlreadyExists, CommitFailed, TransientStorageError
from deltasync.storage import Store
from deltasync.storage.base import Data

__all__ = ["RetryPolicy", "put_idempotent", "with_retries"]

log = logging.getLogger("deltasync.uploader")
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


def with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    wait: Callable[[float], object] | None = None,
) -> T:
    """Call ``fn``; on TransientStorageError wait and call again, up to ``policy.retries`` times.

    Gives up with :class:`CommitFailed` naming ``what``, the attempts and the last cause.
    ``wait`` defaults to an Event wait (injectable for tests).
    """
    pause = wait if wait is not None else threading.Event().wait
    attempt = 0
    while True:
        try:
            return fn()
        except TransientStorageError as exc:
            if attempt >= policy.retries:
                raise CommitFailed(f"{what}: gave up after {attempt + 1} attempts: {exc}") from exc
            delay = policy.delay(attempt)
            log.warning("%s: %s; retry %d/%d in %.2f s", what, exc, attempt + 1, policy.retries, delay)
            pause(delay)
            attempt += 1


def _payload_bytes(data: Data) -> bytes:
    return data.read_bytes() if isinstance(data, Path) else memoryview(data).cast("B").tobytes()


def put_idempotent(store: Store, items: Mapping[str, Data]) -> None:
    """Create-only write of ``items``; objects already holding exactly these bytes count as written."""
    try:
        store.put_many(items, mode="create")
        return
    except AlreadyExists:
        pass
    keys = list(items)
    common = os.path.commonprefix(keys)
    present = {o.key for o in store.list(common)} & set(keys)
    if present:
        stored = store.get_many(sorted(present))
        clash = sorted(k for k in present if stored[k] != _payload_bytes(items[k]))
        if clash:
            raise AlreadyExists(f"{store.url}: {clash[0]} already exists with other content")
    rest = {k: v for k, v in items.items() if k not in present}
    if rest:
        store.put_many(rest, mode="create")
