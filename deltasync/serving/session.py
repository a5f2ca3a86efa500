"""One driven server: :class:`ServerSession`, its phase and what follows from each call's answer.

A session owns its :class:`~deltasync.serving.vllm_server.VLLMServer`, the step it serves and the
weight version it reported, the backoff of a step it refused, its fleet reporter, its auditor and
last audit, and its own count of updates. Its :class:`~deltasync.serving.phase.Phase` changes in one
place, :meth:`ServerSession.transition`, which logs the change, tells the listeners and reports the
server's fleet state (:func:`deltasync.serving.fleet.server_state`).

Every call it makes raises only :class:`~deltasync.errors.DeltaSyncError` (the
:class:`VLLMServer` contract): :class:`~deltasync.errors.ServerUnreachable` makes it ``unreachable``,
any other ``failed``; either way the other sessions are not touched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltasync._util.worker import SerialWorker
from deltasync.errors import DeltaSyncError, ServerUnreachable
from deltasync.serving.fleet import NOT_COUNTED, ServerFacts, server_state
from deltasync.serving.phase import TRANSITIONS, Phase
from deltasync.serving.vllm_server import ServerUpdate, UpdateOutcome, VLLMServer

if TYPE_CHECKING:
    from deltasync.serving.audit import AuditResult, ReplicaAuditor
    from deltasync.serving.driver_metrics import DriverMetrics
    from deltasync.serving.driver_options import DriverOptions
    from deltasync.signal import FleetReporter, ReplicaState

__all__ = ["Listeners", "ServerSession", "step_of"]

log = logging.getLogger("deltasync.vllm.driver")

#: what a server that is not updated answers for a step, by its phase
_STANDING: dict[Phase, UpdateOutcome] = {
    Phase.UNREACHABLE: "unreachable",
    Phase.NEEDS_REPLACEMENT: "needs_replacement",
}
_BAD = (Phase.UNREACHABLE, Phase.FAILED, Phase.NEEDS_REPLACEMENT)


def step_of(version: str | None) -> int | None:
    """The deltasync step of a weight version (deltasync sets it to the step), None when it is not one."""
    return int(version) if version is not None and version.isdigit() and len(version) < 19 else None


@dataclass(slots=True)
class Listeners:
    """Who hears of a driver's sessions (shared by them; :meth:`VLLMDriver.follow` sets the callbacks)."""

    #: every update run on a server, in order (the driver's history and metrics)
    journal: Callable[[ServerUpdate], None]
    metrics: DriverMetrics | None = None
    #: ``on_change(url, what)``: a server became unreachable or failed, or was set up again
    on_change: Callable[[str, str], None] | None = None
    #: ``on_audit(url, result, why)``: an audit's result, or (result None) why it could not run
    on_audit: Callable[[str, AuditResult | None, str | None], None] | None = None
    #: a server was set up (its first audit is queued here)
    on_set_up: Callable[[ServerSession], object] | None = None
    #: set by the driver's ``close()``: what fails from then on is its closing, not the servers'
    closing: bool = False


