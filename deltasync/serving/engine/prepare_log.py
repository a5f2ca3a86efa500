"""How one engine worker's prepares went: :class:`PrepareLog` and its :class:`PrepareReport` per prepare.

A prepare's latency counts from when its step was first heard of (a prefetch poll or signal, a
prepare or an update asking for it) to prepared; it is *starved* when it took far longer than its
build's own work (:data:`STARVED_FACTOR`): the build waited for CPU, a lock or a leader instead of
working. Each prepare that settles is reported: :attr:`PrepareLog.last`, the ``on_prepared`` hook,
the metrics' ``observe_prepare``, and the worker's report file
(:class:`~deltasync.serving.engine.prepared.PreparedFile`) that a waiter in the engine core reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from deltasync.serving.engine.mirror_metrics import MirrorMetrics
from deltasync.serving.engine.prepared import PreparedFile

__all__ = ["STARVED_FACTOR", "STARVED_SLACK", "BuildWork", "PrepareLog", "PrepareReport"]

log = logging.getLogger("deltasync.mirror")

#: a prepare is reported as starved (a warning and ``deltasync_prepare_starved_total``) when it took
#: more than this many times its build's own work, plus :data:`STARVED_SLACK` seconds: the build waited
#: for CPU, a lock or a leader instead of working
STARVED_FACTOR = 4.0
STARVED_SLACK = 2.0
#: the steps heard of and not served yet that are remembered (older ones are forgotten)
SEEN_WINDOW = 64


@dataclass(frozen=True, slots=True)
class PrepareReport:
    """One prepare that settled (:attr:`EngineMirror.last_prepare`).

    step: the step prepared (or asked for, when it failed). ok / error: whether it worked, and why
    not. latency_s: from when the step was first heard of to now. build_s: the CPU seconds of the
    node's build when this worker's request built the version (None: another worker's did, or it was
    there). starved: far longer than that work. tag: the id of an asked prepare (``EngineMirror.ask``).
    """

    step: int | None
    ok: bool
    error: str | None
    latency_s: float
    build_s: float | None
    starved: bool
    tag: str | None = None

    def to_json(self) -> dict[str, object]:
        """The JSON object of the report (as the worker's report file holds it)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class BuildWork:
    """What getting one version spent: getting the node's version, the build's own CPU seconds when
    this worker's request built it, and all of it (seconds; None: not known)."""

    got_s: float | None = None
    build_s: float | None = None
    total_s: float | None = None


class PrepareLog:
    """When each step not served yet was first heard of, and the report of each prepare that settles.

    clock: the mirror's clock. metrics: where a prepare's latency goes (``observe_prepare``).
    """

    def __init__(self, clock: Callable[[], float], metrics: MirrorMetrics) -> None:
        self.clock = clock
        self.metrics = metrics
        #: when each step not served yet was first heard of: the start of its prepare latency
        self.heard: dict[int, float] = {}
        #: what the running prepare spent getting its version (set while it prepares)
        self.work = BuildWork()
        #: the last prepare that settled (None: none yet)
        self.last: PrepareReport | None = None
        #: called with each report (from the preparing thread)
        self.on_prepared: Callable[[PrepareReport], None] | None = None
        #: the worker's report file (None: it reports nowhere)
        self.file: PreparedFile | None = None

    def seen(self, step: int, serving: int | None, at: float | None = None) -> None:
        """``step`` was heard of at ``at`` (default now), unless it was before or is served already."""
        if step not in self.heard and (serving is None or step > serving):
            self.heard[step] = self.clock() if at is None else at
            for old in [s for s in self.heard if s < step - SEEN_WINDOW]:  # never grows without bound
                del self.heard[old]

    def served(self, step: int) -> None:
        """The engine serves ``step``: it and older steps are not waited for any more."""
        for held in [s for s in self.heard if s <= step]:
            del self.heard[held]

    def settle(
        self, asked: int | None, step: int | None, t0: float, error: str | None, tag: str | None = None
    ) -> PrepareReport:
        """The report of a prepare that ended (asked for ``asked``, prepared ``step``, started at ``t0``):
        its latency, and whether its build was starved. Recorded and handed on (:meth:`tell`)."""
        now = self.clock()
        target = step if step is not None else asked
        since = self.heard.get(target, t0) if target is not None else t0
        latency, took = now - since, now - t0
        work = self.work if error is None else BuildWork()
        build_s = work.build_s
        starved = error is None and build_s is not None and took > STARVED_FACTOR * build_s + STARVED_SLACK
        if starved:
            log.warning(
                "the prepare of step %s was starved: %.2f s (%.2f s from first heard of), of which the node's "
                "build worked %.2f CPU s and getting it took %.2f s: the leader or this worker waited for CPU "
                "(a busy engine on few cores), the node lock or a leader start (deltasync_prepare_starved_total)",
                target,
                took,
                latency,
                build_s,
                work.got_s if work.got_s is not None else float("nan"),
            )
        self.work = BuildWork()
        report = PrepareReport(target, error is None, error, round(latency, 4), build_s, starved, tag)
        self.last = report
        if error is None:
            log.info("step %s prepared %.3f s after it was first heard of (build %s s)", target, latency, build_s)
            self.metrics.observe_prepare(latency, starved=starved)
        return report

    def tell(self, report: PrepareReport, *, prepared: int | None, serving: int | None) -> None:
        """Hand ``report`` to the report file and the ``on_prepared`` hook (a failing one is logged: a
        report must not fail the prepare)."""
        _safely(lambda: self._write(report, prepared=prepared, serving=serving))
        hook = self.on_prepared
        if hook is not None:
            _safely(lambda: hook(report))

    def report_to(self, path: Path, *, prepared: int | None, serving: int | None) -> PreparedFile:
        """Report each prepare that settles, and the worker's state, in the file at ``path``; written now."""
        self.file = PreparedFile(path)
        self._write(None, prepared=prepared, serving=serving)
        return self.file

    def close(self) -> None:
        """The worker leaves: its report file goes."""
        if self.file is not None:
            self.file.remove()

    def _write(self, report: PrepareReport | None, *, prepared: int | None, serving: int | None) -> None:
        if self.file is not None:
            self.file.write(None if report is None else report.to_json(), prepared=prepared, serving=serving)


def _safely(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a report must not fail the prepare
        log.warning("reporting a prepare failed", exc_info=True)
