"""The one step watcher: learn of each newly committed step of a run, as soon as possible.

The signal server's SSE stream is a fast hint; the store is the truth. :class:`StepWatcher`
follows the stream when a signal URL is given (resuming with ``Last-Event-ID``, reconnecting
with the shared :class:`~deltasync._util.retry.Backoff`) and polls the store meanwhile, and also now
and then while the stream is up, in case a signal was lost. Without a URL it only polls.

``deltasync follow``, the vLLM driver, the prefetcher and the demo's follower run the one
:class:`~deltasync.signal.FollowLoop` over :meth:`StepWatcher.watch`. Waits go through an
injectable ``wait`` (default: the ``stop`` event's), and the ``clock`` is injectable too, so tests
drive it without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import httpx

from deltasync._util.retry import RetryPolicy
from deltasync.errors import DeltaSyncError, SignalError
from deltasync.protocol import Head
from deltasync.protocol.head import MAX_HEAD_BYTES
from deltasync.protocol.keys import HEAD_KEY
from deltasync.signal._client import SignalClient
from deltasync.storage import Store

__all__ = ["StepSeen", "StepWatcher", "StorePoller"]

log = logging.getLogger("deltasync.signal")

#: how follow reconnects by default: 0.5 s, doubling, at most 15 s apart
RECONNECT = RetryPolicy(retries=0, backoff=0.5, max_backoff=15.0)


@dataclass(frozen=True, slots=True)
class StepSeen:
    """One observation of a :class:`StepWatcher`.

    kind: ``"store"`` (a poll; ``step`` is the store's newest committed step, None for an empty
        run or a failed poll), ``"signal"`` (an SSE commit; ``committed_at`` is the publisher's
        time), ``"heartbeat"`` (the stream is alive, nothing new) or ``"lost"`` (the stream
        failed or could not start: ``error``; the watcher polls and reconnects with backoff).
    """

    kind: Literal["store", "signal", "heartbeat", "lost"]
    step: int | None = None
    committed_at: float | None = None
    error: SignalError | None = None


class StorePoller:
    """The newest committed step of the run under ``store``: ``HEAD.json`` (one small read, a hint)
    on most polls, the manifest listing (the truth, ``latest_step``) every ``list_every``-th poll
    and whenever HEAD cannot be read. A failed listing raises its :class:`DeltaSyncError`."""

    def __init__(self, store: Store, latest_step: Callable[[], int | None], *, list_every: int = 10) -> None:
        self.store = store
        self.latest_step = latest_step
        self.list_every = max(1, list_every)
        self.polls = 0

    def __call__(self) -> int | None:
        self.polls += 1
        if self.polls % self.list_every != 1 % self.list_every:
            try:
                return Head.from_json(self.store.get_bounded(HEAD_KEY, MAX_HEAD_BYTES)).step
            except DeltaSyncError:
                pass
        return self.latest_step()


class StepWatcher:
    """Watches one run for committed steps; iterate :meth:`watch`.

    poll: the store's newest committed step (e.g. a :class:`StorePoller`); None: never poll
        (signal only). A poll's :class:`DeltaSyncError` yields a ``"store"`` observation
        without a step, and is logged by the caller's ``poll`` if it wants.
    signal_url, token, run: the signal server, a subscribe token, and the run name (or a
        callable giving it, asked at each connect; None from it: poll, try later).
    heartbeat: keep-alive interval asked of the server; also bounds how late ``stop`` is noticed.
    poll_interval: seconds between polls while the stream is down (or absent).
    store_check_interval: while the stream is up, the store is still polled this often.
    reconnect: the backoff between connection attempts (reset by every event received).
    stop: ends :meth:`watch` (also cuts waits short with the default ``wait``).
    wait: ``wait(seconds)`` pauses between polls (default ``stop.wait``; a demo passes a wait
        that its in-process commits cut short); clock: monotonic seconds.
    """

    def __init__(
        self,
        poll: Callable[[], int | None] | None,
        *,
        signal_url: str | None = None,
        token: str | None = None,
        run: str | Callable[[], str | None] | None = None,
        heartbeat: float = 5.0,
        poll_interval: float = 2.0,
        store_check_interval: float = 30.0,
        reconnect: RetryPolicy = RECONNECT,
        transport: httpx.BaseTransport | None = None,
        stop: threading.Event | None = None,
        wait: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if signal_url is not None and run is None:
            raise ValueError("a signal URL needs the run name (run=)")
        self.poll = poll
        self.run = run
        self.heartbeat = heartbeat
        self.poll_interval = poll_interval
        self.store_check_interval = store_check_interval
        self.stop = stop if stop is not None else threading.Event()
        self.wait = wait if wait is not None else self.stop.wait
        self.clock = clock
        self.backoff = reconnect.backoff_state()
        self.client = SignalClient(signal_url, token, transport=transport) if signal_url else None

    def _run_name(self) -> str | None:
        return self.run() if callable(self.run) else self.run

    def _poll(self) -> StepSeen:
        if self.poll is None:
            return StepSeen("store")
        try:
            return StepSeen("store", self.poll())
        except DeltaSyncError:
            return StepSeen("store")

    def watch(self, resume: Callable[[], int | None] = lambda: None) -> Iterator[StepSeen]:
        """Observations until ``stop`` is set: a poll first, then signal events (and heartbeats) while
        the stream is up, polls every ``poll_interval`` while it is not.

        ``resume()`` gives the step to resume the stream after (``Last-Event-ID``) at each connect:
        the step the caller holds, so that a step it failed to apply is signalled again.
        """
        next_connect = float("-inf")
        last_poll = self.clock()
        if self.poll is not None:
            yield self._poll()
        while not self.stop.is_set():
            name = self._run_name() if self.client is not None and self.clock() >= next_connect else None
            if self.client is not None and name is not None:
                try:
                    for ev in self.client.events(name, last_event_id=resume(), heartbeat=self.heartbeat):
                        self.backoff.reset()
                        yield StepSeen("heartbeat") if ev is None else StepSeen("signal", ev.step, ev.time or None)
                        if self.stop.is_set():
                            return
                        if self.poll is not None and self.clock() - last_poll >= self.store_check_interval:
                            last_poll = self.clock()
                            yield self._poll()
                            if self.stop.is_set():
                                return
                except SignalError as exc:
                    next_connect = self.clock() + self.backoff.next_delay()
                    yield StepSeen("lost", error=exc)
                if self.stop.is_set():
                    return
            if self.poll is not None:
                last_poll = self.clock()
                yield self._poll()
                if self.stop.is_set():
                    return
            pause = self.poll_interval if self.poll is not None else float("inf")
            now = self.clock()
            if self.client is not None and next_connect > now:
                pause = min(pause, next_connect - now)  # reconnect as soon as the backoff allows
            if pause == float("inf"):
                pause = self.poll_interval
            self.wait(max(0.01, pause))

    def close(self) -> None:
        """Close the signal connection pool (set ``stop`` first to end a running :meth:`watch`)."""
        if self.client is not None:
            self.client.close()
