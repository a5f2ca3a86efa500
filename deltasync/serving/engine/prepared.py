"""Where a vLLM worker reports each prepare that settles, and how an engine core waits on those reports.

A driver asks an engine to prepare a step and waits until every worker has it
(``deltasync_prepare`` with ``wait``). The wait must not ask the workers while they serve and build:
vLLM's CPU workers spin on their message queue for a second after each request, so polling them
keeps every core busy and starves the build it waits for. So each worker writes what it knows to a
small file of its own in the node mirror's folder (:class:`PreparedFile`) whenever a prepare settles,
and the engine core reads those files (:func:`wait_prepared`) while it goes on scheduling.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from deltasync._util.worker import run_in_background
from deltasync.errors import DeltaSyncError
from deltasync.serving.node._safedir import private_dir, read_regular, replace_file

__all__ = ["PREPARE_TIMEOUT", "PreparedFile", "deferred_prepare", "result_within", "truthy", "wait_prepared"]

#: asked prepares whose outcomes a report keeps (by the id their waiter knows)
OUTCOMES = 16
#: seconds a prepare's ``wait`` lasts at most unless told (``timeout``)
PREPARE_TIMEOUT = 600.0


def truthy(value: Any) -> bool:
    """A flag that may come as a string (vLLM's HTTP ``/collective_rpc`` passes strings)."""
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def seconds(value: Any) -> float:
    """A ``timeout`` as given (a number or a string; None or empty: :data:`PREPARE_TIMEOUT`)."""
    return PREPARE_TIMEOUT if value is None or value == "" else float(value)


def result_within(prepared: Future[Any], step: int | None, timeout: Any) -> None:
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


def deferred_prepare(start: Callable[[dict[str, Any]], Any], kwargs: Mapping[str, Any]) -> Future[list[Any]]:
    """``deltasync_prepare`` with ``wait`` in an engine core that answers when a future completes:
    ``start(kwargs)`` runs it on every worker without waiting (they answer at once), then a thread of
    the engine core waits on their report files (:func:`wait_prepared`) and completes the future."""
    answers = list(start(dict(kwargs, wait=False)))
    limit = seconds(kwargs.get("timeout"))
    out: Future[list[Any]] = Future()

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

    def write(self, report: Mapping[str, Any] | None, *, prepared: int | None, serving: int | None) -> None:
        """Record ``report`` (a mirror's ``last_prepare``; None: only the state) and the worker's state."""
        if report is not None and report.get("tag"):
            self._outcomes[str(report["tag"])] = report.get("error")
            while len(self._outcomes) > OUTCOMES:
                del self._outcomes[next(iter(self._outcomes))]
        doc = {**(report or {}), "prepared": prepared, "serving": serving, "outcomes": self._outcomes}
        private_dir(self.path.parent)  # in the node's folder: mode 0700, this user's, not a link
        replace_file(self.path, json.dumps(doc).encode())  # a new O_EXCL file under a random name, renamed

    def remove(self) -> None:
        """The worker leaves: nothing to report any more."""
        self.path.unlink(missing_ok=True)


def wait_prepared(
    answers: list[Any],
    timeout: float,
    *,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[Any]:
    """Wait until every worker whose ``deltasync_prepare`` answer is in ``answers`` reported its step
    (``preparing``) prepared in its ``prepared_file``; returns the answers with ``prepared`` and
    ``last_error`` as the workers last reported them. Raises the error of a worker whose prepare of
    the step failed, or a :class:`DeltaSyncError` once ``timeout`` seconds passed (or ``stop`` is set).
    Reads a small file per worker, every 10 ms at first, then less often (at most every 0.2 s)."""
    deadline = clock() + timeout
    pending = {i: a for i, a in enumerate(answers) if isinstance(a, Mapping) and a.get("prepared_file")}
    out = [dict(a) if isinstance(a, Mapping) else a for a in answers]
    pause, waiter = 0.01, stop or threading.Event()
    while True:
        for i, answer in list(pending.items()):
            step = answer.get("preparing")
            try:
                doc = json.loads(read_regular(answer["prepared_file"]))  # O_NOFOLLOW, a regular file only
            except (OSError, ValueError):
                continue  # being replaced, or not written yet
            if not isinstance(doc, dict):
                continue
            serving, prepared = doc.get("serving"), doc.get("prepared")
            if step is None or (serving is not None and serving >= step) or (prepared is not None and prepared >= step):
                out[i].update(prepared=prepared, step=serving)
                del pending[i]
            elif (doc.get("outcomes") or {}).get(answer.get("prepare_id")) is not None:  # this call's prepare failed
                error = doc["outcomes"][answer["prepare_id"]]
                raise DeltaSyncError(f"rank {answer.get('rank')}: step {step} could not be prepared: {error}")
        if not pending:
            return out
        if clock() >= deadline or waiter.wait(pause):
            ranks = sorted(str(a.get("rank")) for a in pending.values())
            raise DeltaSyncError(
                f"step {next(iter(pending.values())).get('preparing')} was not prepared within {timeout:g} s on "
                f"rank(s) {', '.join(ranks)} (it goes on preparing in the background; an update now builds it in "
                "the pause)"
            )
        pause = min(pause * 1.5, 0.2)
