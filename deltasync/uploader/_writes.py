"""The uploader's store writes: retried on transient errors, harmless when repeated.

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
from pathlib import Path
from typing import TypeVar

from deltasync._util.retry import RetryPolicy, retry_call
from deltasync.errors import AlreadyExists, CommitFailed, TransientStorageError
from deltasync.storage import Store
from deltasync.storage.base import Data

__all__ = ["RetryPolicy", "put_idempotent", "with_retries"]

log = logging.getLogger("deltasync.uploader")
T = TypeVar("T")


def with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    stop: threading.Event | None = None,
    wait: Callable[[float], object] | None = None,
) -> T:
    """Call ``fn``; on TransientStorageError wait and call again, up to ``policy.retries`` times.

    Gives up with :class:`CommitFailed` naming ``what``, the attempts and the last cause; when
    ``stop`` is set (the uploader is closing) it gives up at once instead of waiting out a backoff.
    ``wait`` replaces the Event wait in tests.
    """

    def give_up(exc: BaseException, attempts: int, stopped: bool) -> BaseException:
        if stopped:
            return CommitFailed(f"{what}: stopped after {attempts} attempts (the uploader is closing): {exc}")
        return CommitFailed(f"{what}: gave up after {attempts} attempts: {exc}")

    return retry_call(
        fn, policy, what, retry_on=(TransientStorageError,), stop=stop, give_up=give_up, logger=log, wait=wait
    )


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
