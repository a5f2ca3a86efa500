"""An engine's reports to the signal server's fleet view (the backend's ``signal`` option).

Rank 0 of an engine reports for the whole engine (its ranks commit or undo together): the
engine's status (:class:`~deltasync.serving.engine.mirror.EngineStatus`) becomes the
replica's step and state, with the step's manifest digest read from the run. The run's name at
the signal server is ``signal_run``, else the run id the store records (looked up until a step
is committed). Reporting never fails or blocks an update: :meth:`EngineReporter.report` takes the
status and returns; the store look-ups (run name, digest) run on a
:class:`~deltasync._util.worker.SerialWorker` (a newer status replaces one not yet handled) and the
:class:`~deltasync.signal.FleetReporter` sends in the background and retries.

The fleet state of a server driven over HTTP is derived here too, in one function
(:func:`server_state`): from its session's phase (:class:`~deltasync.serving.phase.Phase`), its last
update's outcome (:func:`outcome_state`) and its last audit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltasync._util.worker import SerialWorker, WorkerClosed
from deltasync.errors import DeltaSyncError, SignalRejected
from deltasync.serving.engine.mirror import EngineStatus
from deltasync.serving.phase import Phase
from deltasync.signal import FleetReporter, ReplicaState, default_replica

if TYPE_CHECKING:
    from deltasync.protocol.audit import AuditReport
    from deltasync.run import RunReader
    from deltasync.serving.audit import AuditResult
    from deltasync.serving.vllm_server import ServerUpdate, UpdateOutcome

__all__ = ["NOT_COUNTED", "EngineReporter", "ServerFacts", "outcome_state", "replica_state", "server_state"]

log = logging.getLogger("deltasync.vllm")


def replica_state(status: EngineStatus) -> tuple[int | None, ReplicaState, str | None]:
    """(step, fleet state, last error) of an engine's status: ``needs_replacement`` stays; a last
    error means the last update failed (``failed``: it still serves its step); no step is ``starting``."""
    step, error = status.step, status.last_error
    if status.state == "needs_replacement":
        return step, "needs_replacement", error
    if error is not None:
        return step, "failed", error
    return step, "serving" if step is not None else "starting", None


#: The fleet state of a server after the outcome of its own update: one that kept its previous step after
#: its update failed is ``failed`` (it still serves that step, bit-exact; the driver retries); one an
#: all-or-nothing rollout held back was never touched: ``serving``.
_OUTCOME_STATES: dict[str, ReplicaState] = {
    "serving": "serving",
    "rolled_back": "failed",
    "held_back": "serving",
    "needs_replacement": "needs_replacement",
    "unreachable": "unreachable",
    "failed": "failed",
}

#: fleet states of servers a driver does not wait for (``VLLMDriver.follow(until=)``): they are reported,
#: and brought along again once they answer, are set up or are replaced
NOT_COUNTED: frozenset[ReplicaState] = frozenset({"failed", "unreachable", "needs_replacement"})


def outcome_state(outcome: UpdateOutcome) -> ReplicaState:
    """The fleet state of a server after an update with this outcome, on its own (:func:`server_state`
    says more: a server brought back by an all-or-nothing rollout is ``serving``)."""
    return _OUTCOME_STATES[outcome]


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the fleet state of one driven server is derived from (a session's :meth:`facts`)."""

    phase: Phase
    #: the step it serves (None: none known)
    serving: int | None
    #: why it is in its phase (unreachable, failed, needs replacement), None otherwise
    why: str | None = None
    #: the outcome of its last update (None: none since it was set up)
    last: ServerUpdate | None = None
    #: it took ``last.step`` and an all-or-nothing rollout brought it back to its previous step
    brought_back: bool = False
    #: its last behavioural audit (None: none)
    audit: AuditResult | None = None


