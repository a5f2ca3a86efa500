"""The commit pipeline: a digest stage and a commit stage, each one :class:`SerialWorker`.

The digest stage finishes what push() started (the deferred diff, the copies of the
changes off the device, the tensor digests) and hands the step to the backlog; the commit
stage takes the backlog's steps in order and commits each (files, manifest, HEAD) with the
``commit`` it was given (:func:`~deltasync.uploader._commit_step.commit_step`, or a sharded push's). The backlog holds the steps waiting for the store: when it is
full, "coalesce" folds a new step into the newest waiting one, and "block" makes the next
push wait (:meth:`CommitPipeline.wait_for_room`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from deltasync._util.worker import SerialWorker
from deltasync.uploader._job import StepJob, merge_jobs
from deltasync.uploader._pack import wait_changes
from deltasync.uploader._snapshot import Snapshotter

__all__ = ["CommitPipeline"]

log = logging.getLogger("deltasync.uploader")


class CommitPipeline:
    """Digest stage -> backlog -> commit stage (see the module docstring).

    ``commit`` commits one step and resolves its Futures (it never raises). ``stop`` is
    the uploader's stop event: both workers carry it, and the commit's retry waits on it.
    """

    def __init__(
        self,
        snapshots: Snapshotter,
        commit: Callable[[StepJob], None],
        *,
        max_pending: int,
        coalesce: bool,
        defer_diff: bool,
        tensor_digests: bool,
        stop: threading.Event,
    ) -> None:
        self.snapshots = snapshots
        self.max_pending = max_pending
        self.coalesce = coalesce
        self.defer_diff = defer_diff
        self.tensor_digests = tensor_digests
        self._commit = commit
        self._room = threading.Condition()
        self._backlog: deque[StepJob] = deque()
        self._digest_stage = SerialWorker("deltasync-digest", stop=stop)
        self._commit_stage = SerialWorker("deltasync-commit", stop=stop)
        #: test seam: called on the digest stage right after it lets the next push go on
        #: (``job.digests_ready`` set), which it does only once ``job`` is in the backlog
        self.after_release: Callable[[StepJob], None] | None = None

    # ------------------------------------------------------------------ push side

    def submit(self, job: StepJob) -> Future[None]:
        """Queue a pushed step for the digest stage (then the backlog, then the commit stage)."""
        return self._digest_stage.submit(lambda: self._digest(job))

    def enqueue(self, job: StepJob) -> None:
        """Put a step whose digests are ready straight into the backlog (a sharded push)."""
        with self._room:
            self._backlog.append(job)
            self._room.notify_all()
        self._commit_stage.submit(self._commit_next)

    def digesting(self) -> int:
        """Steps in the digest stage (queued or running)."""
        return self._digest_stage.pending()

    def waiting(self) -> int:
        """Steps in the backlog (digested, not yet being committed)."""
        with self._room:
            return len(self._backlog)

    def has_room(self) -> bool:
        """True when the backlog holds fewer than ``max_pending`` steps."""
        with self._room:
            return len(self._backlog) < self.max_pending

    def wait_for_room(self) -> None:
        """Block until the backlog holds fewer than ``max_pending`` steps ("block" mode)."""
        with self._room:
            self._room.wait_for(lambda: len(self._backlog) < self.max_pending)

    # ------------------------------------------------------------------ digest stage

    def _digest(self, job: StepJob) -> None:
        try:
            if job.kind == "anchor" and self.defer_diff:
                self.snapshots.prefault_staging()
            if job.staged or job.staged_packs:
                self.snapshots.diff(job)
            wait_changes(job.changes)  # device tensors: the asynchronous copies of the changes to pinned memory
            if self.tensor_digests:
                self.snapshots.digest(job)
        except Exception as exc:  # noqa: BLE001 - surfaced through the job's future
            log.exception("diffing or hashing step %d failed", job.step)
            job.digests = {}
            job.error = exc
        try:
            self._hand_off(job)
        finally:
            # only now may the next push go on: in "block" mode it counts the backlog, and
            # this job must already be in it (a merged job shares this Event, so the
            # commit stage waits for it as well)
            self._let_go(job)

    def _let_go(self, job: StepJob) -> None:
        job.digests_ready.set()  # the next push may touch the baseline and count the backlog
        if self.after_release is not None:
            self.after_release(job)

    def _hand_off(self, job: StepJob) -> None:
        with self._room:
            full = len(self._backlog) >= self.max_pending
            if self._backlog and full and self.coalesce:
                self._backlog[-1] = merge_jobs(self._backlog[-1], job)
                return  # the merged job takes the waiting one's place: no new commit
            self._backlog.append(job)
            self._room.notify_all()
        self._commit_stage.submit(self._commit_next)

    # ------------------------------------------------------------------ commit stage

    def _commit_next(self) -> None:
        with self._room:
            job = self._backlog.popleft()
            self._room.notify_all()
        job.digests_ready.wait()
        self._commit(job)

    # ------------------------------------------------------------------ lifetime

    def close(self, timeout: float | None = None) -> None:
        """Stop both stages: steps already queued still run (with the stop event set)."""
        self._digest_stage.close(timeout=timeout)
        self._commit_stage.close(timeout=timeout)
