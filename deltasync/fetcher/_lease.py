"""Fetcher leases and fetching through a concurrent gc (SPEC.md "Retention and leases").

A fetcher with ``lease_ttl`` writes ``leases/{id}.json`` at the start of each sync (the step
it holds and the step it is fetching) and after it (the step it now holds), so that
``deltasync gc`` keeps what it needs until the lease expires. Independently of leases, a
fetch whose planned files vanish (gc deleted them after the plan was made) re-plans once
from a fresh listing instead of failing: the target then loads the nearest kept anchor
(:meth:`deltasync.fetcher._sync.Sync.run` for a sync, :func:`run_leased` for a materialize).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from deltasync.errors import ChainBroken, DeltaSyncError, ObjectNotFound
from deltasync.fetcher._download import PlanFilesGone
from deltasync.fetcher._source import Source
from deltasync.protocol import manifest_key
from deltasync.protocol.retention import Lease, lease_key
from deltasync.storage import Store

__all__ = ["LeaseWriter", "dir_step", "run_leased", "still_committed", "unreachable_after_gc"]

log = logging.getLogger("deltasync.fetcher")
T = TypeVar("T")


class LeaseWriter:
    """Writes one fetcher's lease, ``leases/{lease_id}.json``, valid ``ttl`` seconds from each renewal.

    A failed write is logged and counted (``failures``), never raised: without its lease a
    fetcher is only as safe as any other (it may have to reload an anchor).
    """

    def __init__(
        self, store: Store, ttl: float, lease_id: str | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {ttl!r}")
        self.store = store
        self.ttl = float(ttl)
        self.id = lease_id or f"fetcher-{uuid.uuid4().hex[:12]}"
        self.key = lease_key(self.id)
        self.clock = clock
        self.failures = 0
        self.last: Lease | None = None

    def renew(self, step: int | None, target: int | None) -> Lease | None:
        """Write the lease: holding ``step``, fetching ``target``. Returns it (None when the write failed)."""
        lease = Lease.expiring(self.id, step, target, self.clock(), self.ttl)
        try:
            self.store.put(self.key, lease.to_json())
        except DeltaSyncError as exc:
            self.failures += 1
            log.warning("cannot write lease %s (gc will not know what this fetcher needs): %s", self.key, exc)
            return None
        self.last = lease
        return lease

    def release(self) -> None:
        """Delete the lease (a fetcher that stops following)."""
        try:
            self.store.delete_many([self.key])
        except DeltaSyncError as exc:
            log.warning("cannot delete lease %s (it expires by itself): %s", self.key, exc)
        self.last = None


def dir_step(out: str | os.PathLike[str]) -> int | None:
    """The step a materialized dir holds (its ``.deltasync.json`` marker), or None."""
    try:
        step = json.loads((Path(out) / ".deltasync.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def still_committed(store: Store, steps: tuple[int, ...]) -> bool:
    """Whether every one of ``steps`` still has its manifest (gc deletes a step's manifest first)."""
    try:
        return bool(steps) and all(store.exists(manifest_key(s)) for s in steps)
    except DeltaSyncError:
        return False


def unreachable_after_gc(target: int, again: DeltaSyncError) -> ChainBroken:
    """The error of a fetch whose plan lost files to gc even after re-planning from a fresh listing."""
    return ChainBroken(
        f"step {target}: files of the plan were deleted from the store while syncing (garbage "
        f"collection?) and re-planning from a fresh listing did not help: {again}. Sync to the "
        "latest step, or keep a lease (lease_ttl) while fetching older steps"
    )


def run_leased(
    source: Source,
    lease: LeaseWriter | None,
    step: int | None,
    held: Callable[[], int | None],
    once: Callable[[int], T],
) -> T:
    """Run ``once(target_step)`` (a materialize) under the fetcher's ``lease``.

    When a file of the plan is gone (gc deleted it between planning and downloading), or
    the latest step just resolved is gone (``step`` None), re-plan once from a fresh
    listing; if the target is no longer reachable, raise ChainBroken saying so. ``once``
    must be all or nothing, as materialize is.
    """
    target = source.target_step(step)
    if lease is not None:
        lease.renew(held(), target)
    try:
        result = once(target)
    except (ObjectNotFound, ChainBroken) as exc:
        if not isinstance(exc, PlanFilesGone) and step is not None:
            raise
        log.info("step %d: %s; re-planning from a fresh listing", target, exc)
        source.reader.relist()
        try:
            target = source.target_step(step)  # an asked step that gc collected is not committed any more
            if lease is not None:
                lease.renew(held(), target)
            result = once(target)
        except (PlanFilesGone, ChainBroken) as again:
            if isinstance(again, PlanFilesGone) and still_committed(source.store, again.steps):
                raise  # the steps are still committed: a file is missing, not collected (an incomplete store)
            raise unreachable_after_gc(target, again) from again
    if lease is not None:
        lease.renew(target, None)
    return result
