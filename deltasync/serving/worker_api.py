"""deltasync's worker API, spelled once: the RPC names, their requests and their answers.

An engine's workers answer deltasync's RPCs (``collective_rpc("deltasync_status")`` in-process, or
``POST /collective_rpc`` on a vLLM server in dev mode); the HTTP driver asks them. Both sides use
the frozen types of this module: the engine side builds an answer and sends its ``to_json()``; the
asking side reads it back with ``from_json``, which checks every field's type and range and raises
:class:`~deltasync.errors.MalformedAnswer` for anything else (a wrong type, a missing field, a
string over :data:`MAX_TEXT`, more than :data:`MAX_WORKERS` answers). Nothing is read from a raw
``dict`` past this module.

Errors cross the hop typed: a worker's agreed error travels as its class's ``code`` and message
(:attr:`WorkerStatus.error_code`), and :meth:`WorkerStatus.raise_error` raises the same class
again (:func:`deltasync.errors.from_code`): nothing decides on an error's text.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from deltasync.errors import DeltaSyncError, MalformedAnswer, from_code
from deltasync.protocol.audit import AuditReport
from deltasync.signal import ReplicaState

__all__ = [
    "AUDIT_PARAMS",
    "AUDIT_REPORT",
    "INIT",
    "MAX_TEXT",
    "MAX_WORKERS",
    "METRICS",
    "PREPARE",
    "RPCS",
    "STATUS",
    "UPDATE",
    "AuditNote",
    "CommitReport",
    "ParamsChunk",
    "ParamsRequest",
    "PrepareRequest",
    "UpdateRequest",
    "WorkerState",
    "WorkerStatus",
    "results",
    "statuses",
]

INIT = "deltasync_init"
PREPARE = "deltasync_prepare"
UPDATE = "deltasync_update"
STATUS = "deltasync_status"
METRICS = "deltasync_metrics"
AUDIT_PARAMS = "deltasync_audit_params"
AUDIT_REPORT = "deltasync_audit_report"
#: deltasync's worker methods (``collective_rpc`` names)
RPCS = frozenset({INIT, PREPARE, UPDATE, STATUS, METRICS, AUDIT_PARAMS, AUDIT_REPORT})

#: the most answers one RPC may carry (one per worker of the engine)
MAX_WORKERS = 4096
#: the longest string an answer's field may hold (errors, URLs, paths); longer is malformed
MAX_TEXT = 16384
#: the most tensor names a parameter-audit chunk may list as mismatched or unchecked
MAX_NAMES = 1 << 20
_STEP_MAX = 10**15

#: a worker's state, a :data:`~deltasync.signal.ReplicaState`: only ``serving`` (its weights are a
#: step) or ``needs_replacement`` (an update failed and its weights could not be restored)
WorkerState = ReplicaState
_STATES: tuple[str, ...] = ("serving", "needs_replacement")


def _bad(what: str, msg: str) -> MalformedAnswer:
    return MalformedAnswer(f"{what}: {msg}: not deltasync's worker API (is the engine running another deltasync?)")


def _obj(v: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise _bad(what, f"expected a JSON object, got {type(v).__name__}")
    return v


def _int(v: Any, what: str, lo: int = 0, hi: int = _STEP_MAX) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(what, f"expected an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _opt_int(v: Any, what: str, lo: int = 0, hi: int = _STEP_MAX) -> int | None:
    return None if v is None else _int(v, what, lo, hi)


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e12:
        raise _bad(what, f"expected a number >= 0, got {_short(v)}")
    return float(v)


def _opt_str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise _bad(what, f"expected a string of at most {MAX_TEXT} characters, got {_short(v)}")
    return v


def _names(v: Any, what: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_NAMES or not all(isinstance(n, str) and len(n) <= 4096 for n in v):
        raise _bad(what, f"expected a list of tensor names, got {_short(v)}")
    return tuple(v)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


def results(body: Any, what: str) -> list[Any]:
    """The per-worker answers of a ``/collective_rpc`` body (``{"results": [...]}``): a non-empty list
    of at most :data:`MAX_WORKERS`, else :class:`MalformedAnswer`."""
    out = _obj(body, what).get("results")
    if not isinstance(out, list) or not out or len(out) > MAX_WORKERS:
        raise _bad(what, f"expected {{'results': [one answer per worker]}}, got {_short(body)}")
    return out


@dataclass(frozen=True, slots=True)
class CommitReport:
    """One committed update: the step now served, what was loaded, and how long the engine paused."""

    step: int
    previous: int | None
    tensors: int
    nbytes: int
    pause_s: float
    prepared: bool

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "previous": self.previous,
            "tensors": self.tensors,
            "nbytes": self.nbytes,
            "pause_s": self.pause_s,
            "prepared": self.prepared,
        }

    @classmethod
    def from_json(cls, doc: Any, what: str = "commit report") -> CommitReport:
        o = _obj(doc, what)
        prepared = o.get("prepared", False)
        if not isinstance(prepared, bool):
            raise _bad(f"{what}.prepared", f"expected true or false, got {_short(prepared)}")
        return cls(
            _int(o.get("step"), f"{what}.step"),
            _opt_int(o.get("previous"), f"{what}.previous"),
            _int(o.get("tensors", 0), f"{what}.tensors", 0, 2**40),
            _int(o.get("nbytes", 0), f"{what}.nbytes", 0, 2**62),
            _num(o.get("pause_s", 0.0), f"{what}.pause_s"),
            prepared,
        )


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker's answer to ``deltasync_status``, ``deltasync_init``, ``deltasync_prepare`` and
    ``deltasync_update``: its engine's status and rank, with what the call itself adds.

    step: the step the engine serves (None: not known to deltasync yet). prepared: the step prepared
    ahead of it. state: see :data:`WorkerState`. last_error: its last failed prepare's or update's
    error (None once a commit succeeded). store: the run's store URL it was pointed at (None: never
    set up, e.g. a new process). node_dir: where the node's mirror lives.
    error / error_code: the error of this call that this rank does not raise (every rank but the
    last answers instead of raising: vLLM would hide the others' answers), as its message and its
    class's stable code (:meth:`raise_error`).
    report: the commit an update made. preparing / prepared_file / prepare_id: a prepare's ticket
    (the step it prepares, the report file the engine core waits on, and the prepare's id).
    """

    rank: int
    step: int | None
    prepared: int | None
    state: WorkerState
    last_error: str | None
    store: str | None
    node_dir: str | None = None
    error: str | None = None
    error_code: str | None = None
    report: CommitReport | None = None
    preparing: int | None = None
    prepared_file: str | None = None
    prepare_id: str | None = None

    def to_json(self) -> dict[str, object]:
        """The RPC's JSON answer: the status fields, then only those of the others that are set."""
        out: dict[str, object] = {
            "rank": self.rank,
            "step": self.step,
            "prepared": self.prepared,
            "state": self.state,
            "last_error": self.last_error,
            "store": self.store,
        }
        extra: dict[str, object] = {
            "node_dir": self.node_dir,
            "error": self.error,
            "error_code": self.error_code,
            "report": None if self.report is None else self.report.to_json(),
            "preparing": self.preparing,
            "prepared_file": self.prepared_file,
            "prepare_id": self.prepare_id,
        }
        return {**out, **{k: v for k, v in extra.items() if v is not None}}

    @classmethod
    def from_json(cls, doc: Any, what: str = "worker status") -> WorkerStatus:
        """An answer read back, checked field by field (:class:`MalformedAnswer` otherwise)."""
        o = _obj(doc, what)
        state = o.get("state")
        if state not in _STATES:
            raise _bad(f"{what}.state", f"expected one of {_STATES}, got {_short(state)}")
        report = o.get("report")
        return cls(
            rank=_int(o.get("rank"), f"{what}.rank", 0, MAX_WORKERS),
            step=_opt_int(o.get("step"), f"{what}.step"),
            prepared=_opt_int(o.get("prepared"), f"{what}.prepared"),
            state=state,
            last_error=_opt_str(o.get("last_error"), f"{what}.last_error"),
            store=_opt_str(o.get("store"), f"{what}.store"),
            node_dir=_opt_str(o.get("node_dir"), f"{what}.node_dir"),
            error=_opt_str(o.get("error"), f"{what}.error"),
            error_code=_opt_str(o.get("error_code"), f"{what}.error_code"),
            report=None if report is None else CommitReport.from_json(report, f"{what}.report"),
            preparing=_opt_int(o.get("preparing"), f"{what}.preparing"),
            prepared_file=_opt_str(o.get("prepared_file"), f"{what}.prepared_file"),
            prepare_id=_opt_str(o.get("prepare_id"), f"{what}.prepare_id"),
        )

    def raise_error(self) -> NoReturn | None:
        """Raise this answer's error as its own class (none: return None)."""
        if self.error is None:
            return None
        raise from_code(self.error_code or DeltaSyncError.code, self.error)


