"""The one definition of staleness: how far a copy of the weights is behind the trainer.

- **steps**: the newest committed step seen minus the step held (0 when current);
- **seconds**: now minus the time of the oldest commit not held yet (0 when current). A
  commit's time is what its publisher said (a signal event's ``time``) when known, else the
  time it was first seen (or produced, for a demo that trains in-process): a copy that only
  polls the store sees a commit up to one poll interval late, and under-reports by as much.

:class:`StalenessTracker` keeps what both need, and both the fetcher's Prometheus metrics
(:class:`deltasync.fetcher.metrics.SyncMetrics`) and the demo's page compute staleness with
it. It holds no lock: its owner serialises the calls.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["MAX_PENDING", "Staleness", "StalenessTracker"]

MAX_PENDING = 1024  # commit times kept for steps not held yet


@dataclass(frozen=True, slots=True)
class Staleness:
    """How far behind a copy is: ``steps`` (None while unknown) and ``seconds``."""

    steps: int | None
    seconds: float


class StalenessTracker:
    """Commits seen (with their times) against the step held.

    ``first_step``: the run's first step, when known, so that a copy holding nothing is
    ``head - first_step + 1`` steps behind; None (the default): steps are unknown until
    something is held.
    """

    def __init__(self, *, first_step: int | None = None, max_pending: int = MAX_PENDING) -> None:
        self.first_step = first_step
        self.max_pending = max(2, max_pending)
        #: the newest committed step seen, and its commit time
        self.head: int | None = None
        self.head_time: float | None = None
        #: the step the copy holds
        self.held: int | None = None
        self._steps: list[int] = []  # sorted steps above the held one ...
        self._times: list[float] = []  # ... and their commit (or first-seen) times

    @property
    def pending(self) -> int:
        """How many steps above the held one have a recorded time."""
        return len(self._steps)

    def time_of(self, step: int) -> float | None:
        """The recorded commit (or first-seen) time of ``step``, if it is not held yet."""
        i = bisect.bisect_left(self._steps, step)
        return self._times[i] if i < len(self._steps) and self._steps[i] == step else None

    def note(self, step: int, t: float, *, exact: bool = False) -> None:
        """Record ``t`` as the time of ``step``; the head does not move. A first-seen time (not
        ``exact``) only fills a gap; a publisher's time replaces a later one."""
        if self.held is not None and step <= self.held:
            return
        i = bisect.bisect_left(self._steps, step)
        if i < len(self._steps) and self._steps[i] == step:
            if exact:
                self._times[i] = min(self._times[i], t)
            return
        self._steps.insert(i, step)
        self._times.insert(i, t)
        if len(self._steps) > self.max_pending:
            # fold the oldest entry into the next one: staleness may read high, never low
            self._times[1] = min(self._times[0], self._times[1])
            del self._steps[0], self._times[0]

    def committed(self, step: int, t: float, *, exact: bool = True) -> None:
        """``step`` is committed, at ``t`` (``exact``: the publisher's time; else when it was first seen,
        which a later exact time replaces). Older steps than the head only record their time."""
        if self.head is None or step > self.head:
            self.head, self.head_time = step, t
        elif step == self.head and self.head_time is not None and exact:
            self.head_time = min(self.head_time, t)  # seen first, then told its commit time
        self.note(step, t, exact=exact)

    def hold(self, step: int, t: float) -> None:
        """The copy now holds ``step`` (at ``t``); a step past the head is committed too."""
        self.held = step
        if self.head is None or step > self.head:
            self.head, self.head_time = step, t
        i = bisect.bisect_right(self._steps, step)
        del self._steps[:i], self._times[:i]

    def forget(self) -> None:
        """Forget everything (a new run starts)."""
        self.head = self.head_time = self.held = None
        self._steps.clear()
        self._times.clear()

    def staleness(self, now: float) -> Staleness:
        """Steps and seconds behind at ``now`` (never negative)."""
        if self.head is None:
            steps = None
        elif self.held is not None:
            steps = max(0, self.head - self.held)
        elif self.first_step is not None:
            steps = max(0, self.head - self.first_step + 1)
        else:
            steps = None
        head = self.head
        times = [t for s, t in zip(self._steps, self._times, strict=True) if head is not None and s <= head]
        seconds = max(0.0, now - min(times)) if times else 0.0
        return Staleness(steps, seconds)


def commit_time(committed_at: float | None) -> float | None:
    """A publisher's commit time, or None when it is missing or nonsense (0, negative, NaN)."""
    if committed_at is None or not math.isfinite(committed_at) or committed_at <= 0:
        return None
    return committed_at
