"""A receiver's reports to the fleet view: :class:`FleetReporter`.

Every receiver (``deltasync follow``, the vLLM driver, the vLLM backend) owns one reporter per
replica it runs. :meth:`FleetReporter.update` only records the replica's new state and returns;
the reporter's own :class:`~deltasync._util.worker.SerialWorker` sends it at once, then again every
``heartbeat`` seconds, so that the server keeps the replica in the fleet (it drops replicas
silent for longer than ``ttl_s``). A failed report is logged once (then at debug level until
reports go through again) and retried with :class:`~deltasync._util.retry.Backoff`; nothing ever
reaches the caller. :meth:`FleetReporter.close` says goodbye (the replica leaves the fleet).

Identity (docs/fleet.md): each reporter draws a lease secret at start and sends it with every report
and goodbye, so the server refuses the replica id to another reporter (409) while this one holds it;
with a replica token (``deltasync replica-token``) as its token, the replica is *bound* to that
credential and no shared token can report, overwrite or remove it (403). A refusal is logged once
with the server's message and retried like any failure.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import TracebackType

import httpx

from deltasync._util.retry import RetryPolicy
from deltasync._util.worker import SerialWorker
from deltasync.errors import SignalError, SignalRejected
from deltasync.protocol.audit import AuditReport
from deltasync.signal._client import SignalClient, new_lease
from deltasync.signal._fleet import ReplicaState, check_state
from deltasync.signal._names import check_replica, check_run, default_replica

__all__ = ["FleetReporter", "Served"]

log = logging.getLogger("deltasync.signal.fleet")
_MAX_ERROR = 2000
#: the shortest time to live a reporter asks for by default (seconds)
MIN_TTL_S = 15.0


@dataclass(frozen=True, slots=True)
class Served:
    """What a replica serves: its step (None: none yet), state, the step's manifest digest, last error,
    last behavioural audit (docs/audit.md) and why its last audit could not run (None: it ran, or no
    audit is configured)."""

    step: int | None
    state: ReplicaState = "serving"
    digest: str | None = None
    last_error: str | None = None
    audit: AuditReport | None = None
    audit_error: str | None = None


def _cut(text: str | None) -> str | None:
    """``text`` within the server's bound on a report's free text."""
    return text if text is None or len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


class FleetReporter:
    """Reports one replica's state to a signal server, at each change and every ``heartbeat`` seconds.

    ``replica``: this replica's id (default ``<hostname>-<pid>``). ``ttl_s``: how long the server
    keeps it without a report (default three heartbeats plus three report timeouts, at least
    :data:`MIN_TTL_S`: a live replica whose reports are slow for a while, on a busy host or to a busy
    server, must not drop out of the fleet, where a staleness gate would stop waiting for it). ``retry``: the backoff after a failed
    report (capped by the heartbeat). ``transport`` replaces the network (tests). Starts reporting
    ``starting`` (no step) at once; :meth:`update` with what the replica serves.

    ``token``: the server's report token (or subscribe token), or this replica's replica token, which
    binds the replica to it (docs/fleet.md). ``lease``: the lease secret sent with every report
    (default: a fresh random one, :func:`~deltasync.signal.new_lease`).
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        replica: str | None = None,
        heartbeat: float = 10.0,
        ttl_s: float | None = None,
        timeout: float = 2.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        initial: Served | None = None,
        lease: str | None = None,
    ) -> None:
        if not heartbeat > 0:
            raise ValueError(f"heartbeat must be > 0 seconds, got {heartbeat!r}")
        self.run = check_run(run)
        self.replica = check_replica(replica if replica is not None else default_replica())
        self.heartbeat = float(heartbeat)
        default_ttl = max(MIN_TTL_S, 3 * (self.heartbeat + timeout))
        self.ttl_s = min(86400.0, max(1.0, default_ttl if ttl_s is None else float(ttl_s)))
        self.retry = retry or RetryPolicy(retries=0, backoff=0.5, max_backoff=30.0)
        #: reports delivered / failed (each attempt counts)
        self.sent = 0
        self.failed = 0
        self._client = SignalClient(url, token, timeout=timeout, transport=transport)
        self._lease = lease if lease is not None else new_lease()
        self._cond = threading.Condition()
        self._served = initial if initial is not None else Served(None, "starting")
        self._check(self._served)
        self._delivered: Served | None = None
        self._dirty = True
        self._closing = False
        self._failing = False
        self._worker = SerialWorker(f"deltasync-fleet-{self.replica}")
        self._worker.submit(self._loop)

    @property
    def served(self) -> Served:
        """The state this replica reports now."""
        with self._cond:
            return self._served

    @staticmethod
    def _check(served: Served) -> None:
        check_state(served.state)
        if served.step is not None and (isinstance(served.step, bool) or served.step < 0):
            raise ValueError(f"step must be None or >= 0, got {served.step!r}")

    def update(
        self,
        step: int | None,
        state: str = "serving",
        *,
        digest: str | None = None,
        last_error: str | None = None,
        audit: AuditReport | None = None,
        audit_error: str | None = None,
    ) -> None:
        """Record what the replica serves now (``state``: a :data:`~deltasync.signal.ReplicaState`, else a
        ValueError; ``audit``: its last behavioural audit, kept until the next update; ``audit_error``: why
        its last audit could not run, which keeps it out of a ``healthy_only`` gate, docs/fleet.md); it is
        reported in the background (returns at once). Both texts are cut to 2000 characters."""
        served = Served(step, check_state(state), digest, _cut(last_error), audit, _cut(audit_error))
        self._check(served)
        with self._cond:
            if self._closing or served == self._served:
                return
            self._served = served
            self._dirty = True
            self._cond.notify_all()

    def wait_reported(self, timeout: float | None = None) -> bool:
        """Wait until the current state has reached the server; whether it did within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._dirty and self._delivered == self._served, timeout)

    def wait_sent(self, n: int, timeout: float | None = None) -> bool:
        """Wait until ``n`` reports in all have reached the server (heartbeats included)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.sent >= n, timeout)

    def _loop(self) -> None:
        backoff = self.retry.backoff_state()
        while True:
            with self._cond:
                if self._closing:
                    return
                served, self._dirty = self._served, False
            try:
                self._client.report(
                    self.run,
                    self.replica,
                    step=served.step,
                    state=served.state,
                    digest=served.digest,
                    last_error=served.last_error,
                    ttl_s=self.ttl_s,
                    audit=served.audit,
                    audit_error=served.audit_error,
                    lease=self._lease,
                )
            except SignalError as exc:
                delay = min(backoff.next_delay(), self.heartbeat)
                with self._cond:
                    self.failed += 1
                    first, self._failing = not self._failing, True
                    self._dirty = True  # not delivered: send it again
                    if first and isinstance(exc, SignalRejected):  # 403/409: another holder of the id, a token
                        log.warning(
                            "the signal server refuses the reports of replica %s of run %s (retrying every %.1f s at "
                            "most; until one goes through, the fleet view does not show this reporter): %s",
                            self.replica,
                            self.run,
                            self.heartbeat,
                            exc,
                        )
                    elif first:
                        log.warning(
                            "cannot report replica %s of run %s to the signal server (retrying every %.1f s at most; "
                            "until then the fleet view shows it stale, then without it): %s",
                            self.replica,
                            self.run,
                            self.heartbeat,
                            exc,
                        )
                    else:
                        log.debug("report of replica %s failed again: %s", self.replica, exc)
                    self._cond.wait_for(lambda: self._closing, delay)
                continue
            backoff.reset()
            with self._cond:
                self.sent += 1
                self._delivered = served
                if self._failing:
                    self._failing = False
                    log.info("replica %s of run %s: reports reach the signal server again", self.replica, self.run)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._dirty or self._closing, self.heartbeat)

    def close(self, timeout: float = 5.0, *, leave: bool = True) -> None:
        """Stop reporting; with ``leave`` tell the server this replica is gone (else it ages out)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        if leave:
            self._worker.submit(self._leave)  # after the loop's last report
        self._worker.flush(timeout)
        self._worker.close(timeout=timeout)
        self._client.close()

    def _leave(self) -> None:
        try:
            self._client.leave(self.run, self.replica, lease=self._lease)
        except SignalError as exc:
            log.debug(
                "replica %s could not leave the fleet of run %s (it will age out): %s", self.replica, self.run, exc
            )

    def __enter__(self) -> FleetReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