def statuses(body: Any, what: str) -> list[WorkerStatus]:
    """Every worker's :class:`WorkerStatus` in a ``/collective_rpc`` body."""
    return [WorkerStatus.from_json(r, f"{what}: answer {i}") for i, r in enumerate(results(body, what))]


@dataclass(frozen=True, slots=True)
class PrepareRequest:
    """``deltasync_prepare``'s arguments: bring the mirror to ``step`` (None: the newest) in the
    background; with ``wait``, answer once it is prepared, at most ``timeout`` seconds."""

    store: str | None = None
    step: int | None = None
    wait: bool = False
    timeout: float | None = None

    def to_kwargs(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step, "wait": self.wait}
        if self.store is not None:
            out["store"] = self.store
        if self.timeout is not None:
            out["timeout"] = self.timeout
        return out

    @classmethod
    def from_kwargs(cls, store: Any = None, step: Any = None, wait: Any = False, timeout: Any = None) -> PrepareRequest:
        """The arguments as ``collective_rpc`` hands them (HTTP sends strings): checked, else ValueError."""
        number = None if step is None else int(step)
        if number is not None and not 0 <= number <= _STEP_MAX:
            raise ValueError(f"step must be in [0, {_STEP_MAX}], got {step!r}")
        seconds = None if timeout is None else float(timeout)
        if seconds is not None and not 0 < seconds < 1e7:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        flag = wait.strip().lower() in ("1", "true", "yes") if isinstance(wait, str) else bool(wait)
        return cls(None if store is None else str(store), number, flag, seconds)


