"""A run's probe set (``probes.json``) and the trainer's references (``references/{step}.json``).

SPEC.md "Probes and references". Pure parsing and validation; reading and writing them is
:mod:`deltasync.run.probes`. Both objects are canonical JSON, written once, bounded in size.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import LOGPROB_FLOOR, SEGMENTS, AuditPolicy
from deltasync.protocol.canonical import (
    FORMAT_VERSION,
    canonical_json,
    check_version,
    field_error,
    json_digest,
    json_int,
    json_list,
    json_object,
    load_json,
)
from deltasync.protocol.digests import xxh3_128
from deltasync.protocol.keys import MAX_STEP

__all__ = [
    "MAX_PROBES",
    "MAX_PROBE_LEN",
    "MAX_PROBE_TOKENS",
    "MAX_VOCAB",
    "MIN_PROBE_LEN",
    "PROBES_KEY",
    "REFERENCES_PREFIX",
    "ProbeSet",
    "Reference",
    "parse_reference_key",
    "reference_key",
]

PROBES_KEY = "probes.json"
REFERENCES_PREFIX = "references/"
_REFERENCE_KEY = re.compile(r"references/([0-9]{12})\.json")

MAX_PROBES = 64
#: a probe has at least SEGMENTS + 1 tokens (SEGMENTS scored ones) and at most this many
MIN_PROBE_LEN = SEGMENTS + 1
MAX_PROBE_LEN = 1024
MAX_PROBE_TOKENS = 16384
MAX_VOCAB = 2**31 - 1
MAX_PROBES_BYTES = 1 << 20
MAX_REFERENCE_BYTES = 4 << 20
_DTYPE = re.compile(r"[a-z0-9_]{1,32}")


def reference_key(step: int) -> str:
    """``references/000000000120.json``: the key of step 120's reference."""
    return f"{REFERENCES_PREFIX}{json_int(step, 'step', 0, MAX_STEP):012d}.json"


def parse_reference_key(key: str) -> int | None:
    """The step a reference key belongs to, or None."""
    m = _REFERENCE_KEY.fullmatch(key)
    return int(m.group(1)) if m else None


