"""What a driver does with a server its audit found ``diverged``: :class:`AuditActionPolicy`.

The action is the run's audit config's (:data:`~deltasync.serving.audit.AuditAction`): ``report``
(the fleet view shows it ``diverged``; it keeps serving), ``pause`` (paused, its in-flight requests
aborted, and out of the rotation until it is restarted, like a server that needs replacement) or
``rollback`` (updated back to the step it served before, that step refused for a backoff, and
audited again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deltasync.errors import DeltaSyncError
from deltasync.serving.phase import Phase

if TYPE_CHECKING:
    from deltasync.serving.audit import AuditAction, AuditResult
    from deltasync.serving.session import ServerSession

__all__ = ["AuditActionPolicy"]

log = logging.getLogger("deltasync.vllm.driver")


class AuditActionPolicy:
    """Takes ``action`` on a diverged server (see the module doc); ``prepare``: a rollback prepares its
    step before pausing (:meth:`VLLMServer.update`)."""

    def __init__(self, action: AuditAction, *, prepare: bool = True) -> None:
        self.action = action
        self.prepare = prepare

    def apply(self, session: ServerSession, result: AuditResult) -> bool:
        """Act on ``result``, the session's audit of the step it serves; whether it was rolled back (its
        step is then to be audited again). An action that fails is logged, never raised."""
        if not result.diverged or self.action == "report":
            return False
        if session.phase not in (Phase.READY, Phase.BACKING_OFF) or session.serving != result.step:
            return False  # it moved on since: the audit is of a step it no longer serves
        if self.action == "pause":
            self._pause(session, result)
            return False
        return self._roll_back(session, result)

    def _pause(self, session: ServerSession, result: AuditResult) -> None:
        try:
            session.server.pause(mode="abort", clear_cache=True)
        except DeltaSyncError as exc:
            log.error("%s: diverged at step %d, and it could not be paused: %s", session.url, result.step, exc)
            return
        log.error("%s: diverged: paused and left out of the rotation until it is restarted", session.url)
        session.transition(Phase.NEEDS_REPLACEMENT, f"diverged at step {result.step}: paused; restart (or resume) it")

    def _roll_back(self, session: ServerSession, result: AuditResult) -> bool:
        before, step = session.previous, result.step
        if before is None or before == step:
            log.error("%s: diverged at step %d, and no earlier step to roll back to", session.url, step)
            return False
        b = session.run_update(before, prepare=self.prepare)
        if not b.ok:
            log.error("%s: diverged at step %d; rolling back to %d failed: %s", session.url, step, before, b.error)
            session.record(b)
            return False
        log.warning("%s: diverged at step %d: rolled back to step %d", session.url, step, before)
        session.record(b)
        session.defer(step)  # the diverged step is tried again only after the backoff
        session.transition(Phase.BACKING_OFF)
        return True
