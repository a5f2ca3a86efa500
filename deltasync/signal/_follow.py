"""The one follow loop: watch -> act -> report -> back off.

Whatever keeps a receiver at a run's newest committed step runs :class:`FollowLoop`: ``deltasync
follow`` (:meth:`DeltaFetcher.follow`: a tensor target or a checkpoint dir), the HTTP driver of
engine servers (``VLLMDriver.follow``), the engine's prefetcher and the demo's follower. The loop
iterates one :class:`~deltasync.signal.StepWatcher`, keeps the newest step seen (coalescing: a
receiver that fell behind is brought to the newest step, never through the ones it missed one
by one), asks ``act`` to bring the receiver there, hands each outcome to ``report``, and backs off
a step that failed with the shared :class:`~deltasync._util.retry.Backoff` (longer after each failure
of that step, reset by a success; a newer step is tried at once).

It never waits itself: the watcher's pauses pace it, and the watcher's clock times the backoff,
so tests drive it with the watcher's injected ``clock`` and ``wait``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from deltasync._util.retry import RetryPolicy
from deltasync.errors import DeltaSyncError
from deltasync.signal._watcher import StepSeen, StepWatcher

__all__ = ["NEXT_OBSERVATION", "Attempt", "FollowLoop"]

#: no backoff: a step that failed is tried again at the next observation
NEXT_OBSERVATION = RetryPolicy(retries=0, backoff=0.0, max_backoff=0.0)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One outcome of ``act``, as :class:`FollowLoop` reports it.

    error: None when the act worked. retry_in: after a failure, the seconds until the step is
    tried again. seconds: how long the act took (to its return, or to its future's end), by the
    watcher's clock.
    """

    step: int
    error: BaseException | None = None
    retry_in: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the act worked."""
        return self.error is None


class FollowLoop:
    """Keeps a receiver at the newest step ``watcher`` sees; :meth:`run` until the watcher's ``stop``.

    act: brings the receiver to a step. It returns when done (then ``held()`` says where the
        receiver is: a step it did not reach, e.g. a server still backing off, is acted on again at
        the next observation), or returns a ``Future`` of work it started in the background (that
        step is not acted on again unless the future fails, after the backoff, or is cancelled).
        An exception of ``retry_on`` (not of ``fatal``) is a failure: reported, then backed off;
        any other ends :meth:`run`.
    held: the step the receiver holds (None: nothing yet); also the step a signal stream resumes
        after. A step not newer than it is never acted on.
    observe: called with every observation first (the watcher's own reporting: metrics, logs).
    report: called with each :class:`Attempt` (from the future's thread for a background act).
    retry: the backoff of a failing step (default: none, try it at the next observation).
    until: :meth:`run` returns once ``held()`` reaches this step.

    A lost signal stream is observed but acted on only at the store poll that follows it.
    """

    def __init__(
        self,
        watcher: StepWatcher,
        act: Callable[[int], Future[Any] | None],
        *,
        held: Callable[[], int | None],
        observe: Callable[[StepSeen], None] | None = None,
        report: Callable[[Attempt], None] | None = None,
        retry: RetryPolicy = NEXT_OBSERVATION,
        retry_on: tuple[type[BaseException], ...] = (DeltaSyncError,),
        fatal: tuple[type[BaseException], ...] = (),
        until: int | None = None,
    ) -> None:
        self.watcher = watcher
        self.act = act
        self.held = held
        self.observe = observe
        self.report = report
        self.retry_on = retry_on
        self.fatal = fatal
        self.until = until
        #: the newest step seen
        self.newest: int | None = None
        self._backoff = retry.backoff_state()
        self._lock = threading.Lock()  # a background act settles on another thread
        self._asked: int | None = None  # the step acted on, until it settles (or, in the background, succeeds)
        self._failed: int | None = None  # the step that failed last, tried again at ``_retry_at``
        self._retry_at = float("-inf")

    def run(self) -> int | None:
        """Watch, act, report and back off until the watcher's ``stop`` is set or ``until`` is
        held; closes the watcher and returns ``held()``."""
        stop = self.watcher.stop
        try:
            for seen in self.watcher.watch(resume=self.held):
                if stop.is_set():
                    break
                if self.observe is not None:
                    self.observe(seen)
                if seen.step is not None and (self.newest is None or seen.step > self.newest):
                    self.newest = seen.step
                if seen.kind != "lost":
                    step = self._due()
                    if step is not None:
                        self._act(step)
                if stop.is_set() or self._reached():
                    break
        finally:
            self.watcher.close()
        return self.held()

    def _reached(self) -> bool:
        held = self.held()
        return self.until is not None and held is not None and held >= self.until

    def _due(self) -> int | None:
        """The newest step, if it is to be acted on now."""
        step = self.newest
        if step is None:
            return None
        held = self.held()
        if held is not None and step <= held:
            return None
        with self._lock:
            if step == self._asked or (step == self._failed and self.watcher.clock() < self._retry_at):
                return None
        return step

    def _act(self, step: int) -> None:
        t0 = self.watcher.clock()
        with self._lock:
            self._asked = step
        try:
            started = self.act(step)
        except self.fatal:
            raise
        except self.retry_on as exc:
            self._settle(step, t0, exc)
            return
        if isinstance(started, Future):
            started.add_done_callback(lambda fut: self._settled(step, t0, fut))
        else:
            self._settle(step, t0, None)

    def _settled(self, step: int, t0: float, fut: Future[Any]) -> None:
        if fut.cancelled():  # superseded (e.g. a newer step took its place in a queue): may be asked again
            with self._lock:
                if self._asked == step:
                    self._asked = None
            return
        self._settle(step, t0, fut.exception(), background=True)

    def _settle(self, step: int, t0: float, error: BaseException | None, *, background: bool = False) -> None:
        now = self.watcher.clock()
        retry_in = None
        with self._lock:
            if error is None:
                self._backoff.reset()
                self._failed = None
                if self._asked == step and not background:
                    self._asked = None  # done: held() says where the receiver is now
            else:
                if step != self._failed:
                    self._backoff.reset()  # a step failing for the first time starts the backoff over
                self._failed = step
                retry_in = self._backoff.next_delay()
                self._retry_at = now + retry_in
                if self._asked == step:
                    self._asked = None
        if self.report is not None:
            self.report(Attempt(step, error, retry_in, now - t0))