def server_state(f: ServerFacts) -> tuple[ReplicaState, str | None]:
    """(fleet state, last error) of a driven server: ``diverged`` when its last audit of the step it
    serves failed (it answers, and took that step); else its phase says ``unreachable``, ``failed`` or
    ``needs_replacement``; else its last update's outcome (:func:`outcome_state`; ``serving`` when an
    all-or-nothing rollout brought it back); else ``serving`` (``starting`` while it serves no step)."""
    a = f.audit if f.audit is not None and f.audit.step == f.serving else None
    took = f.last is None or f.last.ok or f.brought_back
    if a is not None and a.diverged and took and f.phase not in (Phase.UNREACHABLE, Phase.FAILED):
        return "diverged", f"step {a.step}: " + "; ".join(a.problems)
    if f.phase is Phase.UNREACHABLE:
        return "unreachable", f.why
    if f.phase is Phase.FAILED:
        return "failed", f.why
    if f.phase is Phase.NEEDS_REPLACEMENT:
        return "needs_replacement", f.why
    u = f.last
    if u is None or u.ok:
        return ("serving" if f.serving is not None else "starting"), None
    why = f"step {u.step}: {u.state}: {u.error}"
    return ("serving" if f.brought_back else outcome_state(u.state)), why


class EngineReporter:
    """Reports one engine to the fleet view of ``run`` (default: the store's run id) at ``url``."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        run: str | None,
        replica: str | None,
        heartbeat: float,
    ) -> None:
        self.url, self.token, self.run = url, token, run
        self.replica = replica or default_replica()
        self.heartbeat = heartbeat
        self._reporter: FleetReporter | None = None
        self._reader: RunReader | None = None
        self._store_url: str | None = None
        self._off = False
        self._worker = SerialWorker("deltasync-engine-report")

    def _reader_for(self, store_url: str | None) -> RunReader | None:
        if store_url is None:
            return None
        if self._reader is None or self._store_url != store_url:
            from deltasync.run import RunReader
            from deltasync.storage import open_store

            self._reader, self._store_url = RunReader(open_store(store_url)), store_url
        return self._reader

    def report(self, status: EngineStatus, audit: AuditReport | None = None, problems: Sequence[str] = ()) -> None:
        """Report the engine's ``status`` (returns at once, never raises), with its last behavioural
        ``audit`` (``deltasync.serving.audit``) and, when that audit failed, its ``problems``: a serving
        engine is then reported ``diverged``."""
        if self._off:
            return
        with contextlib.suppress(WorkerClosed):
            self._worker.submit(lambda: self._send(status, audit, tuple(problems)), coalesce="report")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the statuses given so far are handed to the reporter (tests, shutdown)."""
        return self._worker.flush(timeout)

    def delivered(self, timeout: float | None = None) -> bool:
        """Wait until the last status reached the signal server (False while none could be sent)."""
        return self.flush(timeout) and self._reporter is not None and self._reporter.wait_reported(timeout)

    def _send(self, status: EngineStatus, audit: AuditReport | None = None, problems: tuple[str, ...] = ()) -> None:
        if self._off:
            return
        try:
            reader = self._reader_for(status.store)
            if self._reporter is None:
                run = self.run or (reader.run_id() if reader is not None else None)
                if run is None:
                    return  # nothing committed yet: the run's name is not known
                self._reporter = FleetReporter(
                    self.url, run, self.token, replica=self.replica, heartbeat=self.heartbeat
                )
            step, state, error = replica_state(status)
            if problems and state == "serving":
                state, error = "diverged", "; ".join(problems)
            digest = None
            if step is not None and reader is not None:
                with contextlib.suppress(DeltaSyncError):  # the digest is a nicety: the step is what counts
                    digest = reader.committed(step).digest
            self._reporter.update(step, state, digest=digest, last_error=error, audit=audit)
        except SignalRejected as exc:  # a bad run name or replica id: it would never work
            self._off = True
            log.warning("not reporting this engine to the fleet view: %s", exc)
        except (DeltaSyncError, OSError, ValueError) as exc:
            log.warning("cannot report this engine to the fleet view (will try at the next change): %s", exc)

    def close(self) -> None:
        """Stop reporting; the engine leaves the fleet."""
        self._worker.flush(10.0)
        self._worker.close(timeout=10.0)
        if self._reporter is not None:
            self._reporter.close()
            self._reporter = None
        if self._reader is not None:
            with contextlib.suppress(Exception):
                self._reader.store.close()
