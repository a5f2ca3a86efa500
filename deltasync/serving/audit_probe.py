"""Asking an engine for the audit's logprobs: the probes, and the prefix-cache canary twice.

:func:`http_probe` asks a vLLM OpenAI server (``POST /v1/completions``) through the bounded client
(:class:`~deltasync.serving.http_call.BoundedHTTP`: a total deadline, a body cap sized from the probe
set) and reads the answer through a typed parse: every choice, index, logprob and token id is checked,
and anything else (a JSON list, a missing ``choices``, wrong lengths, a NaN, an infinite or a
non-number logprob, a key that is not a token id) is a
:class:`~deltasync.errors.MalformedAnswer`, never an IndexError or KeyError. An engine that refuses
the probe set itself (HTTP 400: token ids outside its vocabulary) is a
:class:`~deltasync.errors.ServerError` that says what to fix. :func:`llm_probe` asks an in-process
``vllm.LLM`` the same. Judging the answers is :mod:`deltasync.serving.audit`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltasync.errors import MalformedAnswer, ServerError
from deltasync.protocol.probes import MAX_VOCAB, ProbeSet
from deltasync.serving.http_call import BoundedHTTP

__all__ = ["CANARY_TOP", "ProbeOutput", "completions_cap", "http_probe", "llm_probe"]

#: top logprobs of the canary's next token compared between its cached and its fresh answer
CANARY_TOP = 5
#: bytes an answer may take per prompt token (its prompt logprob entries) and per choice (the rest)
_PER_TOKEN, _PER_CHOICE = 1 << 10, 16 << 10


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


def completions_cap(prompts: Sequence[Sequence[int]]) -> int:
    """The most bytes the answer to a completion request of ``prompts`` may take (generous: about
    1 KiB per prompt token and 16 KiB per choice, 64 KiB more)."""
    return (64 << 10) + sum(len(p) * _PER_TOKEN + _PER_CHOICE for p in prompts)


class _Reader:
    """The typed parse of ``/v1/completions`` answers to the audit's requests."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, msg: str) -> MalformedAnswer:
        return MalformedAnswer(f"{self.where}: {msg}: not a vLLM completion answer to the audit's request")

    def choices(self, body: object, n: int) -> list[Mapping[str, Any]]:
        """The ``n`` choices of ``body``, in the order of their ``index`` (each 0 .. n-1 once)."""
        found = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(found, list) or len(found) != n:
            raise self.bad(f"expected {{'choices': [{n} choices]}}, got {_kind(body)}")
        by_index: dict[int, Mapping[str, Any]] = {}
        for c in found:
            i = c.get("index") if isinstance(c, dict) else None
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n or i in by_index:
                raise self.bad(f"a choice without its own index in [0, {n})")
            by_index[i] = c
        return [by_index[i] for i in range(n)]

    def token(self, key: object) -> int:
        """A logprobs key as a token id: ``"123"`` (prompt logprobs) or ``"token_id:123"``."""
        tail = key.rsplit(":", 1)[-1] if isinstance(key, str) else ""
        if not (tail.isascii() and tail.isdigit() and len(tail) <= 10 and int(tail) < MAX_VOCAB):
            raise self.bad(f"{_kind(key)} is not a token id in [0, {MAX_VOCAB})")
        return int(tail)

    def logprob(self, v: object) -> float:
        lp = v.get("logprob") if isinstance(v, dict) else v
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1.0:
            raise self.bad(f"{_kind(lp)} is not a logprob (a finite number <= 0)")
        return float(lp)

    def top(self, entry: object) -> dict[int, float]:
        """One position's logprobs: token id -> logprob."""
        if not isinstance(entry, dict) or not entry:
            raise self.bad(f"expected a position's logprobs {{token id: logprob}}, got {_kind(entry)}")
        return {self.token(k): self.logprob(v) for k, v in entry.items()}

    def next_token(self, choice: Mapping[str, Any]) -> dict[int, float]:
        """The top logprobs of the token a choice generated (``logprobs.top_logprobs[0]``)."""
        lp = choice.get("logprobs")
        tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
        if not isinstance(tops, list) or not tops:
            raise self.bad("a choice without logprobs.top_logprobs of its generated token")
        return self.top(tops[0])

    def prompt_row(self, tokens: Sequence[int], choice: Mapping[str, Any], i: int) -> tuple[float, ...]:
        """Probe ``i``'s row: the logprob of each of its tokens after the first."""
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(tokens):
            raise self.bad(f"probe {i}: expected prompt_logprobs of its {len(tokens)} tokens")
        row = []
        for j in range(1, len(tokens)):
            lp = self.top(entries[j]).get(int(tokens[j]))
            if lp is None:
                raise self.bad(f"probe {i}: no logprob of its token {j}")
            row.append(lp)
        return tuple(row)


def http_probe(
    api: BoundedHTTP, model: str, probes: ProbeSet, canary: Sequence[int] | None, *, timeout: float = 120.0
) -> ProbeOutput:
    """Ask a vLLM OpenAI server (``api``) for the probes' logprobs: the canary first, through the prefix
    cache, then one batch of every probe (and the canary again) with ``prompt_logprobs``; each request
    whole within ``timeout`` seconds. Raises :class:`~deltasync.errors.ServerError` (its subclasses
    ServerUnreachable, MalformedAnswer) only."""
    t0 = time.perf_counter()
    read = _Reader(f"{api.base_url}/v1/completions")
    common = {"model": model, "max_tokens": 1, "temperature": 0.0, "seed": 0, "return_tokens_as_token_ids": True}
    cached = None
    if canary is not None:
        body = _complete(api, {**common, "prompt": list(canary), "logprobs": CANARY_TOP}, [canary], probes, timeout)
        cached = read.next_token(read.choices(body, 1)[0])
    prompts = ([list(canary)] if canary is not None else []) + [list(r) for r in probes.tokens]
    request = {**common, "prompt": prompts, "prompt_logprobs": 0, "logprobs": CANARY_TOP}
    choices = read.choices(_complete(api, request, prompts, probes, timeout), len(prompts))
    fresh = None
    if canary is not None:
        fresh = read.next_token(choices[0])
        choices = choices[1:]
    rows = tuple(read.prompt_row(toks, c, i) for i, (toks, c) in enumerate(zip(probes.tokens, choices, strict=True)))
    return ProbeOutput(rows, fresh, cached, time.perf_counter() - t0)


def _complete(
    api: BoundedHTTP, request: dict[str, object], prompts: Sequence[Sequence[int]], probes: ProbeSet, timeout: float
) -> object:
    a = api.call("POST", "/v1/completions", deadline=timeout, cap=completions_cap(prompts), json_body=request)
    if a.status == 400:
        raise ServerError(
            f"{api.base_url}/v1/completions refused the audit's probes (HTTP 400: {a.detail}): the audit cannot run. "
            f"Are the probes' token ids (vocab_size {probes.vocab_size}) this model's? Give the receiver a probe "
            "set of the served model (AuditConfig(probes=...)), write the run's probes.json for it, or audit without "
            "(deltasync follow --no-audit)"
        )
    if not a.ok:
        raise a.error("the audit's completion request")
    return a.body


def _kind(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 80 else f"{type(v).__name__} {text[:60]}..."


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
            raise MalformedAnswer(f"probe {i}: the engine returned no prompt logprobs")
        rows.append(tuple(float(pl[j][toks[j]].logprob) for j in range(1, len(toks))))
    return ProbeOutput(tuple(rows), fresh, cached, time.perf_counter() - t0)
