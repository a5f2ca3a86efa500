"""Garbage collection of a run prefix: read the run, plan (pure), re-read, delete in order.

:func:`collect_garbage` is what ``deltasync gc`` and the uploader's ``keep_anchors``
option run. The planning rule is :func:`deltasync.protocol.retention.plan_retention`;
this module only reads the store, runs the planner twice and deletes what both plans
agree on:

1. one listing of the prefix; the manifests of listed steps, the writer claims and the
   leases (manifests are immutable: they are read once and cached for the second round);
2. plan; then list again and re-read the claims and every lease, and plan again, so that
   a step committed, a span published or a lease taken while gc planned is seen;
3. delete only keys that both plans delete: manifests first (one batch per 1000 keys),
   then data files, orphans and expired leases.

Nothing here depends on conditional writes (the HF Bucket API has none). What is left
racy is documented in SPEC.md ("Retention and leases"): a lease written after step 2's
re-read does not protect its holder, who then re-plans (the newest step is never deleted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from deltasync._util.worker import SerialWorker, WorkerClosed
from deltasync.errors import DeltaSyncError, ObjectTooLarge
from deltasync.protocol import Committed, WriterClaim, manifest_key, parse_manifest_key, parse_writer_key
from deltasync.protocol.manifest import MAX_MANIFEST_BYTES
from deltasync.protocol.retention import MAX_LEASE_BYTES, Lease, RetentionPlan, parse_lease_key, plan_retention
from deltasync.protocol.writers import MAX_CLAIM_BYTES
from deltasync.run.manifests import parse_committed
from deltasync.run.reader import get_present
from deltasync.storage.base import ObjectInfo, Store

__all__ = ["GcReport", "RetentionWorker", "collect_garbage"]

log = logging.getLogger("deltasync.gc")
T = TypeVar("T")

#: keys per delete_many / get_many batch
BATCH = 1000


@dataclass(frozen=True, slots=True)
class GcReport:
    """What one gc did (or, with ``dry_run``, would do): the plan executed and the keys deleted."""

    plan: RetentionPlan
    dry_run: bool
    deleted: int
    listed_steps: int


@dataclass(slots=True)
class _State:
    listing: list[ObjectInfo]
    committed: dict[int, Committed]
    claims: list[WriterClaim]
    leases: dict[str, Lease | None]


def _batched(items: Sequence[T], n: int = BATCH) -> list[Sequence[T]]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def _parse(step: int, body: bytes, signing_key: bytes | None) -> Committed | None:
    """The step's manifest, or None when it does not parse or verify (gc leaves such a step alone)."""
    try:
        return parse_committed(step, body, signing_key=signing_key)
    except DeltaSyncError:
        return None


def _read(store: Store, cache: dict[int, Committed | None], signing_key: bytes | None) -> _State:
    """One listing of the prefix, then every manifest not cached yet, every claim and every lease."""
    listing = store.list("")
    steps = [s for o in listing if (s := parse_manifest_key(o.key)) is not None]
    want = [s for s in steps if s not in cache]
    for steps_batch in _batched(want, 256):
        refused: dict[str, ObjectTooLarge] = {}
        bodies = get_present(store, dict.fromkeys(map(manifest_key, steps_batch), MAX_MANIFEST_BYTES), refused)
        for s in steps_batch:
            body = bodies.get(manifest_key(s))
            if manifest_key(s) in refused:
                cache[s] = None  # over a manifest's limit: as one that does not parse
            elif body is not None:  # a manifest gone since the listing: read again next round
                cache[s] = _parse(s, body, signing_key)
    claim_keys = [o.key for o in listing if parse_writer_key(o.key) is not None]
    lease_keys = [o.key for o in listing if parse_lease_key(o.key) is not None]
    bodies = {}
    for batch in _batched(claim_keys + lease_keys):
        limits = {k: MAX_LEASE_BYTES if parse_lease_key(k) is not None else MAX_CLAIM_BYTES for k in batch}
        bodies.update(get_present(store, limits, {}))  # one over its limit is left out, as one that does not parse
    claims = []
    for key in claim_keys:
        try:
            claim = WriterClaim.from_json(bodies[key])
        except (KeyError, DeltaSyncError):
            continue
        if claim.epoch == parse_writer_key(key):
            claims.append(claim)
    leases: dict[str, Lease | None] = {}
    for key in lease_keys:
        if key not in bodies:
            continue  # released since the listing
        try:
            lease: Lease | None = Lease.from_json(bodies[key])
        except DeltaSyncError:
            lease = None
        leases[key] = lease if lease is None or parse_lease_key(key) == lease.id else None
    committed = {s: c for s in steps if (c := cache.get(s)) is not None}
    return _State(listing, committed, claims, leases)


