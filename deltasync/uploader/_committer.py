"""Committing one step of a single-process uploader, and resolving pushed steps' Futures.

:class:`StepCommitter` is the commit stage's work: write the step (files, manifest,
HEAD; :func:`~deltasync.uploader._commit_step.write_step`), record the outcome in the
:class:`~deltasync.uploader._chain.ChainState` (the steps folded into it in :class:`FoldLog`
first), then tell the signal server, the span writer and retention, and resolve the step's
Futures (:func:`resolve_committed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from deltasync._util.retry import RetryPolicy
from deltasync.errors import CommitFailed
from deltasync.protocol import Committed
from deltasync.storage import Store
from deltasync.uploader._chain import ChainState
from deltasync.uploader._commit_step import write_step
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._job import StepJob
from deltasync.uploader._spans import SpanWriter
from deltasync.uploader._writer import WriterIdentity

if TYPE_CHECKING:
    from deltasync.run.gc import RetentionWorker
    from deltasync.signal import Notifier

__all__ = ["AfterCommit", "CommitContext", "FoldLog", "StepCommitter", "resolve_committed"]

#: a failed commit is logged on this child of ``deltasync.uploader``, then raised into the step's futures;
#: a caller that reports every future's error itself (the CLI) quiets it, so the error is told once
failures = logging.getLogger("deltasync.uploader.commits")
log = logging.getLogger("deltasync.uploader")


class FoldLog:
    """Counts the pushed steps folded into a later committed step, and says so once.

    In ``on_backlog="coalesce"`` mode a step that finds ``max_pending`` steps waiting for the
    store is merged into the newest waiting one (:func:`~deltasync.uploader._job.merge_jobs`):
    the steps folded that way are never committed as their own. :meth:`record` runs on the
    commit stage when the step they were folded into is committed: the first fold of the
    uploader is a WARNING on ``deltasync.uploader`` that names it and what to do, every later
    one a DEBUG line with the count. ``recent`` keeps the newest ``keep`` (step, committed step)
    pairs.
    """

    def __init__(self, max_pending: int, *, keep: int = 256) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._count = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=keep)

    @property
    def count(self) -> int:
        """Pushed steps folded into a later committed step so far."""
        with self._lock:
            return self._count

    @property
    def recent(self) -> tuple[tuple[int, int], ...]:
        """The newest folds, oldest first, as (folded step, the committed step holding its changes)."""
        with self._lock:
            return tuple(self._recent)

    def record(self, steps: Sequence[int], into: int) -> None:
        """``steps`` were folded into ``into``, which has just been committed."""
        for step in steps:
            with self._lock:
                self._count += 1
                self._recent.append((step, into))
                count = self._count
            if count == 1:
                log.warning(
                    "deltasync: step %d was folded into step %d: the store fell behind (the commit of an earlier "
                    "step was still running and max_pending=%d steps were already waiting for it; "
                    "on_backlog='coalesce'), so step %d is not committed as its own step and no engine can be "
                    "updated to exactly it (its Future resolves with kind='skipped', committed_step=%d). To "
                    "commit every step: push less often, raise max_pending, use a faster store, or pass "
                    "on_backlog='block' (DeltaSyncCallback: keep_every_step=True; push() then waits for the store "
                    "while it is behind). Further folds are logged at DEBUG and counted in DeltaUploader.folded.",
                    step,
                    into,
                    self.max_pending,
                    step,
                    into,
                )
            else:
                log.debug("deltasync: step %d was folded into step %d (%d steps folded so far)", step, into, count)


@dataclass(slots=True)
class AfterCommit:
    """Who hears of a committed step: the fold log (steps folded into it), the signal server, the
    span writer, retention (each optional)."""

    folds: FoldLog | None = None
    notifier: Notifier | None = None
    spans: SpanWriter | None = None
    retention: RetentionWorker | None = None


@dataclass(frozen=True, slots=True)
class CommitContext:
    """What a commit stage works with, single-process (:class:`StepCommitter`) or sharded
    (:class:`~deltasync.uploader.sharded.ShardedPush`): the store and config, the chain state it
    records outcomes in, the writer identity (fence), the encode pool, who hears of a commit, and
    the uploader's stop event (retry backoffs wait on it)."""

    store: Store
    config: UploaderConfig
    chain: ChainState
    writer: WriterIdentity
    pool: Executor
    after: AfterCommit
    stop: threading.Event


def resolve_committed(job: StepJob, committed: Committed, seconds: float, *, skipped: bool = True) -> None:
    """Resolve the job's Futures with ``committed``: steps folded into it resolve as "skipped", with
    ``committed_step`` the committed step and its numbers (``skipped=False``: every step of the job
    is the committed one, a sharded push)."""
    m = committed.manifest
    for step, fut in job.futures:
        kind: Literal["anchor", "patch", "skipped"] = m.kind if step == m.step or not skipped else "skipped"
        st = m.stats
        done = m.step if skipped else step
        fut.set_result(
            CommitInfo(step, kind, st.nbytes, st.changed, st.total, m.anchor_step, committed.digest, done, seconds)
        )


class StepCommitter:
    """Writes a step on the commit stage of a single-process uploader."""

    def __init__(self, ctx: CommitContext) -> None:
        self.ctx = ctx

    def commit(self, job: StepJob) -> None:
        """Write one step and resolve its Futures (a failure goes to them, never raised)."""
        cfg = self.ctx.config
        t0 = time.perf_counter()
        try:
            if job.kind == "patch" and self.ctx.chain.failed:
                raise CommitFailed(
                    f"step {job.step}: its parent step was not committed; the next push will be an anchor"
                )
            if job.error is not None or (cfg.tensor_digests and len(job.digests) != len(job.inventory)):
                raise CommitFailed(f"step {job.step}: diffing or hashing the state failed: {job.error}")
            last = self.ctx.chain.last_committed
            committed = write_step(
                self.ctx.store,
                job,
                run_id=self.ctx.writer.run_id,
                parent=last,
                anchor_step=last.manifest.anchor_step if last else job.step,
                shard_bytes=cfg.shard_bytes,
                pool=self.ctx.pool,
                signing_key=cfg.signing_key,
                writer=self.ctx.writer.writer,
                fence=self.ctx.writer.check_fence,
                retry=RetryPolicy(cfg.retries, cfg.retry_backoff),
                stop=self.ctx.stop,
            )
        except Exception as exc:  # noqa: BLE001 - re-raised into the futures
            failures.error("commit of step %d failed: %s", job.step, exc)
            err = exc if isinstance(exc, CommitFailed) else CommitFailed(f"step {job.step}: commit failed: {exc}")
            if err is not exc:
                err.__cause__ = exc
            self.ctx.chain.failed_step(job.futures, err)
            return
        m = committed.manifest
        if self.ctx.after.folds is not None:  # before the chain hears of it: flush() then sees every fold
            self.ctx.after.folds.record([s for s, _ in job.futures if s != m.step], m.step)
        self.ctx.chain.committed(committed, len(job.futures))
        if self.ctx.after.notifier is not None:
            self.ctx.after.notifier.notify(m.step, committed.digest, run_id=self.ctx.writer.run_id, kind=m.kind)
        if self.ctx.after.spans is not None:
            self.ctx.after.spans.submit(committed, job.changes if m.kind == "patch" else None)
        # the job stays referenced until the next push (coalescing): let go of its arrays now
        job.changes, job.snapshot, job.staged = {}, {}, {}
        if m.kind == "anchor" and self.ctx.after.retention is not None:
            self.ctx.after.retention.trigger()
        resolve_committed(job, committed, time.perf_counter() - t0)
