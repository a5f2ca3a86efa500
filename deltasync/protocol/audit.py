"""The behavioural audit's math (SPEC.md "Probes and references"): fingerprints, divergence, policy.

One pure module both sides use: the trainer's references and the receivers' audits are compared
with the same functions, so "diverged" means the same everywhere. No I/O, no torch, no numpy.

Inputs are *probe logprobs*: for each probe (a token sequence of length ``L``), the ``L - 1``
per-token logprobs ``log p(t[i] | t[:i])`` for ``i = 1 .. L - 1`` (the first token has none).
Logprobs below :data:`LOGPROB_FLOOR` (``-inf`` included) are clamped to it before any math.

- :func:`fingerprint`: a compact, *quantized* summary of what an engine computes at a step. Each
  probe's tokens are cut into :data:`SEGMENTS` consecutive segments; each segment's mean logprob is
  rounded to a grid of :data:`QUANTUM` nats. Two fingerprints *agree*
  (:func:`fingerprints_agree`) when they were made from the same probes and no segment mean
  differs by more than a tolerance (default :data:`DEFAULT_TOLERANCE` nats): the tolerance is what
  an engine's non-determinism (batch composition, kernel choice) is allowed to move a segment mean.
  Rounding alone cannot give that tolerance (values near a grid line flip), so the fingerprint
  keeps the rounded values, not a hash of them.
- :func:`divergence`: the engine's logprobs against the trainer's reference on the same tokens:
  mean and max ``|ref - engine|`` over every probe token, and the k3 KL estimate
  ``mean(exp(r) - 1 - r)`` with ``r = ref - engine`` (per token). k3 is the non-negative,
  low-variance estimator RL libraries log for the train/inference mismatch; on tokens sampled
  from the engine it estimates ``KL(engine || trainer)``. Probe tokens are not sampled from
  either policy, so here it is a mismatch score on the same scale, not an unbiased KL. ``r`` is
  clipped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` inside the exponential so it stays finite.
- :func:`group_fingerprints`: replicas audited at the same step, grouped by agreeing fingerprints;
  where one group holds a strict majority, every replica outside it is an *odd one out*.
- :class:`AuditPolicy`: a run's thresholds; :meth:`AuditPolicy.breaches` names the ones a
  divergence goes over. A receiver over any threshold reports its replica ``diverged``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deltasync.errors import ProtocolError
from deltasync.protocol.canonical import field_error, json_int, json_object

__all__ = [
    "DEFAULT_TOLERANCE",
    "LOGPROB_FLOOR",
    "MAX_LOG_RATIO",
    "QUANTUM",
    "SEGMENTS",
    "AuditPolicy",
    "AuditReport",
    "Divergence",
    "FingerprintGroup",
    "check_fingerprint",
    "divergence",
    "fingerprint",
    "fingerprint_distance",
    "fingerprints_agree",
    "group_fingerprints",
]

#: logprobs are clamped to at least this (nats) before any math: ``-inf`` stays comparable
LOGPROB_FLOOR = -1.0e4
#: the log ratio inside k3's exponential is clipped to this magnitude (``exp(50)`` is finite)
MAX_LOG_RATIO = 50.0
#: segments per probe in a fingerprint
SEGMENTS = 4
#: the fingerprint's grid (nats): 1/4096
QUANTUM = 1.0 / 4096
#: how far (nats) a segment mean may move between replicas that compute the same thing
DEFAULT_TOLERANCE = 0.02
#: fingerprint prefix: the format (1), then the first 8 hex digits of the probe set's digest
_PREFIX = "fp1-"
#: hex digits per segment value (24-bit two's complement: +-2048 nats at 1/4096)
_HEX = 6
_SPAN = 1 << (4 * _HEX)
MAX_FINGERPRINT = len(_PREFIX) + 9 + 64 * SEGMENTS * _HEX


def _clamp(v: float) -> float:
    if math.isnan(v):
        raise ProtocolError("a probe logprob is NaN")
    return max(float(v), LOGPROB_FLOOR)


def _check_shape(logprobs: Sequence[Sequence[float]], what: str) -> None:
    if not logprobs:
        raise ProtocolError(f"{what}: no probes")
    for i, row in enumerate(logprobs):
        if len(row) < SEGMENTS:
            raise ProtocolError(f"{what}: probe {i} has {len(row)} logprobs, at least {SEGMENTS} needed")


def fingerprint(probes_digest: str, logprobs: Sequence[Sequence[float]]) -> str:
    """The fingerprint of an engine's probe logprobs (one row per probe), made with ``probes_digest``'s probes.

    ``fp1-<8 hex of the probes' digest>-<6 hex per segment>``: per probe, :data:`SEGMENTS` segment
    means of its logprobs, rounded to :data:`QUANTUM`, as 24-bit two's complement hex.
    """
    _check_shape(logprobs, "fingerprint")
    out: list[str] = []
    for row in logprobs:
        vals = [_clamp(v) for v in row]
        n = len(vals)
        for s in range(SEGMENTS):
            seg = vals[s * n // SEGMENTS : (s + 1) * n // SEGMENTS]
            q = round(math.fsum(seg) / len(seg) / QUANTUM)
            q = max(-(_SPAN >> 1), min((_SPAN >> 1) - 1, q))
            out.append(f"{q % _SPAN:0{_HEX}x}")
    return f"{_PREFIX}{probes_digest[:8]}-{''.join(out)}"


def _parse(fp: str) -> tuple[str, list[int]]:
    if not isinstance(fp, str) or len(fp) > MAX_FINGERPRINT or not fp.startswith(_PREFIX):
        raise ProtocolError(f"not a fingerprint: {str(fp)[:80]!r}")
    tag, sep, body = fp[len(_PREFIX) :].partition("-")
    hexdigits = "0123456789abcdef"
    if (
        not sep
        or len(tag) != 8
        or not body
        or len(body) % (_HEX * SEGMENTS)
        or not set(tag) <= set(hexdigits)
        or not set(body) <= set(hexdigits)
    ):
        raise ProtocolError(f"not a fingerprint: {fp[:80]!r}")
    vals = []
    for i in range(0, len(body), _HEX):
        q = int(body[i : i + _HEX], 16)
        vals.append(q - _SPAN if q >= _SPAN >> 1 else q)
    return tag, vals


def check_fingerprint(fp: Any) -> str:
    """``fp`` if it is a well-formed fingerprint, else a ProtocolError."""
    _parse(fp)
    return str(fp)


def fingerprint_distance(a: str, b: str) -> float | None:
    """The largest difference (nats) between two fingerprints' segment means; None when they were made
    from different probe sets (they cannot be compared)."""
    tag_a, va = _parse(a)
    tag_b, vb = _parse(b)
    if tag_a != tag_b or len(va) != len(vb):
        return None
    return max(abs(x - y) for x, y in zip(va, vb, strict=True)) * QUANTUM


def fingerprints_agree(a: str, b: str, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """Whether two fingerprints say the same computation: same probes, every segment mean within ``tolerance`` nats."""
    d = fingerprint_distance(a, b)
    return d is not None and d <= tolerance + QUANTUM / 2


@dataclass(frozen=True, slots=True)
class Divergence:
    """An engine's probe logprobs against the trainer's reference (nats; see the module doc)."""

    mean_abs: float
    max_abs: float
    kl: float

    def to_dict(self) -> dict[str, float]:
        """``{"mean_abs", "max_abs", "kl"}``."""
        return {"mean_abs": self.mean_abs, "max_abs": self.max_abs, "kl": self.kl}

    @classmethod
    def from_dict(cls, raw: Any) -> Divergence:
        """Parse ``{"mean_abs", "max_abs", "kl"}`` (finite, non-negative numbers), else a ProtocolError."""
        o = json_object(raw, "divergence", ("mean_abs", "max_abs", "kl"))
        return cls(*(_nonneg(o[k], f"divergence {k}") for k in ("mean_abs", "max_abs", "kl")))


def _nonneg(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise field_error(what, f"expected a finite number >= 0, got {v!r}")
    return float(v)


def divergence(engine: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> Divergence:
    """Compare an engine's probe logprobs with the reference's, token by token (same shapes, else a ProtocolError)."""
    if len(engine) != len(reference) or not engine:
        raise ProtocolError(f"divergence: {len(engine)} engine probes against {len(reference)} reference probes")
    diffs: list[float] = []
    k3: list[float] = []
    for i, (e_row, r_row) in enumerate(zip(engine, reference, strict=True)):
        if len(e_row) != len(r_row):
            raise ProtocolError(f"divergence: probe {i} has {len(e_row)} engine logprobs, {len(r_row)} reference ones")
        for e, r in zip(e_row, r_row, strict=True):
            lr = _clamp(r) - _clamp(e)
            diffs.append(abs(lr))
            c = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, lr))
            k3.append(math.expm1(c) - c)
    if not diffs:
        raise ProtocolError("divergence: the probes have no tokens")
    return Divergence(math.fsum(diffs) / len(diffs), max(diffs), max(0.0, math.fsum(k3) / len(k3)))


@dataclass(frozen=True, slots=True)
class AuditPolicy:
    """A run's audit thresholds (nats; None: not checked). Stored with the probes; receivers may override.

    ``max_mean_abs``, ``max_max_abs``, ``max_kl``: the largest :class:`Divergence` fields a healthy
    replica may report against the trainer's reference. ``fingerprint_tolerance``: how far replicas'
    fingerprints may differ and still agree (:func:`fingerprints_agree`).
    """

    max_mean_abs: float | None = 0.1
    max_max_abs: float | None = 2.0
    max_kl: float | None = 0.05
    fingerprint_tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        for name in ("max_mean_abs", "max_max_abs", "max_kl"):
            v = getattr(self, name)
            if v is not None:
                _nonneg(v, name)
        _nonneg(self.fingerprint_tolerance, "fingerprint_tolerance")

    def breaches(self, d: Divergence) -> tuple[str, ...]:
        """The thresholds ``d`` goes over, as readable phrases (empty: within the policy)."""
        out = []
        for field, limit in (("mean_abs", self.max_mean_abs), ("max_abs", self.max_max_abs), ("kl", self.max_kl)):
            v = getattr(d, field)
            if limit is not None and v > limit:
                out.append(f"{field} {v:.4g} > {limit:g}")
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored in ``probes.json`` (SPEC.md)."""
        return {
            "max_mean_abs": self.max_mean_abs,
            "max_max_abs": self.max_max_abs,
            "max_kl": self.max_kl,
            "fingerprint_tolerance": self.fingerprint_tolerance,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> AuditPolicy:
        """Parse a stored policy, else a ProtocolError."""
        o = json_object(raw, "policy", ("max_mean_abs", "max_max_abs", "max_kl", "fingerprint_tolerance"))

        def opt(k: str) -> float | None:
            return None if o[k] is None else _nonneg(o[k], f"policy {k}")

        return cls(
            opt("max_mean_abs"),
            opt("max_max_abs"),
            opt("max_kl"),
            _nonneg(o["fingerprint_tolerance"], "policy fingerprint_tolerance"),
        )


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What a receiver reports about its replica after an audit (the ``audit`` of a fleet report).

    ``audited_step``: the step whose weights were probed; ``fingerprint``: :func:`fingerprint` of the
    engine's probe logprobs; ``divergence``: against the trainer's reference of that step (None: no
    reference); ``tolerance``: the fingerprint tolerance of the receiver's policy, which the fleet
    view uses to group replicas.
    """

    audited_step: int
    fingerprint: str
    divergence: Divergence | None = None
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        json_int(self.audited_step, "audited_step", 0, 10**12 - 1)
        check_fingerprint(self.fingerprint)
        _nonneg(self.tolerance, "tolerance")

    def to_dict(self) -> dict[str, Any]:
        """``{"audited_step", "fingerprint", "divergence", "tolerance"}`` (``divergence`` null without a reference)."""
        return {
            "audited_step": self.audited_step,
            "fingerprint": self.fingerprint,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
            "tolerance": self.tolerance,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | Any) -> AuditReport:
        """Parse a report's ``audit`` object, else a ProtocolError."""
        o = json_object(raw, "audit", ("audited_step", "fingerprint"), ("divergence", "tolerance"))
        div = o.get("divergence")
        tol = o.get("tolerance")
        return cls(
            json_int(o["audited_step"], "audited_step", 0, 10**12 - 1),
            check_fingerprint(o["fingerprint"]),
            None if div is None else Divergence.from_dict(div),
            DEFAULT_TOLERANCE if tol is None else _nonneg(tol, "tolerance"),
        )


@dataclass(frozen=True, slots=True)
class FingerprintGroup:
    """Where one replica's fingerprint falls among the replicas audited at the same step.

    ``group``: 0 for the largest group of agreeing fingerprints at ``step`` (the majority, when
    there is one), 1, 2, ... for the others; ``size``: replicas in its group; ``of``: replicas audited
    at ``step``; ``odd_one_out``: a strict majority agrees on another fingerprint.
    """

    step: int
    group: int
    size: int
    of: int
    odd_one_out: bool


def group_fingerprints(audits: Mapping[str, AuditReport]) -> dict[str, FingerprintGroup]:
    """Group replicas (id -> last audit) by (audited step, agreeing fingerprint).

    At each step, the replica whose fingerprint agrees with the most others (ties: the smallest id)
    anchors group 0: every replica that agrees with it, within the larger of the two tolerances
    they reported. The rest are grouped the same way among themselves. When group 0 holds more
    than half of the step's replicas, every replica outside it is an odd one out; without a strict
    majority (two replicas that disagree, say) nobody is singled out, though the groups still show
    the disagreement.
    """
    by_step: dict[int, list[str]] = {}
    for rid in sorted(audits):
        by_step.setdefault(audits[rid].audited_step, []).append(rid)
    out: dict[str, FingerprintGroup] = {}
    for step, ids in by_step.items():

        def agree(a: str, b: str) -> bool:
            ra, rb = audits[a], audits[b]
            return fingerprints_agree(ra.fingerprint, rb.fingerprint, max(ra.tolerance, rb.tolerance))

        left = list(ids)
        groups: list[list[str]] = []
        while left:
            anchor = max(left, key=lambda a: (sum(agree(a, b) for b in left), -left.index(a)))
            members = [b for b in left if b == anchor or agree(anchor, b)]
            groups.append(members)
            left = [b for b in left if b not in members]
        majority = 2 * len(groups[0]) > len(ids)
        for g, members in enumerate(groups):
            for rid in members:
                out[rid] = FingerprintGroup(step, g, len(members), len(ids), majority and g > 0)
    return out
