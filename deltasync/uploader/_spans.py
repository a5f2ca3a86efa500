"""Writing spans: committed patches squashed at power-of-b boundaries (SPEC.md "Spans").

With levels ``(4, 16, 64)`` the uploader writes, after the 4th, 8th, ... patch
since an anchor, a span over the last 4 patches; after the 16th, 32nd, ... one
over the last 16 (composed from the four 4-spans), and so on. A replica many
steps behind then downloads a few spans instead of every patch. Composition is
hierarchical (level ``j`` composes level ``j - 1``'s spans), so only the newest
partial composition of each level is held in memory. Spans never cross an
anchor. Everything runs on its own :class:`~deltasync._util.worker.SerialWorker` after
the step's commit: a span never delays a commit, and a failed span write is logged
and counted, never raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from deltasync._util.retry import RetryPolicy
from deltasync._util.worker import SerialWorker
from deltasync.errors import AlreadyExists
from deltasync.protocol import (
    SPAN_OF,
    Committed,
    FileInfo,
    Manifest,
    Stats,
    span_file_key,
    span_manifest_key,
    xxh3_128,
)
from deltasync.storage import Store
from deltasync.uploader._commit_step import GROUP_NUMEL, build_patch, put_idempotent, with_retries
from deltasync.uploader._config import check_levels
from deltasync.uploader._diff import TensorDiff
from deltasync.uploader._job import StepJob, changed_count, merge_change_sets

__all__ = ["SpanWriter", "merge_change_sets"]

log = logging.getLogger("deltasync.uploader")

Changes = Mapping[str, TensorDiff]

#: a level's composition is dropped once it changes more than this fraction of all elements: its
#: memory (12 bytes per changed bf16 element) would pass the state's, and an anchor is close in size
SPAN_MAX_DENSITY = 0.125
SPAN_MEMORY_FLOOR = 64 << 20  # bytes: below this a composition is kept whatever its density


@dataclass(slots=True)
class _Partial:
    """A level's composition in progress: the changes of ``count`` patches since step ``start``."""

    start: Committed
    count: int = 0
    changes: Changes = field(default_factory=dict)


