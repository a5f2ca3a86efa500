"""Where a vLLM worker reports each prepare that settles, and how an engine core waits on those reports.

A driver asks an engine to prepare a step and waits until every worker has it
(``deltasync_prepare`` with ``wait``). The wait must not ask the workers while they serve and build:
vLLM's CPU workers spin on their message queue for a second after each request, so polling them
keeps every core busy and starves the build it waits for. So each worker writes what it knows to a
small file of its own in the node mirror's folder (:class:`PreparedFile`) whenever a prepare settles,
and the engine core reads those files (:func:`wait_prepared`) while it goes on scheduling.

A prepare someone asked for is answered with a :class:`PrepareTicket` (the step, the file to read,
the prepare's id), which travels in the worker's :class:`~deltasync.serving.worker_api.WorkerStatus`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync._util.worker import run_in_background
from deltasync.errors import DeltaSyncError
from deltasync.serving.node._safedir import private_dir, read_regular, replace_file
from deltasync.serving.worker_api import PrepareRequest, WorkerStatus

__all__ = [
    "PREPARE_TIMEOUT",
    "PrepareTicket",
    "PreparedFile",
    "deferred_prepare",
    "result_within",
    "seconds",
    "wait_prepared",
]

#: asked prepares whose outcomes a report keeps (by the id their waiter knows)
OUTCOMES = 16
#: seconds a prepare's ``wait`` lasts at most unless told (``timeout``)
PREPARE_TIMEOUT = 600.0

#: a list of the workers' JSON answers (what ``collective_rpc`` returns)
Answers = list[dict[str, object]]


@dataclass(frozen=True, slots=True)
class PrepareTicket:
    """What a waiter elsewhere needs of a prepare it asked for (:meth:`EngineMirror.ask`): the step
    being prepared (None: the run has no committed step), the worker's report file (None: it reports
    nowhere) and the prepare's id in that file's ``outcomes``."""

    step: int | None
    file: str | None
    id: str


def seconds(value: float | str | None) -> float:
    """A ``timeout`` as given (a number or a string; None or empty: :data:`PREPARE_TIMEOUT`)."""
    return PREPARE_TIMEOUT if value is None or value == "" else float(value)


def result_within(prepared: Future[Any], step: int | None, timeout: float | str | None) -> None:
    """Wait for one worker's prepare of ``step``, at most ``timeout`` seconds; raises its error, or a
    :class:`DeltaSyncError` past the timeout (the prepare goes on)."""
    limit = seconds(timeout)
    try:
        prepared.result(timeout=limit)
    except FutureTimeout:
        raise DeltaSyncError(
            f"step {step} was not prepared within {limit:g} s (it goes on preparing in the background; an update "
            "now builds it in the pause)"
        ) from None


def deferred_prepare(start: Callable[[PrepareRequest], Sequence[object]], request: PrepareRequest) -> Future[Answers]:
    """``deltasync_prepare`` with ``wait`` in an engine core that answers when a future completes:
    ``start(request)`` runs it on every worker without waiting (they answer at once), then a thread of
    the engine core waits on their report files (:func:`wait_prepared`) and completes the future."""
    answers = list(start(dataclasses.replace(request, wait=False)))
    limit = seconds(request.timeout)
    out: Future[Answers] = Future()

    def wait() -> None:
        try:
            out.set_result(wait_prepared(answers, limit))
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            out.set_exception(exc)

    run_in_background(wait, "deltasync-prepare-wait")
    return out


class PreparedFile:
    """One worker's report file: ``{"prepared", "serving", "outcomes", ...the last prepare's report}``,
    replaced atomically (a new file made ``O_EXCL | O_NOFOLLOW`` under a random name, then renamed: a
    link planted in its folder is never written through). ``outcomes`` maps the ids of the last asked prepares to their error (None:
    prepared), so that a waiter tells its own prepare's outcome from another's."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._outcomes: dict[str, str | None] = {}

    def write(self, report: object, *, prepared: int | None, serving: int | None) -> None:
        """Record ``report`` (a mirror's ``last_prepare``: a mapping or a dataclass with ``tag`` and
        ``error``; None: only the state) and the worker's state."""
        doc = _as_doc(report)
        tag = doc.get("tag")
        if tag:
            error = doc.get("error")
            self._outcomes[str(tag)] = None if error is None else str(error)
            while len(self._outcomes) > OUTCOMES:
                del self._outcomes[next(iter(self._outcomes))]
        doc.update(prepared=prepared, serving=serving, outcomes=self._outcomes)
        private_dir(self.path.parent)  # in the node's folder: mode 0700, this user's, not a link
        replace_file(self.path, json.dumps(doc).encode())  # a new O_EXCL file under a random name, renamed

    def remove(self) -> None:
        """The worker leaves: nothing to report any more."""
        self.path.unlink(missing_ok=True)


