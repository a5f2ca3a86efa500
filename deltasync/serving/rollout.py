"""The all-or-nothing rollout strategy: every server serves a step, or none does (:class:`AllOrNothing`).

1. Every server that does not serve the step yet prepares it (:meth:`VLLMServer.prepare`: each worker
   downloads, verifies and decodes it while the server keeps generating). If one cannot, no server is
   updated: each is ``held_back`` (the one that failed: ``failed`` or ``unreachable``).
2. Every one of them is updated (the whole pause sequence, in parallel). If one does not take the step,
   each server that took it is updated back to the step it served before (the node mirror keeps the
   newest two versions: nothing is downloaded) and is reported ``rolled_back``, at that step.

Refused up front (every server ``held_back``, nothing touched): a server that needs replacement, or
one whose previous step is not known (it could not be brought back). Only if bringing a server back
fails too do the servers end at different steps: that server's outcome says what it serves (``state``
and ``version``), with the error, logged as an error. A failed rollout backs every server off that
step: the driver retries it after the backoff, as a whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING

from deltasync.errors import DeltaSyncError, ServerUnreachable
from deltasync.serving.phase import Phase
from deltasync.serving.session import step_of
from deltasync.serving.vllm_server import ServerUpdate

if TYPE_CHECKING:
    from deltasync.serving.audit import AuditResult
    from deltasync.serving.audit_lane import AuditRunner
    from deltasync.serving.session import ServerSession

__all__ = ["AllOrNothing", "Rolled"]

log = logging.getLogger("deltasync.vllm.driver")

#: one server's outcome of a rollout, with the audit queued after it took the step (None: none)
Rolled = tuple[ServerUpdate, "Future[AuditResult | None] | None"]


class AllOrNothing:
    """Rolls a step out to every session or to none (see the module doc); calls run in parallel on ``pool``,
    and each server that took the step is audited by ``audits``."""

    def __init__(self, pool: Executor, audits: AuditRunner) -> None:
        self.pool = pool
        self.audits = audits

    def roll_out(self, sessions: Sequence[ServerSession], step: int) -> list[Rolled]:
        """One outcome per session, in their order (see the module doc)."""
        todo = [s for s in sessions if s.serving != step]
        if not todo:
            return [(ServerUpdate(s.url, step, "serving", str(step), 0.0), None) for s in sessions]
        previous = {id(s): s.serving if s.serving is not None else _agreed(s) for s in todo}
        why = [f"{s.url} needs replacement" for s in sessions if s.phase is Phase.NEEDS_REPLACEMENT] + [
            f"{s.url} serves no known step (it could not be brought back)" for s in todo if previous[id(s)] is None
        ]
        if why:
            stuck = {id(s): s.standing(step) for s in todo if s.phase is Phase.NEEDS_REPLACEMENT}
            return self._held(sessions, step, todo, stuck, f"step {step} not rolled out: {'; '.join(why)}")
        # 1. prepare everywhere (nothing paused)
        failed = {id(s): u for s, u in zip(todo, self.pool.map(lambda s: _prepare(s, step), todo), strict=True) if u}
        if failed:
            names = ", ".join(u.url for u in failed.values())
            return self._held(sessions, step, todo, failed, f"step {step} not rolled out: {names} could not prepare it")
        # 2. update everywhere
        futs = [self.pool.submit(s.run_update, step, prepare=False, journal=False) for s in todo]
        took = {id(s): f.result() for s, f in zip(todo, futs, strict=True)}
        for s in todo:
            s.listeners.journal(took[id(s)])
        refused = [s for s in todo if not took[id(s)].ok]
        if not refused:
            out: dict[int, Rolled] = {}
            for s in todo:
                s.record(took[id(s)])
                out[id(s)] = (took[id(s)], self.audits.submit(s))
            return _in_order(sessions, step, out)
        known = {k: v for k, v in previous.items() if v is not None}  # every one (refused up front otherwise)
        return self._bring_back(sessions, step, todo, took, known, refused)

    def _bring_back(
        self,
        sessions: Sequence[ServerSession],
        step: int,
        todo: list[ServerSession],
        took: dict[int, ServerUpdate],
        previous: dict[int, int],
        refused: list[ServerSession],
    ) -> list[Rolled]:
        """3. bring back every server that took ``step``: the others refused it."""
        names = ", ".join(s.url for s in refused)
        back = {
            id(s): self.pool.submit(s.run_update, previous[id(s)], prepare=False, journal=False)
            for s in todo
            if took[id(s)].ok
        }
        out: dict[int, Rolled] = {}
        for s in todo:
            u = took[id(s)]
            if not u.ok:
                s.record(u)
                out[id(s)] = (u, None)
                continue
            prev, b = previous[id(s)], back[id(s)].result()
            s.listeners.journal(b)
            pause = u.pause_s + b.pause_s
            if b.ok:
                why = f"step {step} was not taken by {names}; brought back to step {prev}"
                out[id(s)] = (ServerUpdate(s.url, step, "rolled_back", b.version, pause, why, b.workers), None)
                s.record(out[id(s)][0], brought_back=True)
                continue
            # it still serves ``step`` when the way back was refused (rolled back to ``step``)
            still = b.state == "rolled_back" and b.version == str(step)
            broken = f"step {step} was not taken by {names}, and bringing this server back to step {prev} failed"
            log.error("all-or-nothing rollout of step %d: %s: %s (%s)", step, s.url, broken, b.error)
            state = "serving" if still else b.state
            outcome = ServerUpdate(s.url, step, state, b.version, pause, f"{broken}: {b.error}", b.workers)
            if not still:
                s.serving = step_of(b.version)  # what it serves now, as it says
            s.record(outcome)
            if still:
                s.defer(step)  # the fleet backs off the step as a whole
            out[id(s)] = (outcome, None)
        return _in_order(sessions, step, out)

    def _held(
        self,
        sessions: Sequence[ServerSession],
        step: int,
        todo: list[ServerSession],
        failed: dict[int, ServerUpdate],
        why: str,
    ) -> list[Rolled]:
        """Outcomes of a rollout stopped before any server was updated: every server keeps its step."""
        out: dict[int, Rolled] = {}
        for s in todo:
            u = failed.get(id(s))
            if u is None:
                version = None if s.serving is None else str(s.serving)
                u = ServerUpdate(s.url, step, "held_back", version, 0.0, why)
            s.record(u)
            out[id(s)] = (u, None)
        log.warning("%s", why)
        return _in_order(sessions, step, out)


def _agreed(s: ServerSession) -> int | None:
    try:
        return s.agreed_step()
    except DeltaSyncError:
        return None


def _prepare(s: ServerSession, step: int) -> ServerUpdate | None:
    """None when ``s`` prepared ``step``, else the outcome that says why not."""
    t0 = time.perf_counter()
    try:
        s.server.prepare(step)
    except ServerUnreachable as exc:
        return ServerUpdate(s.url, step, "unreachable", None, time.perf_counter() - t0, f"prepare: {exc}")
    except DeltaSyncError as exc:
        return ServerUpdate(s.url, step, "failed", None, time.perf_counter() - t0, f"prepare: {exc}")
    return None


def _in_order(sessions: Sequence[ServerSession], step: int, out: dict[int, Rolled]) -> list[Rolled]:
    return [out.get(id(s)) or (ServerUpdate(s.url, step, "serving", str(step), 0.0), None) for s in sessions]
