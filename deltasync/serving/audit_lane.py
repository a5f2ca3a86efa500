"""A driver's behavioural audits, beside its updates: :class:`AuditRunner`.

Each server's audits run on its session's own lane (a :class:`~deltasync._util.worker.SerialWorker`),
so that an audit never delays an update: the next update of that server starts at once, a queued
audit of an older step is cancelled by the next one (coalesced), and a running one is abandoned:
its result, for a step the server no longer serves, is dropped (the session's generation moved on).

The audit asks what :func:`~deltasync.serving.audit.audit_server` asks, and judges the answers only
when no update of that server started meanwhile (else some may come from the next step's weights).
An audit that could not run (a request or the judging raised) is a log line at
WARNING, a metric (``DriverMetrics.observe_audit_unavailable``), a fleet field (the report's
``audit_error``) and an ``on_audit(url, None, why)`` callback. A step whose reference arrived after its
audit is compared once it does: :meth:`AuditRunner.recheck`, at each observation, asks the auditor
(:meth:`~deltasync.serving.audit.ReplicaAuditor.recheck`: no engine call) and reports what it finds.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from deltasync._util.worker import WorkerClosed
from deltasync.errors import DeltaSyncError, ServerError
from deltasync.serving.audit import ParamsAudit, ProbeOutput, http_probe, run_params_audit
from deltasync.serving.worker_api import AUDIT_PARAMS

if TYPE_CHECKING:
    from deltasync.serving.audit import AuditResult
    from deltasync.serving.audit_policy import AuditActionPolicy
    from deltasync.serving.session import Listeners, ServerSession

__all__ = ["AuditRunner"]

log = logging.getLogger("deltasync.vllm.driver")


class AuditRunner:
    """Runs the audits of a driver's sessions (see the module doc) and takes ``policy``'s action."""

    def __init__(self, policy: AuditActionPolicy, listeners: Listeners) -> None:
        self.policy = policy
        self.listeners = listeners

    def submit(self, s: ServerSession, *, params: bool | None = None) -> Future[AuditResult | None] | None:
        """Queue an audit of ``s`` at the step it serves (None: it has no auditor, or is closing). ``params``:
        with its workers' parameter audit (default: every ``AuditConfig.params_every`` updates). A queued
        audit of ``s`` not started yet is replaced."""
        if s.auditor is None or s.lane is None:
            return None
        every = s.auditor.source.config.params_every
        with_params = params if params is not None else every > 0 and s.updates % every == 0
        generation = s.generation
        try:
            fut = s.lane.submit(lambda: self._run(s, generation, with_params), coalesce="audit")
        except WorkerClosed:
            return None
        s.pending_audit = fut
        return fut

    def recheck(self, s: ServerSession) -> None:
        """Compare ``s``'s last audit against the step's reference if it had none and one arrived since
        (on its lane; cheap: the auditor reads the reference, the engine is not asked again)."""
        last = s.audit
        if s.auditor is None or s.lane is None or last is None or last.divergence is not None:
            return
        generation = s.generation
        with contextlib.suppress(WorkerClosed):
            s.lane.submit(lambda: self._recheck(s, generation, last), coalesce="recheck")

    def _run(self, s: ServerSession, generation: int, params: bool) -> AuditResult | None:
        assert s.auditor is not None
        if generation != s.generation:
            return None  # an update came since it was queued: it would audit another step
        step = s.serving
        try:
            # a server booted from a step's checkpoint dir reports no weight version before its first update;
            # its workers know the step
            step = step if step is not None else s.agreed_step()
            if step is None:
                return None
            out, pa = _ask(s, params)
            if generation != s.generation:
                # an update started while it asked: some answers may come from the next step's weights, so
                # they are not judged at all (the auditor's memory of this replica's last answers stays true)
                log.info("%s: the audit of step %d was overtaken by an update: dropped", s.url, step)
                return None
            result = s.auditor.judge(step, out, pa)
        except DeltaSyncError as exc:
            self._unavailable(s, generation, step, str(exc))
            return None
        except Exception as exc:  # a job must not die silently: said like an audit that could not run
            log.exception("%s: the audit of step %s failed", s.url, step)
            self._unavailable(s, generation, step, f"{type(exc).__name__}: {exc}")
            return None
        return self._keep(s, generation, result)

    def _keep(self, s: ServerSession, generation: int, result: AuditResult) -> AuditResult | None:
        if not s.keep_audit(generation, result, None):
            log.info("%s: the audit of step %d was overtaken by an update: dropped", s.url, result.step)
            return None
        if self.listeners.on_audit is not None:
            self.listeners.on_audit(s.url, result, None)
        if self.policy.apply(s, result):
            self.submit(s)  # rolled back: audit the step it serves now
        return result

    def _unavailable(self, s: ServerSession, generation: int, step: int | None, why: str) -> None:
        if self.listeners.closing or not s.keep_audit(generation, None, why):
            return  # overtaken by an update (or the driver closed under it): nothing to say of that step
        log.warning("%s: the audit of step %s could not run: %s", s.url, step, why)
        if self.listeners.metrics is not None:
            self.listeners.metrics.observe_audit_unavailable(s.url)
        if self.listeners.on_audit is not None:
            self.listeners.on_audit(s.url, None, why)

    def _recheck(self, s: ServerSession, generation: int, last: AuditResult) -> None:
        assert s.auditor is not None
        try:
            found = s.auditor.recheck(last)
        except DeltaSyncError as exc:
            log.warning("%s: the audit of step %d could not be compared again: %s", s.url, last.step, exc)
            return
        if found is None or s.audit is not last:
            return
        log.info("%s: step %d's reference arrived: %s", s.url, last.step, found.summary())
        self._keep(s, generation, found)


def _ask(s: ServerSession, params: bool) -> tuple[ProbeOutput, ParamsAudit | None]:
    """What ``s``'s server answers to the audit's requests, not judged yet (the requests of
    :func:`~deltasync.serving.audit.audit_server`; the lane judges only answers no update overtook)."""
    assert s.auditor is not None
    source, server = s.auditor.source, s.server
    if server.is_paused():
        # a paused server holds every request until it is resumed: its audit would wait for that
        raise ServerError(f"{server.url}: paused, so its answers cannot be audited now")
    timeout = min(source.config.timeout, server.timeout)
    out = http_probe(server.api, server.model(), source.probes(), source.canary(), timeout=timeout)
    if not params:
        return out, None
    return out, run_params_audit(lambda **kw: server.rpc(AUDIT_PARAMS, kw, deadline=timeout), source.config)
