"""Committing one step of a single-process uploader, and resolving pushed steps' Futures.

:class:`StepCommitter` is the commit stage's work: write the step (files, manifest,
HEAD; :func:`~deltasync.uploader._commit.write_step`), record the outcome in the
:class:`~deltasync.uploader._chain.ChainState`, then tell the signal server, the span
writer and retention, and resolve the step's Futures (:func:`resolve_committed`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from deltasync._retry import RetryPolicy
from deltasync.errors import CommitFailed
from deltasync.protocol import Committed
from deltasync.storage import Store
from deltasync.uploader._chain import ChainState
from deltasync.uploader._commit import StepJob, write_step
from deltasync.uploader._config import CommitInfo, UploaderConfig
from deltasync.uploader._spans import SpanWriter
from deltasync.uploader._writer import WriterIdentity

if TYPE_CHECKING:
    from deltasync.run.gc import RetentionWorker
    from deltasync.signal import Notifier

__all__ = ["AfterCommit", "StepCommitter", "resolve_committed"]

log = logging.getLogger("deltasync.uploader")


@dataclass(slots=True)
class AfterCommit:
    """Who hears of a committed step: the signal server, the span writer, retention (each optional)."""

    notifier: Notifier | None = None
    spans: SpanWriter | None = None
    retention: RetentionWorker | None = None


def resolve_committed(job: StepJob, committed: Committed, seconds: float, *, skipped: bool = True) -> None:
    """Resolve the job's Futures with ``committed``: steps folded into it resolve as "skipped"
    (``skipped=False``: every step of the job is the committed one, a sharded push)."""
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

    def __init__(
        self,
        store: Store,
        config: UploaderConfig,
        *,
        chain: ChainState,
        writer: WriterIdentity,
        pool: Executor,
        after: AfterCommit,
        stop: threading.Event,
    ) -> None:
        self.store = store
        self.config = config
        self.chain = chain
        self.writer = writer
        self.pool = pool
        self.after = after
        self.stop = stop

    def commit(self, job: StepJob) -> None:
        """Write one step and resolve its Futures (a failure goes to them, never raised)."""
        cfg = self.config
        t0 = time.perf_counter()
        try:
            if job.kind == "patch" and self.chain.failed:
                raise CommitFailed(
                    f"step {job.step}: its parent step was not committed; the next push will be an anchor"
                )
            if job.error is not None or (cfg.tensor_digests and len(job.digests) != len(job.inventory)):
                raise CommitFailed(f"step {job.step}: diffing or hashing the state failed: {job.error}")
            last = self.chain.last_committed
            committed = write_step(
                self.store,
                job,
                run_id=self.writer.run_id,
                parent=last,
                anchor_step=last.manifest.anchor_step if last else job.step,
                shard_bytes=cfg.shard_bytes,
                pool=self.pool,
                signing_key=cfg.signing_key,
                writer=self.writer.writer,
                fence=self.writer.check_fence,
                retry=RetryPolicy(cfg.retries, cfg.retry_backoff),
                stop=self.stop,
            )
        except Exception as exc:  # noqa: BLE001 - re-raised into the futures
            log.error("commit of step %d failed: %s", job.step, exc)
            err = exc if isinstance(exc, CommitFailed) else CommitFailed(f"step {job.step}: commit failed: {exc}")
            if err is not exc:
                err.__cause__ = exc
            self.chain.failed_step(job.futures, err)
            return
        m = committed.manifest
        self.chain.committed(committed, len(job.futures))
        if self.after.notifier is not None:
            self.after.notifier.notify(m.step, committed.digest, run_id=self.writer.run_id, kind=m.kind)
        if self.after.spans is not None:
            self.after.spans.submit(committed, job.changes if m.kind == "patch" else None)
        # the job stays referenced until the next push (coalescing): let go of its arrays now
        job.changes, job.snapshot, job.staged = {}, {}, {}
        if m.kind == "anchor" and self.after.retention is not None:
            self.after.retention.trigger()
        resolve_committed(job, committed, time.perf_counter() - t0)