def _as_doc(report: object) -> dict[str, object]:
    if report is None:
        return {}
    if isinstance(report, Mapping):
        return {str(k): v for k, v in report.items()}
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    raise TypeError(f"a prepare's report is a mapping or a dataclass, got {type(report).__name__}")


@dataclass(frozen=True, slots=True)
class _Reported:
    """What a worker's report file says (read back; anything else is skipped as not written yet)."""

    serving: int | None
    prepared: int | None
    outcomes: Mapping[str, object]

    @classmethod
    def read(cls, path: str) -> _Reported | None:
        try:
            doc = json.loads(read_regular(path))  # O_NOFOLLOW, a regular file only
        except (OSError, ValueError):
            return None  # being replaced, or not written yet
        if not isinstance(doc, dict):
            return None
        serving, prepared, outcomes = doc.get("serving"), doc.get("prepared"), doc.get("outcomes")
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (serving, prepared)):
            return None
        return cls(serving, prepared, outcomes if isinstance(outcomes, dict) else {})

    def holds(self, step: int | None) -> bool:
        """Whether the worker serves ``step`` or a newer one, or has it (or a newer one) prepared."""
        return step is None or any(s is not None and s >= step for s in (self.serving, self.prepared))


def wait_prepared(
    answers: Sequence[object],
    timeout: float,
    *,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Answers:
    """Wait until every worker whose ``deltasync_prepare`` answer (a :class:`WorkerStatus`'s JSON) is
    in ``answers`` reported its step (``preparing``) prepared in its ``prepared_file``; returns the
    answers with ``prepared`` and ``step`` as the workers last reported them. Raises
    :class:`~deltasync.errors.MalformedAnswer` for an answer that is not a worker status, the error
    of a worker whose prepare of the step failed, or a :class:`DeltaSyncError` once ``timeout``
    seconds passed (or ``stop`` is set). Reads a small file per worker, every 10 ms at first, then
    less often (at most every 0.2 s)."""
    deadline = clock() + timeout
    out = [WorkerStatus.from_json(a, f"deltasync_prepare: answer {i}") for i, a in enumerate(answers)]
    pending = {i: s for i, s in enumerate(out) if s.prepared_file}
    pause, waiter = 0.01, stop or threading.Event()
    while True:
        for i, answer in list(pending.items()):
            assert answer.prepared_file is not None
            seen = _Reported.read(answer.prepared_file)
            if seen is None:
                continue
            if seen.holds(answer.preparing):
                out[i] = dataclasses.replace(answer, prepared=seen.prepared, step=seen.serving)
                del pending[i]
            elif answer.prepare_id is not None and seen.outcomes.get(answer.prepare_id) is not None:
                raise DeltaSyncError(  # this call's prepare failed
                    f"rank {answer.rank}: step {answer.preparing} could not be prepared: "
                    f"{seen.outcomes[answer.prepare_id]}"
                )
        if not pending:
            return [s.to_json() for s in out]
        if clock() >= deadline or waiter.wait(pause):
            ranks = sorted(str(a.rank) for a in pending.values())
            raise DeltaSyncError(
                f"step {next(iter(pending.values())).preparing} was not prepared within {timeout:g} s on "
                f"rank(s) {', '.join(ranks)} (it goes on preparing in the background; an update now builds it in "
                "the pause)"
            )
        pause = min(pause * 1.5, 0.2)
