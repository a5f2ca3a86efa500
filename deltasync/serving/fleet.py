"""An engine's reports to the signal server's fleet view (the backend's ``signal`` option).

Rank 0 of an engine reports for the whole engine (its ranks commit or undo together): the
engine's status (:class:`~deltasync.serving.engine.mirror.EngineStatus`) becomes the
replica's step and state, with the step's manifest digest read from the run. The run's name at
the signal server is ``signal_run``, else the run id the store records (looked up until a step
is committed). Reporting never fails or blocks an update: :meth:`EngineReporter.report` takes the
status and returns; the store look-ups (run name, digest) run on a
:class:`~deltasync._util.worker.SerialWorker` (a newer status replaces one not yet handled) and the
:class:`~deltasync.signal.FleetReporter` sends in the background and retries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deltasync._util.worker import SerialWorker, WorkerClosed
from deltasync.errors import DeltaSyncError, SignalRejected
from deltasync.serving.engine.mirror import EngineStatus
from deltasync.signal import FleetReporter, ReplicaState, default_replica

if TYPE_CHECKING:
    from deltasync.protocol.audit import AuditReport
    from deltasync.run import RunReader

__all__ = ["EngineReporter", "replica_state"]

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