def collect_garbage(
    store: Store,
    *,
    keep_anchors: int,
    grace: float = 3600.0,
    dry_run: bool = False,
    clock: Callable[[], float] = time.time,
    signing_key: bytes | None = None,
    on_planned: Callable[[RetentionPlan], None] | None = None,
) -> GcReport:
    """Delete what the retention rule says is garbage under ``store`` (see module docstring).

    keep_anchors: the number of newest anchors kept (>= 1); grace: seconds an orphan file
    must be old before it goes; dry_run: plan only, delete nothing; clock: unix seconds
    (compared with lease expiries and listed modification times); signing_key: manifests
    that are not validly signed are left alone, as are any that do not parse.
    on_planned: called with the first plan before the second reading (a test seam).
    Raises ValueError for a bad ``keep_anchors``/``grace``, StorageError when the store fails.
    """
    cache: dict[int, Committed | None] = {}

    def plan(state: _State) -> RetentionPlan:
        return plan_retention(
            state.listing,
            state.committed,
            state.claims,
            state.leases,
            now=clock(),
            keep_anchors=keep_anchors,
            grace=grace,
        )

    first = _read(store, cache, signing_key)
    planned = plan(first)
    listed = sum(1 for o in first.listing if parse_manifest_key(o.key) is not None)
    if on_planned is not None:
        on_planned(planned)
    if dry_run or not planned.keys:
        return GcReport(planned, dry_run, 0, listed)
    again = plan(_read(store, cache, signing_key))
    final = again.restricted_to(planned.keys)
    for phase in (final.first, final.then):
        for batch in _batched(phase):
            store.delete_many(batch)
    deleted = len(final.first) + len(final.then)
    log.info(
        "gc of %s: deleted %d steps, %d spans, %d orphan files, %d expired leases (%d keys, %d bytes)",
        store.url,
        len(final.deleted_steps),
        len(final.deleted_spans),
        len(final.orphans),
        len(final.expired_leases),
        deleted,
        final.delete_bytes,
    )
    return GcReport(final, False, deleted, listed)


class RetentionWorker:
    """Runs :func:`collect_garbage` on a background :class:`~deltasync._util.worker.SerialWorker` when
    :meth:`trigger`\\ ed.

    Triggers while a gc runs fold into one more run after it (at most one gc waits). A failed gc
    is logged and counted (``failures``, ``last_error``), never raised. The uploader's
    ``keep_anchors`` option triggers one after each committed anchor.
    """

    def __init__(
        self,
        store: Store,
        keep_anchors: int,
        *,
        grace: float = 3600.0,
        signing_key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(keep_anchors, bool) or not isinstance(keep_anchors, int) or keep_anchors < 1:
            raise ValueError(f"keep_anchors must be an integer >= 1, got {keep_anchors!r}")
        self.store = store
        self.keep_anchors = keep_anchors
        self.grace = grace
        self.signing_key = signing_key
        self.clock = clock
        # written by the worker's thread only; read after wait_idle()
        self.runs = 0
        self.failures = 0
        self.last_error: BaseException | None = None
        self.last_report: GcReport | None = None
        self._worker = SerialWorker("deltasync-gc")

    def trigger(self) -> None:
        """Ask for a gc; returns at once (does nothing once closed)."""
        try:
            self._worker.submit(self._collect, coalesce="gc")
        except WorkerClosed:
            return

    def _collect(self) -> None:
        try:
            report = collect_garbage(
                self.store,
                keep_anchors=self.keep_anchors,
                grace=self.grace,
                clock=self.clock,
                signing_key=self.signing_key,
            )
        except Exception as exc:  # noqa: BLE001 - gc never fails a commit: logged and counted
            self.failures += 1
            self.last_error = exc
            log.warning("background gc of %s failed (the run is unaffected; next anchor retries): %s", self.store, exc)
            return
        self.runs += 1
        self.last_report = report

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no gc runs or is pending; False on timeout."""
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the gc that runs now (pending ones are dropped); waits up to ``timeout``."""
        self._worker.close(cancel_pending=True, timeout=timeout)