class ServerSession:
    """One server the driver drives (see the module doc). Its calls are made by one job at a time
    (the driver's), except the audits, which run on the session's own :attr:`lane` beside them."""

    def __init__(
        self,
        server: VLLMServer,
        store: str,
        options: DriverOptions,
        listeners: Listeners,
        *,
        clock: Callable[[], float],
        reporter: FleetReporter | None = None,
        digest: Callable[[int], str | None] | None = None,
        auditor: ReplicaAuditor | None = None,
    ) -> None:
        self.server, self.store, self.options, self.listeners = server, store, options, listeners
        self.clock, self.reporter, self.digest, self.auditor = clock, reporter, digest, auditor
        self.phase = Phase.UNINITIALISED
        #: why it is in its phase (unreachable, failed, needs replacement)
        self.why: str | None = None
        #: the step it serves and the weight version it reported last (another one: a new process)
        self.serving: int | None = None
        self.version: str | None = None
        #: the step it served before its last update (where an audit's ``rollback`` brings it back)
        self.previous: int | None = None
        #: its last update's outcome since it was set up, and whether a rollout brought it back from it
        self.last: ServerUpdate | None = None
        self.brought_back = False
        #: the step it refused last, and when it may be tried again
        self.refused: int | None = None
        self.retry_at = float("-inf")
        self.backoff = options.retry.backoff_state()
        #: updates it took (for ``AuditConfig.params_every``), and set-ups that worked
        self.updates = 0
        self.setups = 0
        #: its last audit of the step it serves, and why the last one could not run (None: it ran)
        self.audit: AuditResult | None = None
        self.audit_error: str | None = None
        #: one more at the start of each update: an audit started before it is of an older step
        self.generation = 0
        #: the session's audits, one at a time beside its updates (None: no auditor)
        self.lane = SerialWorker(f"deltasync-audit-{server.url}") if auditor is not None else None
        #: the latest audit queued on the lane
        self.pending_audit: Future[AuditResult | None] | None = None
        self._mutex = threading.Lock()  # generation and audit, read by the lane
        self._updating = threading.Lock()  # one update sequence at a time on this server

    @property
    def url(self) -> str:
        """The server's URL."""
        return self.server.url

    def __repr__(self) -> str:
        return f"ServerSession({self.url!r}, {self.phase.value}, serving={self.serving})"

    # ------------------------------------------------------------------ the phase

    def transition(self, phase: Phase, why: str | None = None) -> None:
        """Move to ``phase`` (``why``: what brought it there); log and tell a change, and report the
        server's fleet state. Raises ValueError for a move :data:`~deltasync.serving.phase.TRANSITIONS`
        does not allow (a driver bug, never an answer)."""
        was, said = self.phase, self.why
        if phase not in TRANSITIONS[was]:
            raise ValueError(f"{self.url}: no move from {was.value} to {phase.value}")
        self.phase, self.why = phase, why
        if not self.listeners.closing and (phase is not was or (why != said and phase in _BAD)):
            self._tell(was, phase, why)
        self.report()

    def _tell(self, was: Phase, phase: Phase, why: str | None) -> None:
        what = None
        if phase is Phase.UNREACHABLE:
            what = f"{why}; set up again once it answers"
        elif phase is Phase.FAILED:
            what = f"failed: {why}; set up again at the next observation"
        elif phase is Phase.READY and (
            was in (Phase.UNREACHABLE, Phase.FAILED) or (was is Phase.UNINITIALISED and self.setups > 1)
        ):
            what = f"set up again (it serves {'no step yet' if self.serving is None else f'step {self.serving}'})"
        (log.warning if phase in _BAD else log.info)(
            "%s: %s -> %s%s", self.url, was.value, phase.value, f": {why}" if why else ""
        )
        if what is not None and self.listeners.on_change is not None:
            self.listeners.on_change(self.url, what)
        metrics = self.listeners.metrics
        if metrics is not None and phase in (Phase.UNREACHABLE, Phase.READY):
            metrics.observe_server(self.url, up=phase is Phase.READY, serving=self.serving)

    def facts(self) -> ServerFacts:
        """What its fleet state is derived from."""
        return ServerFacts(self.phase, self.serving, self.why, self.last, self.brought_back, self.audit)

    def state(self) -> tuple[ReplicaState, str | None]:
        """Its fleet state and last error (:func:`~deltasync.serving.fleet.server_state`)."""
        return server_state(self.facts())

    def counted(self) -> bool:
        """Whether a driver waits for it to serve a step (``follow(until=)``): not when its fleet state is
        ``failed``, ``unreachable`` or ``needs_replacement`` (that state is reported first)."""
        return self.state()[0] not in NOT_COUNTED

    def report(self) -> None:
        """Tell the fleet view what it serves now (nothing without a reporter)."""
        if self.reporter is None:
            return
        state, error = self.state()
        digest = self.digest(self.serving) if self.serving is not None and self.digest is not None else None
        a = self.audit if self.audit is not None and self.audit.step == self.serving else None
        self.reporter.update(
            self.serving,
            state,
            digest=digest,
            last_error=error,
            audit=None if a is None else a.report(),
            audit_error=self.audit_error,
        )

    # ------------------------------------------------------------------ set-up and probes

    def setup(self) -> bool:
        """Point it at the store (``init``) and read its weight version: READY, or UNREACHABLE / FAILED."""
        try:
            self.server.init(self.store, prefetch=self.options.prefetch)
            version = self.server.weight_version()
        except ServerUnreachable as exc:
            self.transition(Phase.UNREACHABLE, f"unreachable: {exc}")
            return False
        except DeltaSyncError as exc:
            self.transition(Phase.FAILED, f"init: {exc}")
            return False
        # a new process: whatever the old one refused, lost or was audited at is history
        self.version, self.serving, self.previous = version, step_of(version), None
        self.last, self.brought_back, self.refused, self.audit = None, False, None, None
        self.backoff.reset()
        self.setups += 1
        self.transition(Phase.READY)
        if self.listeners.on_set_up is not None:
            self.listeners.on_set_up(self)
        return True

    def ensure_ready(self) -> bool:
        """Whether it answers and is set up and may be updated: one that is not set up, unreachable or
        failed is set up (again); one whose weight version changed is a new process (restarted, or
        another driver's): set up again. One that needs replacement is only probed for a new process."""
        if self.phase in (Phase.UNINITIALISED, Phase.UNREACHABLE, Phase.FAILED):
            return self.setup()
        try:
            version = self.server.weight_version()
        except ServerUnreachable as exc:
            self.transition(Phase.UNREACHABLE, f"unreachable: {exc}")
            return False
        except DeltaSyncError as exc:
            if self.phase is not Phase.NEEDS_REPLACEMENT:
                self.transition(Phase.FAILED, f"GET /weight_info: {exc}")
            return False
        if version == self.version:
            return self.phase is not Phase.NEEDS_REPLACEMENT
        self.transition(
            Phase.UNINITIALISED,
            f"weight version {version!r} where it served {self.version!r}: a new process (or another driver)",
        )
        return self.setup()

    def agreed_step(self) -> int | None:
        """The step every worker says it serves (a server started from a step's checkpoint dir knows it
        before its first update), else None. Raises DeltaSyncError when it cannot say."""
        steps = {w.step for w in self.server.workers() or []}
        return steps.pop() if len(steps) == 1 else None

    # ------------------------------------------------------------------ updates

    def standing(self, step: int) -> ServerUpdate:
        """The outcome for ``step`` of a server that was not updated (its phase says why)."""
        state = _STANDING.get(self.phase, "failed")
        why = self.why or ("restart this server" if self.phase is Phase.NEEDS_REPLACEMENT else None)
        version = None if self.serving is None else str(self.serving)
        return ServerUpdate(self.url, step, state, version, 0.0, why)

    def run_update(self, step: int, *, prepare: bool, journal: bool = True) -> ServerUpdate:
        """Run the update sequence for ``step`` (one at a time on this server); an audit started before
        it is of an older step from now on. The outcome is journaled (``journal``: else the caller
        journals it, in its own order), not recorded (:meth:`record`)."""
        with self._updating:
            with self._mutex:
                self.generation += 1
            u = self.server.update(step, pause_mode=self.options.pause_mode, prepare=prepare)
        if journal:
            self.listeners.journal(u)
        return u

    def record(self, u: ServerUpdate, *, brought_back: bool = False) -> None:
        """Take ``u`` as this server's last outcome: a step served, or why not (the phase follows).
        ``brought_back``: it took ``u.step`` and an all-or-nothing rollout brought it back (``u.version``)."""
        if u.ok:
            if self.serving != u.step:
                self.previous = self.serving
            self.serving, self.version, self.refused = u.step, u.version, None
            self.last, self.brought_back = u, False
            self.backoff.reset()
            self.updates += 1
            self.transition(Phase.READY)
            return
        self.last, self.brought_back = u, brought_back
        self.defer(u.step)  # set up again, a new process starts afresh
        why = f"step {u.step}: {u.state}: {u.error}"
        if u.version is not None:
            # the version it reports now (a refused update may leave the new one set while it stays paused):
            # the same process, not a new one, at the next probe
            self.version = u.version
        if u.state == "unreachable":
            self.transition(Phase.UNREACHABLE, f"unreachable: {u.error}")
        elif u.state == "needs_replacement":
            self.transition(Phase.NEEDS_REPLACEMENT, why)
        else:
            if not brought_back and u.state != "held_back":
                log.warning("%s: step %d not served (%s): %s", self.url, u.step, u.state, u.error)
            new_process = bool(u.workers) and all(w.store is None for w in u.workers or ())
            if new_process:  # its backend was never pointed at the store: a new process
                self.transition(Phase.UNINITIALISED, why)
            elif self.phase in (Phase.READY, Phase.BACKING_OFF):
                self.transition(Phase.BACKING_OFF)
            else:
                self.report()

    def defer(self, step: int) -> None:
        """Try ``step`` again on this server only after its backoff (longer after each refusal)."""
        self.refused = step
        self.retry_at = self.clock() + self.backoff.next_delay()

    def waiting(self, step: int) -> bool:
        """Whether ``step`` is not to be tried now: it refused it and its backoff is not over."""
        return self.refused == step and self.clock() < self.retry_at

    def behind(self, step: int) -> bool:
        """Whether it is to be brought to ``step``: it may be updated and serves an older or no step."""
        return self.phase is not Phase.NEEDS_REPLACEMENT and (self.serving is None or self.serving < step)

    # ------------------------------------------------------------------ audits

    def keep_audit(self, generation: int, result: AuditResult | None, error: str | None) -> bool:
        """Keep an audit's result (or why it could not run) unless an update started since it did
        (``generation``): then it is of an older step and dropped. Whether it was kept."""
        with self._mutex:
            if generation != self.generation:
                return False
            self.audit, self.audit_error = result, error
        self.report()
        return True

    def close(self) -> None:
        """Stop its audits (one running is abandoned), close its connections and leave the fleet view."""
        if self.lane is not None:
            self.lane.close(cancel_pending=True, timeout=0)
        self.server.close()
        if self.reporter is not None:
            self.reporter.close()
