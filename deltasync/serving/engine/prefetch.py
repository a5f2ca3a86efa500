"""Prepare each new committed step of a run in the background, as soon as it lands.

:class:`Prefetcher` watches the run with the one :class:`~deltasync.signal.StepWatcher` (store
polling) from its own :class:`~deltasync._worker.SerialWorker`, and asks the mirror to prepare
each newer step; the mirror's preparer coalesces, so a newer step supersedes one still queued.
A step that fails to prepare is tried again after the shared :class:`~deltasync._retry.Backoff`
(longer after each failure of the same step, reset by a success), not at every poll. Needs no
vLLM: :mod:`deltasync.integrations.vllm.backend` plugs it into a worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from deltasync._retry import RetryPolicy
from deltasync._worker import SerialWorker
from deltasync.errors import DeltaSyncError
from deltasync.signal import StepWatcher

__all__ = ["Prefetcher"]

log = logging.getLogger("deltasync.vllm")

#: the longest wait before a step that keeps failing is tried again
MAX_RETRY_WAIT = 60.0


class _Mirror(Protocol):
    """What the prefetcher needs of an :class:`~deltasync.serving.engine.mirror.EngineMirror`."""

    @property
    def serving(self) -> int | None: ...

    def latest_step(self) -> int | None: ...

    def prepare(self, step: int | None = None, *, coalesce: str | None = None) -> Future[int | None]: ...


class Prefetcher:
    """Background preparation of the newest committed step for one mirror.

    mirror: returns the mirror to prepare (may raise ValueError or DeltaSyncError while none can
        be made yet; that poll is then skipped and logged once).
    metrics: a ``SyncMetrics``-like recorder (``observe_head``), optional.
    poll_interval: seconds between store polls. retry: the backoff of a failing step (default:
        one poll interval after the first failure, then doubling, at most 60 s).
    clock, wait, stop: injectable for tests (monotonic seconds; ``wait(seconds)`` pauses between
        polls, by default on ``stop``, which :meth:`close` sets).
    """

    def __init__(
        self,
        mirror: Callable[[], _Mirror],
        *,
        metrics: Any = None,
        poll_interval: float = 2.0,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.mirror = mirror
        self.metrics = metrics
        self.poll_interval = poll_interval
        policy = retry or RetryPolicy(retries=0, backoff=poll_interval, max_backoff=max(poll_interval, MAX_RETRY_WAIT))
        self.backoff = policy.backoff_state()
        self.clock = clock
        self._worker = SerialWorker("deltasync-prefetch", stop=stop)
        self._wait = wait if wait is not None else self._worker.stop.wait
        self._lock = threading.Lock()
        self._asked: int | None = None  # the step asked of the mirror (in progress or prepared)
        self._failed: int | None = None  # the step that failed last, retried at ``_retry_at``
        self._retry_at = float("-inf")
        self._poll_failing = False
        #: prepares asked of the mirror, and how many failed (for tests and status)
        self.attempts = 0
        self.failures = 0

    @property
    def stop(self) -> threading.Event:
        """Set by :meth:`close`; ends the watch and cuts its waits short."""
        return self._worker.stop

    def start(self) -> None:
        """Start watching (in the background); once."""
        self._worker.submit(self.run)

    def run(self) -> None:
        """Watch the store until :attr:`stop` is set (what :meth:`start` runs in the background)."""
        watcher = StepWatcher(
            self._latest, poll_interval=self.poll_interval, stop=self.stop, wait=self._wait, clock=self.clock
        )
        try:
            for seen in watcher.watch():
                if seen.step is not None:
                    self.offer(seen.step)
        finally:
            watcher.close()

    def _latest(self) -> int | None:
        try:
            latest = self.mirror().latest_step()
        except (DeltaSyncError, ValueError) as exc:
            if not self._poll_failing:
                log.warning("prefetch: %s", exc)
            self._poll_failing = True
            return None
        self._poll_failing = False
        return latest

    def offer(self, latest: int) -> None:
        """The run's newest committed step is ``latest``: prepare it unless it is served, asked for
        already, or failed recently (then wait out its backoff)."""
        if self.metrics is not None:
            self.metrics.observe_head(latest)
        try:
            mirror = self.mirror()
        except (DeltaSyncError, ValueError) as exc:
            log.debug("prefetch: %s", exc)
            return
        with self._lock:
            if latest == self._asked or (mirror.serving is not None and latest <= mirror.serving):
                return
            if latest == self._failed and self.clock() < self._retry_at:
                return  # backing off this step
            self._asked = latest
            self.attempts += 1
        try:
            fut = mirror.prepare(latest, coalesce="prefetch")
        except (DeltaSyncError, ValueError) as exc:
            self._failed_step(latest, exc)
            return
        fut.add_done_callback(lambda f: self._settled(latest, f))

    def _settled(self, step: int, fut: Future[int | None]) -> None:
        if fut.cancelled():  # a newer step took its place in the mirror's queue
            with self._lock:
                if self._asked == step:
                    self._asked = None
            return
        exc = fut.exception()
        if exc is None:
            with self._lock:
                self.backoff.reset()
                self._failed = None
            return
        self._failed_step(step, exc)

    def _failed_step(self, step: int, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if step != self._failed:
                self.backoff.reset()
            self._failed = step
            delay = self.backoff.next_delay()
            self._retry_at = self.clock() + delay
            if self._asked == step:
                self._asked = None
        log.warning("prefetch of step %d failed (next try in %.1f s): %s", step, delay, exc)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop watching (cuts a wait short; a running prepare is the mirror's to finish); False when
        the watch did not end within ``timeout``."""
        return self._worker.close(cancel_pending=True, timeout=timeout)