@dataclass(frozen=True, slots=True)
class UpdateRequest:
    """``deltasync_update``'s arguments: make the engine serve ``step`` (None: the newest)."""

    store: str | None = None
    step: int | None = None

    def to_kwargs(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step}
        if self.store is not None:
            out["store"] = self.store
        return out


@dataclass(frozen=True, slots=True)
class ParamsRequest:
    """``deltasync_audit_params``'s arguments: re-hash from the ``start``-th tensor (by name), up to ``max_bytes``."""

    start: int = 0
    max_bytes: int = 64 << 20

    def to_kwargs(self) -> dict[str, object]:
        return {"start": self.start, "max_bytes": self.max_bytes}

    @classmethod
    def from_kwargs(cls, start: Any = 0, max_bytes: Any = 64 << 20) -> ParamsRequest:
        s, m = int(start), int(max_bytes)
        if s < 0 or m <= 0:
            raise ValueError(f"start must be >= 0 and max_bytes > 0, got {start!r}, {max_bytes!r}")
        return cls(s, m)


@dataclass(frozen=True, slots=True)
class ParamsChunk:
    """One worker's answer to ``deltasync_audit_params``: ``checked`` tensors (``nbytes``) re-hashed
    against step ``step``'s digests, those that did not match, those not held as plain copies
    (not audited), and ``next``: the next chunk's ``start`` (None: done)."""

    rank: int
    step: int | None
    checked: int
    nbytes: int
    mismatched: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()
    next: int | None = None
    seconds: float = 0.0
    error: str | None = None
    error_code: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "rank": self.rank,
            "step": self.step,
            "checked": self.checked,
            "nbytes": self.nbytes,
            "mismatched": list(self.mismatched),
            "unchecked": list(self.unchecked),
            "next": self.next,
            "seconds": self.seconds,
        }
        if self.error is not None:
            out["error"], out["error_code"] = self.error, self.error_code or DeltaSyncError.code
        return out

    @classmethod
    def from_json(cls, doc: Any, what: str = "parameter audit chunk") -> ParamsChunk:
        o = _obj(doc, what)
        return cls(
            rank=_int(o.get("rank"), f"{what}.rank", 0, MAX_WORKERS),
            step=_opt_int(o.get("step"), f"{what}.step"),
            checked=_int(o.get("checked", 0), f"{what}.checked", 0, 2**40),
            nbytes=_int(o.get("nbytes", 0), f"{what}.nbytes", 0, 2**62),
            mismatched=_names(o.get("mismatched"), f"{what}.mismatched"),
            unchecked=_names(o.get("unchecked"), f"{what}.unchecked"),
            next=_opt_int(o.get("next"), f"{what}.next", 0, 2**40),
            seconds=_num(o.get("seconds", 0.0), f"{what}.seconds"),
            error=_opt_str(o.get("error"), f"{what}.error"),
            error_code=_opt_str(o.get("error_code"), f"{what}.error_code"),
        )

    def raise_error(self) -> NoReturn | None:
        """Raise this answer's error as its own class (none: return None)."""
        if self.error is None:
            return None
        raise from_code(self.error_code or DeltaSyncError.code, self.error)


@dataclass(frozen=True, slots=True)
class AuditNote:
    """``deltasync_audit_report``'s arguments: an in-process receiver's behavioural audit of the
    engine (``serving.audit``), which the engine's own fleet reporter reports until the next update
    (``diverged`` while ``problems``). Only a receiver that has no fleet reporter of its own sends it
    (``llm_audit``): an audit is reported from one side only."""

    audit: AuditReport
    problems: tuple[str, ...] = field(default=())

    def to_kwargs(self) -> dict[str, object]:
        return {"audit": self.audit.to_dict(), "problems": list(self.problems)}

    @classmethod
    def from_kwargs(cls, audit: Any, problems: Any = None) -> AuditNote:
        """The arguments as ``collective_rpc`` hands them: checked, else a ProtocolError."""
        found = () if problems is None else problems
        if not isinstance(found, list | tuple) or not all(isinstance(p, str) and len(p) <= MAX_TEXT for p in found):
            raise _bad("audit report.problems", f"expected a list of strings, got {_short(found)}")
        return cls(AuditReport.from_dict(audit), tuple(found))
