"""Prepare each new committed step of a run in the background, as soon as it lands.

:class:`Prefetcher` runs the one :class:`~deltasync.signal.FollowLoop` over a
:class:`~deltasync.signal.StepWatcher` (store polling, and a signal server's stream when given one) from its own
:class:`~deltasync._util.worker.SerialWorker`, and asks the mirror to prepare each newer step; the
mirror's preparer coalesces, so a newer step supersedes one still queued. A step that fails to
prepare is tried again after the loop's backoff (longer after each failure of the same step, reset
by a success), not at every poll. Needs no vLLM: :mod:`deltasync.integrations.vllm.backend` plugs
it into a worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

from deltasync._util.retry import RetryPolicy
from deltasync._util.worker import SerialWorker
from deltasync.errors import DeltaSyncError
from deltasync.signal import Attempt, FollowLoop, StepSeen, StepWatcher

__all__ = ["PrefetchOptions", "Prefetcher"]

log = logging.getLogger("deltasync.vllm")

#: the longest wait before a step that keeps failing is tried again
MAX_RETRY_WAIT = 60.0


class _Mirror(Protocol):
    """What the prefetcher needs of an :class:`~deltasync.serving.engine.mirror.EngineMirror`."""

    @property
    def serving(self) -> int | None: ...

    def latest_step(self) -> int | None: ...

    def prepare(self, step: int | None = None, *, coalesce: str | None = None) -> Future[int | None]: ...


class _HeadMetrics(Protocol):
    """What the prefetcher records (a :class:`~deltasync.fetcher.metrics.SyncMetrics`)."""

    def observe_head(self, step: int, committed_at: float | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefetchOptions:
    """How a :class:`Prefetcher` watches the run.

    poll_interval: seconds between store polls. retry: the backoff of a failing step (default: one
        poll interval after the first failure, then doubling, at most :data:`MAX_RETRY_WAIT`).
    signal_url, signal_token, run: a signal server to wake on: each commit it announces is prepared
        at once instead of at the next poll (the store is still polled, at least every
        ``poll_interval`` while the stream is down, and with each heartbeat while it is up). ``run``:
        the run's name there, or a callable giving it (None: not known yet, poll meanwhile); default:
        the run id its store records. heartbeat: the stream's heartbeat, seconds.
    """

    poll_interval: float = 2.0
    retry: RetryPolicy | None = None
    signal_url: str | None = None
    signal_token: str | None = None
    run: str | Callable[[], str | None] | None = None
    heartbeat: float = 5.0

    def backoff(self) -> RetryPolicy:
        """The retry policy of a failing step (:attr:`retry`, else the default above)."""
        return self.retry or RetryPolicy(
            retries=0, backoff=self.poll_interval, max_backoff=max(self.poll_interval, MAX_RETRY_WAIT)
        )


class Prefetcher:
    """Background preparation of the newest committed step for one mirror.

    mirror: returns the mirror to prepare (may raise ValueError or DeltaSyncError while none can
        be made yet; that poll is then skipped and logged once).
    options: see :class:`PrefetchOptions`; ``poll_interval``, when given, overrides its own.
    metrics: a ``SyncMetrics``-like recorder (``observe_head``), optional.
    clock, wait, stop: injectable for tests (monotonic seconds; ``wait(seconds)`` pauses between
        polls, by default on ``stop``, which :meth:`close` sets).
    """

    def __init__(
        self,
        mirror: Callable[[], _Mirror],
        options: PrefetchOptions | None = None,
        *,
        metrics: _HeadMetrics | None = None,
        poll_interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        opts = options or PrefetchOptions()
        self.options = opts if poll_interval is None else replace(opts, poll_interval=poll_interval)
        self.mirror = mirror
        self.metrics = metrics
        self.poll_interval = self.options.poll_interval
        self.retry = self.options.backoff()
        self.clock = clock
        self._worker = SerialWorker("deltasync-prefetch", stop=stop)
        self._wait = wait if wait is not None else self._worker.stop.wait
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
        o = self.options
        watcher = StepWatcher(
            self._latest,
            signal_url=o.signal_url,
            token=o.signal_token,
            run=(o.run if o.run is not None else self._run_id) if o.signal_url else None,
            heartbeat=o.heartbeat,
            poll_interval=self.poll_interval,
            store_check_interval=self.poll_interval,  # checked at each event or heartbeat while the stream is up
            stop=self.stop,
            wait=self._wait,
            clock=self.clock,
        )
        FollowLoop(
            watcher,
            self._prepare,
            held=self._serving,
            observe=self._observe,
            report=self._report,
            retry=self.retry,
            retry_on=(DeltaSyncError, ValueError),
        ).run()

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

    def _run_id(self) -> str | None:
        """The run id the store records (the run's default name at a signal server)."""
        try:
            run_id: str | None = getattr(self.mirror(), "fetcher").reader.run_id()  # noqa: B009
        except (DeltaSyncError, ValueError, AttributeError):
            return None
        return run_id

    def _serving(self) -> int | None:
        try:
            return self.mirror().serving
        except (DeltaSyncError, ValueError):
            return None

    def _observe(self, seen: StepSeen) -> None:
        if seen.step is None:
            return
        if self.metrics is not None:
            self.metrics.observe_head(seen.step, seen.committed_at)
        with contextlib.suppress(DeltaSyncError, ValueError):
            heard = getattr(self.mirror(), "seen", None)  # EngineMirror.seen; optional for other mirrors
            if heard is not None:
                heard(seen.step)  # its prepare latency counts from here

    def _prepare(self, step: int) -> Future[int | None] | None:
        """Ask the mirror to prepare ``step`` (a newer step supersedes one still queued)."""
        try:
            mirror = self.mirror()
        except (DeltaSyncError, ValueError) as exc:
            log.debug("prefetch: %s", exc)
            return None
        self.attempts += 1
        return mirror.prepare(step, coalesce="prefetch")

    def _report(self, attempt: Attempt) -> None:
        if attempt.error is not None:
            self.failures += 1
            log.warning(
                "prefetch of step %d failed (next try in %.1f s): %s", attempt.step, attempt.retry_in, attempt.error
            )

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop watching (cuts a wait short; a running prepare is the mirror's to finish); False when
        the watch did not end within ``timeout``."""
        return self._worker.close(cancel_pending=True, timeout=timeout)
