"""The jobs of :meth:`VLLMDriver.follow <deltasync.serving.driver.VLLMDriver.follow>`: :class:`FollowScheduler`.

The driver follows a run on :class:`deltasync.signal.FollowLoop`; at each observation the scheduler
gives every idle session a job of its own (with an all-or-nothing rollout: the fleet one job), so that a
server that hangs holds only its own job. A job checks its server (setting up a new process), brings it
to the newest step seen (never past ``until``), and again while a newer one came meanwhile. The step
the fleet holds (``held``: what ``until`` waits for) counts only the servers whose fleet state is not
``failed``, ``unreachable`` or ``needs_replacement``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import TYPE_CHECKING

from deltasync.errors import ServerError
from deltasync.serving.phase import Phase

if TYPE_CHECKING:
    from deltasync.serving.audit_lane import AuditRunner
    from deltasync.serving.rollout import AllOrNothing, Rolled
    from deltasync.serving.session import Listeners, ServerSession
    from deltasync.serving.vllm_server import ServerUpdate
    from deltasync.signal import StepSeen

__all__ = ["FollowScheduler"]

log = logging.getLogger("deltasync.vllm.driver")

_FLEET = -1  # the key of the all-or-nothing job


class FollowScheduler:
    """The jobs that keep ``sessions`` at the newest step seen (see the module doc). ``update(s, step)``
    brings a session that is set up to ``step`` (the driver's one path); ``rollout``: roll each step out
    to every session or none instead."""

    def __init__(
        self,
        sessions: Sequence[ServerSession],
        pool: Executor,
        update: Callable[[ServerSession, int], Rolled],
        audits: AuditRunner,
        listeners: Listeners,
        rollout: AllOrNothing | None = None,
    ) -> None:
        self.sessions, self.pool, self.update, self.audits = sessions, pool, update, audits
        self.listeners, self.rollout = listeners, rollout
        #: the newest step seen, the step not to go past (None: none), and who hears of each update
        self.newest: int | None = None
        self.until: int | None = None
        self.on_update: Callable[[ServerUpdate], None] | None = None
        self._jobs: dict[int, Future[None]] = {}
        self._lock = threading.Lock()

    def observe(self, seen: StepSeen) -> None:
        """Each observation: a newer step, late references compared, and every idle session a job."""
        self.check_replaceable()
        if seen.step is not None and (self.newest is None or seen.step > self.newest):
            self.newest = seen.step
        for s in self.sessions:
            self.audits.recheck(s)
        self.tick()

    def act(self, step: int) -> None:
        """The loop's act: nothing more than a tick (every observation ticks; the jobs reach ``step``)."""
        self.tick()

    def tick(self) -> None:
        """Give every idle session (with a rollout strategy: the fleet) a job."""
        with self._lock:
            if self.rollout is not None:
                job = self._jobs.get(_FLEET)
                if job is None or job.done():
                    self._jobs[_FLEET] = self.pool.submit(self._fleet_job)
                return
            for i, s in enumerate(self.sessions):
                job = self._jobs.get(i)
                if job is None or job.done():
                    self._jobs[i] = self.pool.submit(self._job, s)

    def target(self) -> int | None:
        """The step the jobs bring the sessions to: the newest seen, never past ``until``."""
        step = self.newest
        return step if step is None or self.until is None else min(step, self.until)

    def held(self) -> int | None:
        """The step every session that counts serves at least (None while one serves none, or none counts)."""
        steps = [s.serving for s in self.sessions if s.counted()]
        if not steps or any(step is None for step in steps):
            return None
        return min(step for step in steps if step is not None)

    def reached(self, until: int) -> bool:
        """Whether every session that counts serves ``until`` or newer, and one does."""
        held = self.held()
        return held is not None and held >= until

    def check_replaceable(self) -> None:
        """Raises :class:`ServerError` once every server needs replacement: nothing is left to drive."""
        if all(s.phase is Phase.NEEDS_REPLACEMENT for s in self.sessions):
            raise ServerError("every vLLM server needs replacement; restart them")

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no job runs and no audit is queued or running; whether that happened within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._jobs.values())
        if wait(jobs, timeout).not_done:
            return False
        for s in self.sessions:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if s.lane is not None and not s.lane.flush(left):
                return False
        return True

    def _job(self, s: ServerSession) -> None:
        """One session's job: check it (setting up a new process), bring it to the target step, and again
        while a newer one came meanwhile."""
        try:
            checked = False
            for _ in range(8):  # bounded: a newer step came meanwhile
                step = self.target()
                if step is None or not s.behind(step) or s.waiting(step):
                    if not checked:
                        s.ensure_ready()  # a restarted, lost or recovered server is found at each observation
                    return
                if not s.ensure_ready():
                    return
                checked = True
                if not s.behind(step) or s.waiting(step):  # a new process may serve it already
                    return
                u, _ = self.update(s, step)
                if self.on_update is not None:
                    self.on_update(u)
                if not u.ok:
                    return  # refused: retried after its backoff
        except Exception:  # a job must not die silently: the next observation starts another
            if not self.listeners.closing:
                log.exception("%s: driving this server failed", s.url)

    def _fleet_job(self) -> None:
        """The all-or-nothing job: set up the servers that are new processes, then roll the target step out."""
        assert self.rollout is not None
        try:
            for s in self.sessions:
                s.ensure_ready()
            step = self.target()
            if step is None or not any(s.behind(step) and not s.waiting(step) for s in self.sessions):
                return
            for u, _ in self.rollout.roll_out(self.sessions, step):
                if self.on_update is not None:
                    self.on_update(u)
        except Exception:
            if not self.listeners.closing:
                log.exception("driving the fleet failed")