class SpanWriter:
    """Composes committed patches into spans and writes them on a background worker.

    ``submit`` is called by the commit thread after each commit (cheap: it queues
    the step's changes). ``written``, ``failures`` and ``skipped`` count spans
    written, span writes that failed, and steps not composed because the queue
    was full (composition then restarts from the next step).
    """

    def __init__(
        self,
        store: Store,
        levels: Sequence[int],
        *,
        shard_bytes: int,
        signing_key: bytes | None,
        retry: RetryPolicy,
        pool: Executor | None = None,
        max_queue: int = 16,
    ) -> None:
        self.store = store
        self.levels = check_levels(levels)
        self.shard_bytes = shard_bytes
        self.signing_key = signing_key
        self.retry = retry
        self.pool = pool
        self.max_queue = max_queue
        self.written = 0
        self.failures = 0
        self.skipped = 0
        self.nbytes = 0
        self._lock = threading.Lock()
        self._queued = 0  # steps submitted whose composition has not started
        self._last: Committed | None = None  # the newest step composed
        self._partial: list[_Partial | None] = [None] * len(self.levels)
        self._worker = SerialWorker("deltasync-spans")

    # ------------------------------------------------------------ commit side

    def submit(self, committed: Committed, changes: Changes | None) -> None:
        """Queue a committed step: a patch with its changes, or an anchor (``changes`` None)."""
        with self._lock:
            if self._queued >= self.max_queue:
                self.skipped += 1  # the next step no longer continues the composition: it restarts
                return
            self._queued += 1
        self._worker.submit(lambda: self._compose(committed, changes))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued step is composed and its spans written; False on timeout."""
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queue, then stop the worker."""
        self._worker.flush(timeout)
        self._worker.close(timeout=timeout)

    # ------------------------------------------------------------ span worker

    def _compose(self, committed: Committed, changes: Changes | None) -> None:
        with self._lock:
            self._queued -= 1
        try:
            self._take(committed, changes)
        except Exception:  # noqa: BLE001 - spans are an optimisation: never fail the run
            log.exception(
                "composing spans at step %d failed; spans restart at the next anchor", committed.manifest.step
            )
            self.failures += 1
            self._last, self._partial = None, [None] * len(self.levels)

    def _take(self, c: Committed, changes: Changes | None) -> None:
        m = c.manifest
        last = self._last
        self._last = c
        if m.kind == "anchor" or changes is None or last is None or m.parent_digest != last.digest:
            # an anchor, or a step that does not continue what was composed (a skipped step, a
            # resumed chain): boundaries count from it, so no span ever crosses an anchor
            self._partial = [None] * len(self.levels)
            return
        unit = _Partial(last, 1, changes)
        total = sum(t.numel for t in m.inventory)
        for j, size in enumerate(self.levels):
            p = self._partial[j]
            if p is None:
                p = self._partial[j] = _Partial(unit.start, 0, {})
            p.changes = merge_change_sets(p.changes, unit.changes) if p.changes else unit.changes
            p.count += unit.count
            held = changed_count(p.changes)
            if held > SPAN_MAX_DENSITY * total and held * 12 > SPAN_MEMORY_FLOOR:
                # a composition this dense holds more memory than the state and saves little over
                # an anchor: drop it and every level above, and count again from this step
                self.skipped += 1
                self._partial[j:] = [None] * (len(self.levels) - j)
                return
            if p.count < size:
                return
            self._partial[j] = None
            self._write(p.start, c, p.changes)
            unit = p

    def _write(self, start: Committed, end: Committed, changes: Changes) -> None:
        m = end.manifest
        try:
            job = StepJob(m.step, "patch", m.inventory, changes=changes)
            # the span's files are the writer's own, as the step's are (SPEC.md "Commit rule")
            own = m.writer.id if m.writer is not None else None
            grouped = GROUP_NUMEL if m.format_version >= 2 else 0
            files, entries = build_patch(job, self.shard_bytes, self.pool, writer_id=own, group_numel=grouped)
            infos = tuple(FileInfo(name, len(data), xxh3_128(data)) for name, data in sorted(files.items()))
            span = Manifest(
                run_id=m.run_id,
                step=m.step,
                kind="patch",
                parent_step=start.manifest.step,
                parent_digest=start.digest,
                anchor_step=m.anchor_step,
                inventory=m.inventory,
                inventory_digest=m.inventory_digest,
                files=infos,
                entries=tuple(entries),
                tensor_digests=dict(m.tensor_digests),
                stats=Stats(changed_count(changes), m.stats.total, sum(f.size for f in infos)),
                extra={SPAN_OF: end.digest},
                writer=m.writer,
                format_version=m.format_version,
            )
            if self.signing_key is not None:
                span = span.signed(self.signing_key)
            a, b = start.manifest.step, m.step
            data = {span_file_key(a, b, n): d for n, d in files.items()}
            mkey = span_manifest_key(a, b)
            what = f"span {a}->{b}"

            def put_files() -> None:
                try:
                    put_idempotent(self.store, data)
                except AlreadyExists:
                    if self.store.exists(mkey):
                        raise
                    self.store.put_many(data, mode="overwrite")  # this writer's leftovers of a span never committed

            stop = self._worker.stop
            with_retries(put_files, self.retry, f"{what}: writing {len(data)} data files", stop=stop)
            body = span.to_json()
            with_retries(
                lambda: put_idempotent(self.store, {mkey: body}), self.retry, f"{what}: writing its manifest", stop=stop
            )
        except Exception as exc:  # noqa: BLE001 - a failed span is logged and counted, never raised
            self.failures += 1
            log.warning("span %d->%d not written: %s", start.manifest.step, m.step, exc)
            return
        self.written += 1
        self.nbytes += span.stats.nbytes
