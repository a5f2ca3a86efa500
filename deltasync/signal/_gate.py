"""The staleness gate: wait until a run's live replicas serve a step, from the trainer's side.

:func:`wait_for_fleet` reads the run's fleet from the signal server (``GET /v1/runs/{run}/fleet``)
until enough live replicas serve ``step - max_lag`` or newer: every one (default), at least
``quorum`` of them (an integer), or that fraction of them (a float in (0, 1]); and only while at
least ``min_replicas`` replicas report (a fleet nobody reports to is not "all caught up"). A replica serves a step
when it reported that step or a newer one and its weights are intact (``serving``, or ``failed``:
its last update failed and it still serves its step, bit-exact). A replica reported ``unreachable``
(a sidecar gets no answer from its server: dead, hung or cut off) serves nobody: by default
(``unreachable="exclude"``) it is left out of the live replicas, neither counted as serving nor
waited for, and named in a warning and in the timeout's report; ``unreachable="wait"`` counts it as
a live replica behind, so the gate waits until it answers and serves the step. A ``diverged``
replica (its behavioural audit failed, docs/audit.md) still holds its step and counts by default;
with ``healthy_only=True`` only ``serving`` replicas whose last audit ran count as serving (``failed``
and ``diverged`` ones, and a ``serving`` one that reports ``audit_error``, are waited for like
replicas behind). On timeout it raises
:class:`~deltasync.errors.StalenessTimeout` with who is behind, who was excluded and what to do.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Literal

from deltasync._util.text import escape_text
from deltasync.errors import SignalRejected, SignalUnavailable, StalenessTimeout
from deltasync.signal._client import SignalClient
from deltasync.signal._fleet import FleetView, ReplicaStatus

__all__ = ["UNREACHABLE_POLICIES", "UnreachablePolicy", "fleet_ready", "wait_for_fleet"]

log = logging.getLogger("deltasync.signal.fleet")

#: What the gate does with a replica reported ``unreachable``: leave it out of the live replicas
#: (``exclude``, named in the gate's warnings and report) or wait for it as a replica behind (``wait``).
UnreachablePolicy = Literal["exclude", "wait"]
UNREACHABLE_POLICIES: tuple[UnreachablePolicy, ...] = ("exclude", "wait")


def _counted(view: FleetView, unreachable: UnreachablePolicy) -> list[ReplicaStatus]:
    """The replicas the gate counts as live under ``unreachable``."""
    if unreachable == "wait":
        return list(view.replicas)
    return [r for r in view.replicas if r.state != "unreachable"]


def _excluded(view: FleetView, unreachable: UnreachablePolicy) -> list[ReplicaStatus]:
    return [] if unreachable == "wait" else [r for r in view.replicas if r.state == "unreachable"]


def _needed(live: int, quorum: int | float | None) -> int:
    """How many of ``live`` replicas must serve the step."""
    if quorum is None:
        return live
    if isinstance(quorum, float):
        return math.ceil(quorum * live - 1e-9)
    return quorum


def _check_quorum(quorum: int | float | None, min_replicas: int, max_lag: int, unreachable: str = "exclude") -> None:
    if unreachable not in UNREACHABLE_POLICIES:
        raise ValueError(f"unreachable must be one of {UNREACHABLE_POLICIES}, got {unreachable!r}")
    if isinstance(quorum, bool) or not (
        quorum is None or (isinstance(quorum, int) and quorum >= 1) or (isinstance(quorum, float) and 0 < quorum <= 1)
    ):
        raise ValueError(f"quorum must be None (every live replica), an int >= 1 or a float in (0, 1]; got {quorum!r}")
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
        raise ValueError(f"min_replicas must be an int >= 0, got {min_replicas!r}")
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag must be an int >= 0, got {max_lag!r}")


def fleet_ready(
    view: FleetView,
    step: int,
    *,
    max_lag: int = 0,
    quorum: int | float | None = None,
    min_replicas: int = 1,
    unreachable: UnreachablePolicy = "exclude",
    healthy_only: bool = False,
) -> bool:
    """Whether ``view`` has enough live replicas serving ``step - max_lag`` or newer (see the module doc)."""
    _check_quorum(quorum, min_replicas, max_lag, unreachable)
    floor = step - max_lag
    counted = _counted(view, unreachable)
    ready = sum(r.serves_at_least(floor, healthy_only=healthy_only) for r in counted)
    live = len(counted)
    return live >= min_replicas and ready >= _needed(live, quorum)


def _report(
    run: str,
    step: int,
    max_lag: int,
    quorum: int | float | None,
    min_replicas: int,
    timeout: float,
    view: FleetView | None,
    error: str | None,
    unreachable: UnreachablePolicy = "exclude",
    healthy_only: bool = False,
) -> str:
    floor = step - max_lag
    counted = _counted(view, unreachable) if view is not None else []
    live = len(counted)
    need = _needed(live, quorum)
    who = "every live replica" if quorum is None else f"a quorum of {quorum}"
    if healthy_only:
        who += " (healthy ones only: serving, not failed or diverged, and audited when audits are configured)"
    lines = [
        f"timed out after {timeout:g} s waiting for run {run!r} to be served at step {floor} or newer "
        f"(step {step}, max lag {max_lag}; {who}, with at least {min_replicas} reporting):"
    ]
    if view is None:
        lines.append(f"  the fleet could not be read from the signal server: {error}")
    else:
        ready = [r for r in counted if r.serves_at_least(floor, healthy_only=healthy_only)]
        behind = [r for r in counted if not r.serves_at_least(floor, healthy_only=healthy_only)]
        lines.append(
            f"  {len(ready)} of {live} live replicas ready, {need} needed; head {view.head if view.head is not None else '-'}"
        )
        if behind:
            lines.append("  behind:")
            for r in behind:
                lines.append(
                    f"    {escape_text(r.replica)}: step {'-' if r.step is None else r.step}, "
                    f"lag {'-' if r.lag is None else r.lag}, state {r.state}, "
                    f"last seen {r.age_s:.1f} s ago, last error: {escape_text(r.last_error or 'none')}"
                    + (f", audit could not run: {escape_text(r.audit_error)}" if r.audit_error is not None else "")
                )
        excluded = _excluded(view, unreachable)
        if excluded:
            lines.append("  excluded (unreachable: not counted as live, unreachable='exclude'):")
            for r in excluded:
                lines.append(
                    f"    {escape_text(r.replica)}: last step {'-' if r.step is None else r.step}, "
                    f"last seen {r.age_s:.1f} s ago, last error: {escape_text(r.last_error or 'none')}"
                )
        if live < min_replicas:
            lines.append(f"  only {live} replicas report to the signal server (min_replicas={min_replicas})")
        if error is not None:
            lines.append(f"  (the last read of the fleet failed: {error})")
    lines.append(
        "what to do: look at the replicas behind (a needs_replacement one must be restarted; a failed one "
        "retries, see its last error; a diverged one serves outputs the trainer did not compute: docs/audit.md); "
        "check that every engine reports to this signal server with this run name; or allow more staleness "
        "(max_lag), a quorum, or a longer timeout"
    )
    return "\n".join(lines)


def wait_for_fleet(
    client: SignalClient,
    run: str,
    step: int,
    *,
    max_lag: int = 0,
    quorum: int | float | None = None,
    min_replicas: int = 1,
    unreachable: UnreachablePolicy = "exclude",
    healthy_only: bool = False,
    timeout: float = 600.0,
    poll: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], object] | None = None,
) -> FleetView:
    """Wait until enough live replicas of ``run`` serve ``step - max_lag`` or newer; return that fleet.

    Reads the fleet every ``poll`` seconds (``wait(seconds)`` waits; ``clock`` tells the time:
    tests inject both). A signal server that is down is retried until the timeout; one that
    refuses the request (a bad token, a bad run name) raises its SignalRejected at once.
    ``unreachable``: what a replica reported ``unreachable`` counts for (see the module doc);
    ``healthy_only``: count only ``serving`` replicas whose last audit ran (no ``audit_error``) as
    serving the step.
    Raises :class:`~deltasync.errors.StalenessTimeout` when ``timeout`` seconds pass first.
    """
    _check_quorum(quorum, min_replicas, max_lag, unreachable)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not timeout >= 0 or not poll > 0:
        raise ValueError("timeout must be >= 0 and poll > 0 seconds")
    sleep = wait if wait is not None else threading.Event().wait
    deadline = clock() + timeout
    view: FleetView | None = None
    error: str | None = None
    behind: set[str] = set()  # replicas seen behind during this wait
    while True:
        try:
            view = client.fleet(run)
            error = None
            if fleet_ready(
                view,
                step,
                max_lag=max_lag,
                quorum=quorum,
                min_replicas=min_replicas,
                unreachable=unreachable,
                healthy_only=healthy_only,
            ):
                excluded = _excluded(view, unreachable)
                if excluded:
                    log.warning(
                        "run %r: released at step %d without the unreachable replica(s) %s (unreachable='exclude')",
                        run,
                        step - max_lag,
                        ", ".join(
                            f"{escape_text(r.replica)} (last step {r.step}: {escape_text(r.last_error or 'no error')})"
                            for r in excluded
                        ),
                    )
                gone = sorted(behind - {r.replica for r in view.replicas})
                if gone:
                    log.warning(
                        "run %r: replica(s) %s left the fleet while behind step %d (stopped, or silent for longer "
                        "than their ttl_s); the gate no longer waits for them",
                        run,
                        ", ".join(gone),
                        step - max_lag,
                    )
                return view
            behind.update(
                r.replica
                for r in _counted(view, unreachable)
                if not r.serves_at_least(step - max_lag, healthy_only=healthy_only)
            )
        except SignalRejected:
            raise
        except SignalUnavailable as exc:
            error = str(exc)
        left = deadline - clock()
        if left <= 0:
            raise StalenessTimeout(
                _report(run, step, max_lag, quorum, min_replicas, timeout, view, error, unreachable, healthy_only)
            )
        sleep(min(poll, left))
