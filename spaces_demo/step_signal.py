"""The demo's in-process wake-up: :class:`StepSignal`, the pause of the follower's StepWatcher."""

from __future__ import annotations

import threading

__all__ = ["StepSignal"]


class StepSignal:
    """Wakes the follower when a step is committed.

    ``notify(step)`` is called by the uploader's Future callbacks (in-process). The
    follower's :class:`deltasync.signal.StepWatcher` pauses between store polls with
    ``wait``, which returns early on a notification and otherwise after ``timeout``, so
    a follower that nobody notifies polls the store at that interval.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._latest: int | None = None
        self._closed = False
        self.source = "store polling"

    def notify(self, step: int) -> None:
        """A step up to ``step`` is committed."""
        with self._cond:
            if self._latest is None or step > self._latest:
                self._latest = step
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter for good."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, after: int | None, timeout: float) -> bool:
        """Wait until a step newer than ``after`` is announced; False on timeout (then poll)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or (self._latest is not None and (after is None or self._latest > after)),
                timeout=timeout,
            )