def _check_tokens(tokens: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    rows = json_list(tokens, "probes")
    if not 1 <= len(rows) <= MAX_PROBES:
        raise field_error("probes", f"expected 1 to {MAX_PROBES} probes, got {len(rows)}")
    out = []
    total = 0
    for i, row in enumerate(rows):
        if not isinstance(row, list | tuple) or not MIN_PROBE_LEN <= len(row) <= MAX_PROBE_LEN:
            n = len(row) if isinstance(row, list | tuple) else type(row).__name__
            raise field_error(f"probe {i}", f"expected {MIN_PROBE_LEN} to {MAX_PROBE_LEN} token ids, got {n}")
        total += len(row)
        if total > MAX_PROBE_TOKENS:
            raise field_error("probes", f"more than {MAX_PROBE_TOKENS} tokens in all")
        for t in row:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise field_error(f"probe {i}", f"token id {t!r} is not an integer in [0, {vocab_size})")
        out.append(tuple(row))
    return tuple(out)


def _logprobs(row: Sequence[Any], what: str) -> tuple[float, ...]:
    """One probe's logprobs: numbers <= 1 (log_softmax rounds a hair above 0 at most), not NaN;
    ``-inf`` and anything below the floor clamped to it."""
    vals = []
    for v in row:
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v > 1.0:
            raise field_error(what, f"{_short(v)} is not a logprob (a number <= 0)")
        # an integer below any float (-10**400 parses as JSON) is below the floor too
        vals.append(max(float(v), LOGPROB_FLOOR) if isinstance(v, float) or v > LOGPROB_FLOOR else LOGPROB_FLOOR)
    return tuple(vals)


def _short(v: Any) -> str:
    """``repr(v)``, cut to 40 characters (a hostile number may have thousands of digits)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True, slots=True)
class ProbeSet:
    """A run's fixed probe set: token-id sequences every replica's logprobs are computed on.

    ``tokens``: 1 to :data:`MAX_PROBES` sequences of :data:`MIN_PROBE_LEN` to :data:`MAX_PROBE_LEN`
    ids in ``[0, vocab_size)``. ``policy``: the run's audit thresholds. :attr:`digest` names the
    probes (tokens and vocabulary, not the policy): fingerprints and references made from other
    probes are never compared with these.
    """

    tokens: tuple[tuple[int, ...], ...]
    vocab_size: int
    policy: AuditPolicy = field(default_factory=AuditPolicy)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        json_int(self.vocab_size, "vocab_size", 2, MAX_VOCAB)
        object.__setattr__(self, "tokens", _check_tokens([list(r) for r in self.tokens], self.vocab_size))

    @property
    def digest(self) -> str:
        """xxh3-128 of the canonical JSON of ``{"probes", "vocab_size"}``."""
        return xxh3_128(canonical_json({"probes": [list(r) for r in self.tokens], "vocab_size": self.vocab_size}))

    @property
    def scored(self) -> tuple[int, ...]:
        """How many logprobs each probe has (its length minus one: the first token has none)."""
        return tuple(len(r) - 1 for r in self.tokens)

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return canonical_json(
            {
                "format_version": self.format_version,
                "vocab_size": self.vocab_size,
                "probes": [list(r) for r in self.tokens],
                "policy": self.policy.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> ProbeSet:
        """Parse and validate ``probes.json`` (ProtocolError / UnsupportedVersion)."""
        raw = load_json(data, PROBES_KEY, MAX_PROBES_BYTES)
        check_version(raw, PROBES_KEY)
        o = json_object(raw, PROBES_KEY, ("format_version", "vocab_size", "probes", "policy"))
        vocab = json_int(o["vocab_size"], "vocab_size", 2, MAX_VOCAB)
        return cls(_check_tokens(o["probes"], vocab), vocab, AuditPolicy.from_dict(o["policy"]))

    def check_logprobs(self, logprobs: Sequence[Sequence[float]], what: str) -> tuple[tuple[float, ...], ...]:
        """``logprobs`` as one row per probe of :attr:`scored` finite values (``-inf`` and values below
        the floor are clamped to :data:`~deltasync.protocol.audit.LOGPROB_FLOOR`), else a ProtocolError."""
        if len(logprobs) != len(self.tokens):
            raise ProtocolError(f"{what}: {len(logprobs)} rows of logprobs for {len(self.tokens)} probes")
        out = []
        for i, (row, n) in enumerate(zip(logprobs, self.scored, strict=True)):
            if len(row) != n:
                raise ProtocolError(f"{what}: probe {i} has {len(row)} logprobs, expected {n}")
            out.append(_logprobs(row, f"{what}: probe {i}"))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Reference:
    """The trainer's per-token logprobs of the run's probes at ``step`` (``references/{step}.json``).

    ``probes_digest``: the :attr:`ProbeSet.digest` they were computed on; ``logprobs``: one row per
    probe, ``len(probe) - 1`` values each (finite, clamped to the floor); ``dtype``: the numerics
    of the trainer's forward (``bfloat16``, ``float32``, ...).
    """

    step: int
    probes_digest: str
    logprobs: tuple[tuple[float, ...], ...]
    dtype: str
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        json_int(self.step, "step", 0, MAX_STEP)
        json_digest(self.probes_digest, "probes_digest")
        if not isinstance(self.dtype, str) or not _DTYPE.fullmatch(self.dtype):
            raise field_error("dtype", f"expected 1 to 32 of [a-z0-9_], got {self.dtype!r}")
        rows = json_list(list(self.logprobs), "logprobs")
        if not 1 <= len(rows) <= MAX_PROBES:
            raise field_error("logprobs", f"expected 1 to {MAX_PROBES} rows, got {len(rows)}")
        total = 0
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, list | tuple) or not MIN_PROBE_LEN - 1 <= len(row) <= MAX_PROBE_LEN - 1:
                raise field_error(f"logprobs row {i}", "expected a list of one logprob per scored probe token")
            total += len(row)
            if total > MAX_PROBE_TOKENS:
                raise field_error("logprobs", f"more than {MAX_PROBE_TOKENS} values in all")
            out.append(_logprobs(row, f"logprobs row {i}"))
        object.__setattr__(self, "logprobs", tuple(out))

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return canonical_json(
            {
                "format_version": self.format_version,
                "step": self.step,
                "probes_digest": self.probes_digest,
                "dtype": self.dtype,
                "logprobs": [list(r) for r in self.logprobs],
            }
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview, step: int | None = None) -> Reference:
        """Parse and validate a reference; with ``step``, it must be that step's (its key's)."""
        what = "reference" if step is None else reference_key(step)
        raw = load_json(data, what, MAX_REFERENCE_BYTES)
        check_version(raw, what)
        o = json_object(raw, what, ("format_version", "step", "probes_digest", "dtype", "logprobs"))
        ref = cls(
            json_int(o["step"], "step", 0, MAX_STEP),
            json_digest(o["probes_digest"], "probes_digest"),
            tuple(json_list(o["logprobs"], "logprobs")),
            o["dtype"],
        )
        if step is not None and ref.step != step:
            raise ProtocolError(f"{what}: the reference stored under step {step} says step {ref.step}")
        return ref
