"""The demo's shared state: what the page shows, and the live event stream to it.

Threads (trainer, inference follower) call :class:`LiveBoard` methods; each call updates
the snapshot and broadcasts one JSON event to every subscribed page. Pages get the
snapshot first (``/api/state``, or the first SSE event) and then apply events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from deltasync.signal import StalenessTracker

__all__ = ["LiveBoard", "Subscription"]

MAX_COMMITS = 2000
MAX_GENERATIONS = 60
MAX_LAG_POINTS = 600
QUEUE_LIMIT = 1000


class Subscription:
    """One page's event queue, filled from any thread, drained on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.dropped = False

    def put(self, event: dict[str, Any] | None) -> None:
        """Queue ``event`` (thread-safe); a page that falls too far behind is dropped (it reconnects)."""

        def put() -> None:
            if self.dropped:
                return
            if self.queue.qsize() >= QUEUE_LIMIT:
                self.dropped = True
                self.queue.put_nowait(None)
                return
            self.queue.put_nowait(event)

        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop is closed: the page is gone
            self.dropped = True


class LiveBoard:
    """What the demo page shows: a snapshot of the run, and a broadcast of each change to every page.

    ``clock`` is injectable for tests."""

    def __init__(self, info: dict[str, Any], *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self._commits: deque[dict[str, Any]] = deque(maxlen=MAX_COMMITS)
        self._generations: deque[dict[str, Any]] = deque(maxlen=MAX_GENERATIONS)
        self._lag: deque[dict[str, Any]] = deque(maxlen=MAX_LAG_POINTS)
        self._applied_steps: deque[int] = deque(maxlen=MAX_COMMITS)
        # every committed step the follower found, charted or not (a follower far behind charts
        # only the newest manifests): what the "committed" tile counts
        self._known: set[int] = set()
        # how the applied steps reached the follower: "signal" (the signal server announced them)
        # or "store" (a store poll found them first)
        self._paths: dict[str, int] = {"signal": 0, "store": 0}
        # committed head, step held, and when each step not held yet was produced or first seen;
        # the demo's runs start at step 0, so a copy holding nothing is head + 1 steps behind
        self._staleness = StalenessTracker(first_step=0)
        self._info = dict(info)
        self._trainer: dict[str, Any] | None = None
        self._applied: dict[str, Any] | None = None
        self._error: str | None = None
        self._status = "starting"
        self._seq = 0
        self._answer_listeners: list[Callable[[dict[str, Any]], None]] = []
        self.started = clock()

    # ---------------------------------------------------------------- read

    def snapshot(self) -> dict[str, Any]:
        """Everything the page needs to draw itself from scratch."""
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, Any]:
        return {
            **self._info,
            "seq": self._seq,
            "now": self._clock(),
            "started": self.started,
            "status": self._status,
            "error": self._error,
            "trainer": self._trainer,
            "head": self._staleness.head,
            "applied": self._applied,
            "staleness": self._staleness_locked(),
            "commits": list(self._commits),
            "generations": list(self._generations),
            "applied_steps": list(self._applied_steps),
            "lag": list(self._lag),
            "paths": dict(self._paths),
            "known": self._known_locked(),
        }

    def _known_locked(self) -> dict[str, int]:
        """How many committed steps the follower has found: training steps (> 0), and the initial
        weights (step 0, 1 or 0)."""
        return {"training": sum(1 for s in self._known if s > 0), "initial": int(0 in self._known)}

    @property
    def applied_step(self) -> int | None:
        """The step the inference copy holds."""
        with self._lock:
            return None if self._applied is None else int(self._applied["step"])

    @property
    def trainer(self) -> dict[str, Any] | None:
        """The trainer's last report (self-contained mode)."""
        with self._lock:
            return None if self._trainer is None else dict(self._trainer)

    @property
    def error(self) -> str | None:
        """The last error shown on the page, if any."""
        with self._lock:
            return self._error

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscription:
        """A new page; its first event is the snapshot."""
        sub = Subscription(loop)
        with self._lock:
            self._subs.append(sub)
        sub.put({"type": "snapshot", "data": self.snapshot()})
        return sub

    def on_answer(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(entry)`` for every change of the inference copy's answer, with the entry the
        page's answer history gets (its step, text, sync time and staleness), from the applying
        thread and under the board's lock: ``fn`` must only hand it on (e.g. ``queue.put``)."""
        with self._lock:
            self._answer_listeners.append(fn)

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget a page."""
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        """End every page's stream."""
        with self._lock:
            subs, self._subs = self._subs, []
        for s in subs:
            s.put(None)

    # --------------------------------------------------------------- write

    def _emit_locked(self, kind: str, data: dict[str, Any]) -> None:
        self._seq += 1
        event = {"type": kind, "seq": self._seq, "now": self._clock(), "data": data}
        for s in self._subs:
            s.put(event)
        self._subs = [s for s in self._subs if not s.dropped]

    def _staleness_locked(self) -> dict[str, Any]:
        """How far the inference copy is behind the store: committed (store head) - applied.

        The one definition of staleness (:class:`deltasync.signal.StalenessTracker`, as in the
        fetcher's metrics): the page's tile, the staleness chart and the terminal all show
        ``steps`` from here (or, on the page, the same difference of the same snapshot's
        ``head`` and ``applied.step``). ``seconds``: since the oldest committed step the copy
        does not hold yet was produced (or first seen). Steps the trainer made that are not
        committed yet are not staleness (they are the uploader's pipeline, ``trainer.step``).
        """
        st = self._staleness.staleness(self._clock())
        return {
            "committed": self._staleness.head,
            "applied": self._staleness.held,
            "steps": st.steps,
            "seconds": st.seconds,
        }

    def reset(self, **info: Any) -> None:
        """Forget the run (a new one starts) and set the new run's ``info`` (its number...) in
        the same step, so that no snapshot shows the new run's facts with the old run's state;
        every page gets a fresh snapshot."""
        with self._lock:
            self._commits.clear()
            self._generations.clear()
            self._lag.clear()
            self._applied_steps.clear()
            self._known.clear()
            self._paths = dict.fromkeys(self._paths, 0)
            self._staleness.forget()
            self._trainer = self._applied = self._error = None
            self._info.update(bit_exact=None, **info)
            self._status = "starting"
            self._seq += 1
            event = {"type": "snapshot", "seq": self._seq, "now": self._clock(), "data": self._snapshot_locked()}
            for s in self._subs:
                s.put(event)

    def set_status(self, status: str) -> None:
        """A one-word state for the header (waiting, training, following, done...)."""
        with self._lock:
            self._status = status
            self._emit_locked("status", {"status": status})

    def set_error(self, message: str | None) -> None:
        """Show (or clear, with None) an error banner."""
        with self._lock:
            if message == self._error:
                return
            self._error = message
            self._emit_locked("error", {"error": message})

    def set_info(self, **info: Any) -> None:
        """Update static facts (model shape, full checkpoint bytes...) once they are known."""
        with self._lock:
            self._info.update(info)
            self._emit_locked("info", dict(info))

    def trainer_step(self, step: int, **data: Any) -> None:
        """The trainer produced ``step`` (loss, lr, push time ...)."""
        with self._lock:
            self._staleness.note(step, self._clock())
            self._trainer = {**(self._trainer or {}), "step": step, **data}
            self._emit_locked("trainer", self._trainer)

    def trainer_update(self, **data: Any) -> None:
        """Amend the trainer's report without a new step (done, commit results...)."""
        with self._lock:
            self._trainer = {**(self._trainer or {}), **data}
            self._emit_locked("trainer", self._trainer)

    def set_head(self, step: int, *, found: Iterable[int] = ()) -> None:
        """The newest committed step: the trainer's commit (self-contained mode), or the newest
        step the follower found in the store, with ``found``, the committed steps it listed (each
        is counted once, whether its manifest is charted or not). A head that moves on is a
        staleness sample."""
        with self._lock:
            newer = self._staleness.head is None or step > self._staleness.head
            self._staleness.committed(step, self._clock(), exact=False)
            before = len(self._known)
            self._known.update(int(s) for s in found)
            if newer or len(self._known) != before:
                self._emit_locked("head", {"head": step, "known": self._known_locked()})
            if newer:
                self._tick_locked()

    def committed(self, commit: dict[str, Any]) -> None:
        """The store holds a new committed step (read from its manifest)."""
        with self._lock:
            step = int(commit["step"])
            self._staleness.committed(step, self._clock(), exact=False)
            commit = {**commit, "seen": self._clock()}
            self._commits.append(commit)
            self._known.add(step)
            if commit.get("held"):
                self._applied_steps.append(step)
            self._emit_locked("commit", commit)

    def applied(self, step: int, **data: Any) -> None:
        """The inference copy now holds ``step``; ``data`` carries text, sync time, and ``via``:
        how the ``steps`` it applied reached it ("signal" or "store"), counted in ``paths``."""
        with self._lock:
            via = data.get("via")
            if via is not None:
                self._paths[via] = self._paths.get(via, 0) + int(data.get("steps", 1))
            now = self._clock()
            produced = self._staleness.time_of(step)
            self._applied = {"step": step, "t": now, "latency": None if produced is None else now - produced, **data}
            if not self._applied_steps or self._applied_steps[-1] != step:
                self._applied_steps.append(step)
            self._staleness.hold(step, now)
            text = data.get("text")
            staleness = self._staleness_locked()
            if text is not None and (not self._generations or self._generations[-1]["text"] != text):
                # the page's answer history and the terminal's lines, one entry per answer change:
                # the step that first answered it, its sync time and the staleness right after it
                answer = {
                    "step": step,
                    "t": now,
                    "text": text,
                    "sync_ms": data.get("sync_ms"),
                    "lag": staleness["steps"],
                }
                self._generations.append(answer)
                for fn in self._answer_listeners:
                    fn(dict(answer))
            self._emit_locked("applied", {**self._applied, "staleness": staleness, "paths": dict(self._paths)})
            self._tick_locked()

    def tick(self) -> None:
        """Record a staleness sample (the follower calls it about once a second while it waits)."""
        with self._lock:
            self._tick_locked()

    def _tick_locked(self) -> None:
        """A staleness sample for the chart: committed head minus the step held, as now.

        Staleness only changes when the head moves on (a commit) or the copy applies a step, and
        both sample it (plus :meth:`tick`), so the chart draws its real course: it rises with
        each commit the copy does not hold yet and drops when the copy catches up."""
        st = self._staleness_locked()
        point = {"t": self._clock(), "steps": st["steps"], "seconds": st["seconds"]}
        self._lag.append(point)
        self._emit_locked("lag", point)
