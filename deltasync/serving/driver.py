"""Drive running vLLM servers over HTTP: keep each at a run's newest committed step.

One server's update sequence (pause, the backend's four phases, the prefix-cache reset, resume) and
what a failed one leaves: :mod:`deltasync.serving.vllm_server`. :class:`VLLMDriver` is a scheduler over
one :class:`~deltasync.serving.session.ServerSession` per server (its phase, step, backoff, fleet
reporter and audits): it brings each session to a step along one path (:meth:`VLLMDriver.update`,
:meth:`~VLLMDriver.catch_up`, and the jobs of :meth:`~VLLMDriver.follow`, which runs on
:class:`deltasync.signal.FollowLoop`), or rolls a step out to all of them or none
(:class:`~deltasync.serving.rollout.AllOrNothing`). Each server's behavioural audit runs beside its
next update (:class:`~deltasync.serving.audit_lane.AuditRunner`), and a diverged server meets the
audit's action (:class:`~deltasync.serving.audit_policy.AuditActionPolicy`). With
:class:`~deltasync.serving.driver_options.FleetReporting` each server is reported to the signal
server's fleet view as one replica, so that a trainer can wait for the fleet (docs/fleet.md).

This module talks HTTP only: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from deltasync.errors import ServerError
from deltasync.serving.audit import AuditResult, AuditSource, ReplicaAuditor
from deltasync.serving.audit_lane import AuditRunner
from deltasync.serving.audit_policy import AuditActionPolicy
from deltasync.serving.driver_options import DriverOptions, FleetReporting
from deltasync.serving.phase import Phase
from deltasync.serving.rollout import AllOrNothing, Rolled
from deltasync.serving.scheduler import FollowScheduler
from deltasync.serving.session import Listeners, ServerSession
from deltasync.serving.vllm_server import PauseMode, ServerUpdate, UpdateOutcome, VLLMServer
from deltasync.signal import FleetReporter, FollowLoop, StepWatcher, replica_name

if TYPE_CHECKING:
    from deltasync.serving.driver_metrics import DriverMetrics

__all__ = [
    "DriverOptions",
    "FleetReporting",
    "PauseMode",
    "ServerSession",
    "ServerUpdate",
    "UpdateOutcome",
    "VLLMDriver",
    "VLLMServer",
]

log = logging.getLogger("deltasync.vllm.driver")

#: ``on_audit(url, result, why)``: a server's audit result, or (result None) why it could not run
OnAudit = Callable[[str, AuditResult | None, str | None], None]


class VLLMDriver:
    """Keep several vLLM servers at a run's newest committed step (see the module doc).

    ``store``: the run's store URL as the servers reach it (they download the steps themselves;
    updates carry only a step number). ``options``: how servers are updated (:class:`DriverOptions`).
    ``reporting``: report each server to a signal server's fleet view (:class:`FleetReporting`).
    ``audit``: audit each server at set-up and after each update, and take the config's action on a
    diverged one. ``metrics``: Prometheus metrics of the updates. ``clock``: for the retry backoff
    (tests inject one).

    Servers are driven independently (:meth:`follow`): each by a job of its own, so that one that
    hangs, is gone or answers garbage never holds back the others.
    """

    def __init__(
        self,
        servers: Sequence[str | VLLMServer],
        store: str,
        options: DriverOptions | None = None,
        *,
        reporting: FleetReporting | None = None,
        audit: AuditSource | None = None,
        metrics: DriverMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not servers:
            raise ValueError("VLLMDriver needs at least one server URL")
        if reporting is not None and reporting.replicas is not None and len(reporting.replicas) != len(servers):
            raise ValueError(f"replicas names {len(reporting.replicas)} replicas for {len(servers)} servers")
        self.store, self.options, self.audit_source = store, options or DriverOptions(), audit
        #: Prometheus metrics of the updates (``follow --vllm --metrics-port``), when given
        self.metrics = metrics
        #: every update run, in order
        self.history: list[ServerUpdate] = []
        self._lock = threading.Lock()
        self._listeners = Listeners(self._journal, metrics, on_set_up=lambda s: self._audits.submit(s))
        self._sessions = [self._session(i, s, reporting, clock) for i, s in enumerate(servers)]
        self._pool = ThreadPoolExecutor(len(self._sessions) + 1, thread_name_prefix="deltasync-vllm")
        policy = AuditActionPolicy(audit.config.action if audit is not None else "report", prepare=self.options.prepare)
        self._audits = AuditRunner(policy, self._listeners)
        self._rollout = AllOrNothing(self._pool, self._audits)
        rollout = self._rollout if self.options.all_or_nothing else None
        self._scheduler = FollowScheduler(
            self._sessions, self._pool, self._update, self._audits, self._listeners, rollout
        )

    def _session(
        self, i: int, server: str | VLLMServer, reporting: FleetReporting | None, clock: Callable[[], float]
    ) -> ServerSession:
        o = self.options
        if not isinstance(server, VLLMServer):
            server = VLLMServer(server, timeout=o.timeout, probe_timeout=o.probe_timeout, api_key=o.api_key)
        reporter = None
        if reporting is not None:
            names = reporting.replicas
            name = names[i] if names is not None else replica_name(urlsplit(server.url).netloc)
            reporter = FleetReporter(
                reporting.signal, reporting.run, reporting.token, replica=name, heartbeat=reporting.heartbeat
            )
        return ServerSession(
            server,
            self.store,
            o,
            self._listeners,
            clock=clock,
            reporter=reporter,
            digest=None if reporting is None else reporting.digest,
            auditor=None if self.audit_source is None else ReplicaAuditor(self.audit_source),
        )

    # ------------------------------------------------------------------ what it drives

    @property
    def servers(self) -> list[VLLMServer]:
        """The servers driven."""
        return [s.server for s in self._sessions]

    @property
    def sessions(self) -> list[ServerSession]:
        """One session per server, in the order given."""
        return list(self._sessions)

    def serving(self) -> dict[str, int | None]:
        """The step each server serves, as far as this driver knows."""
        return {s.url: s.serving for s in self._sessions}

    def unreachable(self) -> list[str]:
        """The servers whose last call got no answer (they are set up again once they answer)."""
        return [s.url for s in self._sessions if s.phase is Phase.UNREACHABLE]

    def failed(self) -> list[str]:
        """The servers whose set-up or last probe was answered with an error (set up again at the next
        observation of :meth:`follow`)."""
        return [s.url for s in self._sessions if s.phase is Phase.FAILED]

    def reports_delivered(self, timeout: float | None = None) -> bool:
        """Wait until every server's current state reached the signal server (True without reporting)."""
        return all(s.reporter.wait_reported(timeout) for s in self._sessions if s.reporter is not None)

    def close(self) -> None:
        """Close the HTTP connections (the servers keep running) and leave the fleet view. A job or an
        audit still waiting on a hung server is not waited for: its connection is closed under it."""
        self._listeners.closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in self._sessions:
            s.close()

    def __enter__(self) -> VLLMDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _journal(self, u: ServerUpdate) -> None:
        with self._lock:
            self.history.append(u)
        if self.metrics is not None:
            self.metrics.observe_update(u)

    # ------------------------------------------------------------------ one step, now

    def init(self) -> None:
        """Point every server's backend at the store, in parallel, and queue each one's first audit. A
        server that does not answer is reported ``unreachable``, one that answers with an error (no
        deltasync backend, no dev routes, not its API) ``failed``; both are set up again by
        :meth:`follow` (once they answer) and the others go on. Raises :class:`ServerError` naming each
        server's error only when every server answered with one: then nothing can be driven."""
        list(self._pool.map(lambda s: s.setup(), self._sessions))
        if all(s.phase is Phase.FAILED for s in self._sessions):
            raise ServerError(
                "could not set up deltasync on any vLLM server: "
                + "; ".join(f"{s.url}: {s.why}" for s in self._sessions)
            )

    def update(self, step: int) -> list[ServerUpdate]:
        """Update every server to ``step`` now, in parallel (servers already at it are left alone); one
        outcome per server, in the order given, each with its audit (``ServerUpdate.audit``: this call
        waits for it; :meth:`follow` never does). Each server is checked first, as :meth:`follow` does:
        one that is a new process (restarted) is set up again, one that does not answer is
        ``unreachable``. With ``all_or_nothing``: :meth:`rollout`."""
        if self.options.all_or_nothing:
            return self.rollout(step)
        return self._audited(list(self._pool.map(lambda s: self._drive(s, step), self._sessions)))

    def catch_up(self, newest: int) -> list[ServerUpdate]:
        """Update each server that is behind ``newest`` and not waiting out a backoff on that very step,
        and wait for them (and their audits); with ``all_or_nothing`` the whole fleet is rolled out when
        one is due."""
        due = [s for s in self._sessions if s.behind(newest) and not s.waiting(newest)]
        if self.options.all_or_nothing:
            return self.rollout(newest) if due else []
        return self._audited(list(self._pool.map(lambda s: self._drive(s, newest), due)))

    def rollout(self, step: int) -> list[ServerUpdate]:
        """Make every server serve ``step``, or none: one outcome per server, in the order given (see
        :mod:`deltasync.serving.rollout`). A failed rollout is retried by :meth:`catch_up` (and
        :meth:`follow`) after the backoff, as a whole."""
        return self._audited(self._rollout.roll_out(self._sessions, step))

    def _drive(self, s: ServerSession, step: int) -> Rolled:
        """The one path that brings a session to ``step``: check that it answers and is set up (setting up
        a new process: :meth:`ServerSession.ensure_ready`), then :meth:`_update` it."""
        if not s.ensure_ready():
            return s.standing(step), None
        return self._update(s, step)

    def _update(self, s: ServerSession, step: int) -> Rolled:
        """Update a session that is set up to ``step``, and once more when its refusal said it is a new
        process (set up again first). Its audit is queued, not waited for."""
        if s.serving == step:
            return ServerUpdate(s.url, step, "serving", str(step), 0.0), None
        u = s.run_update(step, prepare=self.options.prepare)
        s.record(u)
        if not u.ok and s.phase is Phase.UNINITIALISED and s.setup() and s.serving != step:
            u = s.run_update(step, prepare=self.options.prepare)
            s.record(u)
        return u, self._audits.submit(s) if u.ok else None

    def _audited(self, outcomes: list[Rolled]) -> list[ServerUpdate]:
        """The outcomes, each with the audit queued after it once that audit is done (bounded)."""
        futs = [f for _, f in outcomes if f is not None]
        if futs:
            wait(futs, self._settle_s())
        return [
            replace(u, audit=f.result())
            if f is not None and f.done() and not f.cancelled() and not f.exception()
            else u
            for u, f in outcomes
        ]

    def _settle_s(self) -> float:
        """How long a caller waits for the servers' jobs and audits to end: a call's timeout, plus an audit's."""
        audit = 0.0 if self.audit_source is None else 3 * self.audit_source.config.timeout
        return self.options.timeout + audit

    # ------------------------------------------------------------------ the audit

    def audit(self, *, params: bool = False) -> list[AuditResult | None]:
        """Audit every server at the step it serves now (on demand; ``params``: with the workers'
        parameter audit), report each, and take the policy's action on a diverged one; one result per
        server, in the order given (None: not audited: no ``audit=`` source, no known step, it could not
        run, or an update overtook it)."""
        futs = [self._audits.submit(s, params=params) for s in self._sessions]
        wait([f for f in futs if f is not None], self._settle_s())
        return [
            f.result() if f is not None and f.done() and not f.cancelled() and not f.exception() else None for f in futs
        ]

    # ------------------------------------------------------------------ following a run

    def follow(
        self,
        watcher: StepWatcher,
        *,
        until: int | None = None,
        on_update: Callable[[ServerUpdate], None] | None = None,
        on_change: Callable[[str, str], None] | None = None,
        on_audit: OnAudit | None = None,
    ) -> dict[str, int | None]:
        """Keep the servers at the newest step ``watcher`` sees (a :class:`~deltasync.signal.FollowLoop`);
        returns the step each serves once every server that counts serves ``until`` (at least one does)
        and its update's audit finished or was cancelled (bounded), or once the watcher's ``stop`` is set.
        A server counts unless its fleet state is ``failed``, ``unreachable`` or ``needs_replacement``
        (reported first): one that answers garbage never holds ``until`` back.

        At each observation (a commit, a heartbeat of the signal stream, a store poll) every server
        whose job is idle gets a new one: check that it answers (``GET /weight_info``), set it up when it
        is a new process (it was unreachable or failed, or its weight version changed), then update it
        to the newest step, and again while a newer one came meanwhile. A server that hangs holds only
        its own job. A server that refused a step is retried after its own backoff. With
        ``all_or_nothing`` one job drives the whole fleet (:meth:`rollout`). A server whose last audit
        had no reference is compared again once the reference arrives.

        ``on_update``: each update's outcome (from the server's job; its audit comes later, to
        ``on_audit``); ``on_change(url, what)``: a server became unreachable or failed, or was set up
        again; ``on_audit(url, result, why)``: each audit's result, or (result None) why it could not
        run. Raises :class:`ServerError` once every server needs replacement."""
        sched = self._scheduler
        sched.on_update, sched.until = on_update, until
        self._listeners.on_change, self._listeners.on_audit = on_change, on_audit
        FollowLoop(watcher, sched.act, held=sched.held, observe=sched.observe, until=until).run()
        if until is not None and sched.reached(until):
            # the jobs that brought the servers there still report, and their audits run: let them end
            # (a caller closes the driver next), bounded by a call's and an audit's timeout
            self.settle(self._settle_s())
        sched.check_replaceable()
        return self.serving()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no job of :meth:`follow` runs and no audit is queued or running; whether that
        happened within ``timeout``."""
        return self._scheduler.settle(timeout)
