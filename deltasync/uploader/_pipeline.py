"""DeltaUploader's two background threads: the digest thread and the commit thread.

The digest thread finishes what push() started (the deferred diff, the copies of
the changes off the device, the tensor digests) and queues the step; the commit
thread writes the queued steps in order (files, manifest, HEAD) and resolves
their Futures.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from deltasync._retry import RetryPolicy
from deltasync.errors import CommitFailed, WriterFenced
from deltasync.protocol import Writer
from deltasync.uploader._commit import StepJob, merge_jobs, write_step
from deltasync.uploader._config import CommitInfo

if TYPE_CHECKING:
    from deltasync.uploader._uploader import DeltaUploader

__all__ = ["commit_job", "commit_loop", "digest_loop"]

log = logging.getLogger("deltasync.uploader")


def digest_loop(up: DeltaUploader) -> None:
    """The digest thread: diff (when deferred) and hash each pushed step, then queue it for commit."""
    while True:
        with up._digest_cv:
            up._digest_cv.wait_for(lambda: bool(up._digest_q))
            job = up._digest_q.popleft()
        if job is None:
            return
        try:
            if job.kind == "anchor" and up.config.defer_diff:
                up._prefault_staging()
            if job.staged:
                up._diff(job)
            for c in job.changes.values():
                c.wait()  # device tensors: the asynchronous copies of the changes to pinned memory
            if up.config.tensor_digests:
                up._digest(job)
        except Exception as exc:  # noqa: BLE001 - surfaced through the job's future
            log.exception("diffing or hashing step %d failed", job.step)
            job.digests = {}
            job.error = exc
        try:
            with up._cond:
                full = len(up._pending) >= up.config.max_pending
                if up._pending and full and up.config.on_backlog == "coalesce":
                    up._pending[-1] = merge_jobs(up._pending[-1], job)
                else:
                    up._pending.append(job)
                up._cond.notify_all()
        finally:
            # only now may the next push go on: in "block" mode it counts the queued
            # jobs, and this one must already be among them (a merged job shares
            # this Event, so the commit thread waits for it as well)
            job.digests_ready.set()


def commit_loop(up: DeltaUploader) -> None:
    """The commit thread: commit queued steps in order until the uploader stops."""
    while True:
        with up._cond:
            up._cond.wait_for(lambda: bool(up._pending) or up._stop.is_set())
            if not up._pending:
                return
            job = up._pending.popleft()
            up._cond.notify_all()
        job.digests_ready.wait()
        commit_job(up, job)


def commit_job(up: DeltaUploader, job: StepJob) -> None:
    """Write one step (or hand it to the sharded push) and resolve its Futures."""
    if up._sharded is not None:
        up._sharded.commit(job)
        return
    t0 = time.perf_counter()
    try:
        if job.kind == "patch" and not up._last_ok:
            raise CommitFailed(f"step {job.step}: its parent step was not committed; the next push will be an anchor")
        if job.error is not None or (up.config.tensor_digests and len(job.digests) != len(job.inventory)):
            raise CommitFailed(f"step {job.step}: diffing or hashing the state failed: {job.error}")
        last = up._last_committed
        committed = write_step(
            up.store,
            job,
            run_id=up.run_id,
            parent=last,
            anchor_step=last.manifest.anchor_step if last else job.step,
            shard_bytes=up.config.shard_bytes,
            pool=up._pool,
            signing_key=up.config.signing_key,
            writer=Writer(up.writer_id, up.epoch),
            fence=up._check_fence,
            retry=RetryPolicy(up.config.retries, up.config.retry_backoff),
        )
    except Exception as exc:  # noqa: BLE001 - re-raised into the futures
        up.failures += 1
        if isinstance(exc, WriterFenced):
            up._fenced = exc
        log.error("commit of step %d failed: %s", job.step, exc)
        err = exc if isinstance(exc, CommitFailed) else CommitFailed(f"step {job.step}: commit failed: {exc}")
        if err is not exc:
            err.__cause__ = exc
        fail_step(up, job, err)
        return
    m = committed.manifest
    with up._cond:
        up._last_committed = committed
        up._last_ok = True
        if m.kind == "anchor":
            up._anchor_bytes, up._bytes_since_anchor = m.stats.nbytes, 0
        else:
            up._bytes_since_anchor += m.stats.nbytes
        up._inflight -= len(job.futures)
        up._cond.notify_all()
    if up.notifier is not None:
        up.notifier.notify(m.step, committed.digest, run_id=up.run_id, kind=m.kind)
    if up.spans is not None:
        up.spans.submit(committed, job.changes if m.kind == "patch" else None)
    # the job stays referenced until the next push (coalescing): let go of its arrays now
    job.changes, job.snapshot, job.staged = {}, {}, {}
    if m.kind == "anchor" and up.retention is not None:
        up.retention.trigger()
    secs = time.perf_counter() - t0
    for step, fut in job.futures:
        kind: Literal["anchor", "patch", "skipped"] = m.kind if step == m.step else "skipped"
        fut.set_result(
            CommitInfo(
                step,
                kind,
                m.stats.nbytes,
                m.stats.changed,
                m.stats.total,
                m.anchor_step,
                committed.digest,
                m.step,
                secs,
            )
        )


def fail_step(up: DeltaUploader, job: Any, err: BaseException) -> None:
    """A step that did not commit: the next push is an anchor; ``err`` goes to its Futures."""
    with up._cond:
        up._last_ok = False
        up._needs_anchor = True
        up._inflight -= len(job.futures)
        up._cond.notify_all()
    for _, fut in job.futures:
        fut.set_exception(err)
