"""The one background-worker primitive: a single thread that runs jobs in order.

Every background loop in deltasync (the uploader's digest and commit stages, span writing,
retention, the signal notifier, the vLLM prefetcher) is a :class:`SerialWorker`: jobs go in
with :meth:`~SerialWorker.submit` and come back as :class:`~concurrent.futures.Future`; a job
submitted with a ``coalesce`` key replaces a queued, not yet started job with the same key
(the replaced job's future is cancelled), so a worker that falls behind does the newest work
once instead of every stale one. :attr:`~SerialWorker.stop` is set by :meth:`~SerialWorker.close`;
long waits inside a job (retry backoff, polling) wait on it, so closing cuts them short.

In the spirit of huggingface_hub's ``CommitScheduler``: one thread, one lock, futures for
results, and a close that waits for the last job.

It is also the only place that starts a thread by hand: :func:`run_in_background` runs one
blocking call or long-running loop that owns no queue of jobs (a child process's exit, a console
printer, a demo's trainer) on a :class:`SerialWorker` of its own that ends with it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

__all__ = ["SerialWorker", "WorkerClosed", "run_in_background"]

log = logging.getLogger("deltasync.worker")
T = TypeVar("T")


class WorkerClosed(RuntimeError):
    """:meth:`SerialWorker.submit` after :meth:`SerialWorker.close`."""


@dataclass(slots=True)
class _Job(Generic[T]):
    fn: Callable[[], T]
    future: Future[T] = field(default_factory=Future)
    key: Hashable | None = None


class SerialWorker:
    """One daemon thread running submitted jobs one at a time, in submission order.

    ``name`` names the thread (it shows in ``py-spy`` and faulthandler dumps). The thread
    starts with the first job, so a worker that is never used costs nothing.
    """

    def __init__(self, name: str, *, stop: threading.Event | None = None) -> None:
        self.name = name
        #: set by :meth:`close`; jobs wait on it instead of sleeping
        self.stop = stop if stop is not None else threading.Event()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job[Any]] = collections.deque()
        self._running: _Job[Any] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ jobs

    def submit(self, fn: Callable[[], T], *, coalesce: Hashable | None = None) -> Future[T]:
        """Queue ``fn``; its result or exception lands in the returned future.

        With ``coalesce``, a queued job with the same key that has not started is dropped
        (its future cancelled) and this one takes its place at the end of the queue.
        """
        job: _Job[T] = _Job(fn, key=coalesce)
        with self._cond:
            if self._closed:
                raise WorkerClosed(f"{self.name}: the worker is closed")
            if coalesce is not None:
                for old in [j for j in self._queue if j.key == coalesce]:
                    self._queue.remove(old)
                    old.future.cancel()
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return job.future

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._running is None, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = job
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        result = job.fn()
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                        job.future.set_exception(exc)
                    else:
                        job.future.set_result(result)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    # ------------------------------------------------------------------ lifetime

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> bool:
        """Refuse new jobs, set :attr:`stop`, and wait for the thread to finish.

        Queued jobs still run unless ``cancel_pending`` (their futures are then cancelled), but
        with :attr:`stop` set: a job waiting on it (a retry backoff) gives up at once. To let
        every job finish undisturbed, :meth:`flush` first. Returns False when ``timeout``
        passed first (the thread is a daemon and will not keep the process alive).
        """
        with self._cond:
            self._closed = True
            self.stop.set()
            if cancel_pending:
                while self._queue:
                    self._queue.popleft().future.cancel()
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def __enter__(self) -> SerialWorker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def run_in_background(fn: Callable[[], T], name: str) -> Future[T]:
    """Run ``fn`` once on a daemon thread named ``name``: a :class:`SerialWorker` of its own that
    closes itself once ``fn`` returns. ``fn``'s result or exception lands in the returned future
    (wait for it with :func:`concurrent.futures.wait` where a thread would be joined); an exception
    is also logged, as an unhandled exception in a thread would be printed."""
    worker = SerialWorker(name)
    future = worker.submit(fn)

    def done(f: Future[T]) -> None:
        worker.close()  # on the worker's own thread (no join), or at once if fn already returned
        if not f.cancelled() and (exc := f.exception()) is not None:
            log.error("%s failed", name, exc_info=exc)

    future.add_done_callback(done)
    return future
