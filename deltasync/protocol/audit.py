"""The behavioural audit's math (SPEC.md "Probes and references"): fingerprints, divergence, policy.

One pure module both sides use: the trainer's references and the receivers' audits are compared
with the same functions, so "diverged" means the same everywhere. No I/O, no torch (numpy only to
group a fleet's fingerprints).

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
- :func:`group_fingerprints` / :func:`group_step`: replicas audited at the same step, grouped by
  agreeing fingerprints (within the run's tolerance, never a report's) around a robust centre,
  in O(n) vector comparisons per step; where one group holds a strict majority, every replica
  outside it is an *odd one out*.
- :class:`AuditPolicy`: a run's thresholds; :meth:`AuditPolicy.breaches` names the ones a
  divergence goes over. A receiver over any threshold reports its replica ``diverged``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from deltasync.errors import ProtocolError
from deltasync.protocol.canonical import field_error, json_int, json_object

__all__ = [
    "DEFAULT_TOLERANCE",
    "LOGPROB_FLOOR",
    "MAX_DIVERGENCE",
    "MAX_LOG_RATIO",
    "MAX_REPRESENTATIVES",
    "MAX_TOLERANCE",
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
    "group_step",
    "parse_fingerprint",
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
#: the largest fingerprint tolerance (nats) a policy or a report may name (SPEC.md): wider than any
#: honest engine's noise by far, and still short of agreeing with everything
MAX_TOLERANCE = 100.0
#: the largest value (nats) of a divergence field or a policy threshold (SPEC.md): :func:`divergence`
#: saturates at it (an engine that far off is diverged whatever the exact figure; k3 alone could reach
#: ``exp(MAX_LOG_RATIO)`` ~ 5e21), and parsers refuse more (1e308 is not a divergence)
MAX_DIVERGENCE = 1.0e6
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
    tag, vec = parse_fingerprint(fp)
    return tag, vec.tolist()


def check_fingerprint(fp: Any) -> str:
    """``fp`` if it is a well-formed fingerprint, else a ProtocolError."""
    parse_fingerprint(fp)
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
        """Parse ``{"mean_abs", "max_abs", "kl"}`` (numbers in ``[0, MAX_DIVERGENCE]``), else a ProtocolError."""
        o = json_object(raw, "divergence", ("mean_abs", "max_abs", "kl"))
        return cls(*(_bounded(o[k], f"divergence {k}", MAX_DIVERGENCE) for k in ("mean_abs", "max_abs", "kl")))

    def __post_init__(self) -> None:
        for k in ("mean_abs", "max_abs", "kl"):
            _bounded(getattr(self, k), f"divergence {k}", MAX_DIVERGENCE)


def _bounded(v: Any, what: str, hi: float) -> float:
    """``v`` as a float if it is a number in ``[0, hi]``, else a ProtocolError naming ``what`` and the range."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= hi:
        raise field_error(what, f"expected a finite number in [0, {hi:g}], got {v!r}")
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
    kl = max(0.0, math.fsum(k3) / len(k3))
    return Divergence(*(min(v, MAX_DIVERGENCE) for v in (math.fsum(diffs) / len(diffs), max(diffs), kl)))


@dataclass(frozen=True, slots=True)
class AuditPolicy:
    """A run's audit thresholds (nats; None: not checked). Stored with the probes; receivers may override.

    ``max_mean_abs``, ``max_max_abs``, ``max_kl``: the largest :class:`Divergence` fields a healthy
    replica may report against the trainer's reference, each in ``[0, MAX_DIVERGENCE]``.
    ``fingerprint_tolerance``: how far replicas' fingerprints may differ and still agree
    (:func:`fingerprints_agree`), in ``[0, MAX_TOLERANCE]``: the signal server groups the fleet with it.
    Anything else is a ProtocolError, at construction and at parse.
    """

    max_mean_abs: float | None = 0.1
    max_max_abs: float | None = 2.0
    max_kl: float | None = 0.05
    fingerprint_tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        for name in ("max_mean_abs", "max_max_abs", "max_kl"):
            v = getattr(self, name)
            if v is not None:
                _bounded(v, name, MAX_DIVERGENCE)
        _bounded(self.fingerprint_tolerance, "fingerprint_tolerance", MAX_TOLERANCE)

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
            return None if o[k] is None else _bounded(o[k], f"policy {k}", MAX_DIVERGENCE)

        return cls(
            opt("max_mean_abs"),
            opt("max_max_abs"),
            opt("max_kl"),
            _bounded(o["fingerprint_tolerance"], "policy fingerprint_tolerance", MAX_TOLERANCE),
        )


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What a receiver reports about its replica after an audit (the ``audit`` of a fleet report).

    ``audited_step``: the step whose weights were probed; ``fingerprint``: :func:`fingerprint` of the
    engine's probe logprobs; ``divergence``: against the trainer's reference of that step (None: no
    reference); ``tolerance``: the fingerprint tolerance of the receiver's policy, in
    ``[0, MAX_TOLERANCE]``: informational, the fleet view groups with the run's own policy, never a
    report's (a report could otherwise agree with everything).
    """

    audited_step: int
    fingerprint: str
    divergence: Divergence | None = None
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        json_int(self.audited_step, "audited_step", 0, 10**12 - 1)
        check_fingerprint(self.fingerprint)
        _bounded(self.tolerance, "tolerance", MAX_TOLERANCE)

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
            DEFAULT_TOLERANCE if tol is None else _bounded(tol, "tolerance", MAX_TOLERANCE),
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


def parse_fingerprint(fp: str) -> tuple[str, npt.NDArray[np.int32]]:
    """A well-formed fingerprint's probe tag (8 hex digits) and segment values (in quanta), parsed once.

    What the fleet keeps per replica, so that grouping never re-parses; a ProtocolError otherwise.
    The last few thousand parsed are remembered (a fleet's heartbeats repeat their fingerprints,
    and a report is checked by more than one layer); the values are read-only.
    """
    if not isinstance(fp, str) or len(fp) > MAX_FINGERPRINT or not fp.startswith(_PREFIX):
        raise ProtocolError(f"not a fingerprint: {str(fp)[:80]!r}")
    return _parse_valid_str(fp)


@functools.lru_cache(maxsize=8192)
def _parse_valid_str(fp: str) -> tuple[str, npt.NDArray[np.int32]]:
    m = _FINGERPRINT.fullmatch(fp)
    if m is None or len(m.group(2)) % (_HEX * SEGMENTS):
        raise ProtocolError(f"not a fingerprint: {fp[:80]!r}")
    b = np.frombuffer(bytes.fromhex(m.group(2)), dtype=np.uint8).reshape(-1, _HEX // 2).astype(np.int32)
    q = (b[:, 0] << 16) | (b[:, 1] << 8) | b[:, 2]
    q[q >= _SPAN >> 1] -= _SPAN
    vec: npt.NDArray[np.int32] = q
    vec.flags.writeable = False
    return m.group(1), vec


#: ``fp1-<8 hex>-<hex>``, lower case only (``bytes.fromhex`` alone would take upper case and spaces)
_FINGERPRINT = re.compile(r"fp1-([0-9a-f]{8})-([0-9a-f]+)")


#: greedy groups per (step, probe set) compared by distance after the centre's; the rest group by exact vector
MAX_REPRESENTATIVES = 16


#: leading segment values compared first (a cheap filter before whole vectors)
_LEAD = 8


def _chebyshev(mat: npt.NDArray[np.int32], v: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """The largest absolute difference between each row of ``mat`` and ``v``."""
    d = mat - v
    out: npt.NDArray[np.int32] = np.maximum(d.max(axis=1), -d.min(axis=1))
    return out


def _limit(tolerance: float) -> int:
    """The largest distance in quanta that agrees within ``tolerance`` (as :func:`fingerprints_agree`)."""
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ProtocolError(f"fingerprint tolerance must be a finite number >= 0, got {tolerance!r}")
    return math.floor((tolerance + QUANTUM / 2) / QUANTUM)


#: a group: (probe set, its representative vector, member ids, whether others are compared with it
#: within the tolerance (False: a group of identical vectors))
_Group = tuple[tuple[str, int], "npt.NDArray[np.int32]", list[str], bool]


def _cut(
    key: tuple[str, int],
    rows: list[tuple[str, npt.NDArray[np.int32]]],
    limit: int,
    max_representatives: int,
    groups: list[_Group],
) -> int:
    """Cut the deciding replicas of one probe set into groups (steps 1-3 of :func:`group_step`),
    appended to ``groups``; returns the vector comparisons made."""
    pids = [r for r, _ in rows]
    mat = np.stack([v for _, v in rows])
    m = len(pids)
    mid = (m - 1) // 2
    centre = np.partition(np.ascontiguousarray(mat.T), mid, axis=1)[:, mid]
    near = _chebyshev(mat, centre) <= limit
    compared = m
    left = np.flatnonzero(~near)
    if near.any():
        groups.append((key, centre, [pids[i] for i in np.flatnonzero(near).tolist()], True))
    # a few leading values rule most candidates out before the whole vectors are compared
    lead = np.ascontiguousarray(mat[:, :_LEAD])
    reps = 0
    while left.size and reps < max_representatives:
        first = left[0]
        cand = left[_chebyshev(lead[left], lead[first]) <= limit]
        hit = cand[_chebyshev(mat[cand], mat[first]) <= limit]
        compared += int(left.size)
        groups.append((key, mat[first], [pids[i] for i in hit.tolist()], True))
        left = np.setdiff1d(left, hit, assume_unique=True)
        reps += 1
    if left.size:  # the rest by identical vector
        sub = np.ascontiguousarray(mat[left])
        _, first_of, inverse = np.unique(
            sub.view(np.dtype((np.void, sub.shape[1] * sub.itemsize))).ravel(),
            return_index=True,
            return_inverse=True,
        )
        rest = left.tolist()
        buckets: dict[int, list[str]] = {}
        for u, i in zip(inverse.ravel().tolist(), rest, strict=True):
            buckets.setdefault(u, []).append(pids[i])
        starts = first_of.tolist()
        groups.extend((key, mat[rest[starts[u]]], ids_u, False) for u, ids_u in buckets.items())
        compared += len(rest)
    return compared


def _place(
    step: int,
    others: list[tuple[str, tuple[str, npt.NDArray[np.int32]]]],
    groups: list[_Group],
    limit: int,
    of: int,
    majority: bool,
    out: dict[str, FingerprintGroup],
) -> int:
    """Place the replicas that do not decide (see :func:`group_step`) into ``out``: the first group
    whose representative they agree with, else the group of an identical vector, else groups of their
    own numbered after the others; returns the vector comparisons made."""
    compared = 0
    by_key: dict[tuple[str, int], list[int]] = {}
    exact_of: dict[tuple[tuple[str, int], bytes], int] = {}
    for g, (key, rep, _, compare) in enumerate(groups):
        if compare:
            by_key.setdefault(key, []).append(g)
        else:
            exact_of[(key, rep.tobytes())] = g
    reps_of = {key: np.stack([groups[g][1] for g in gs]) for key, gs in by_key.items()}
    extra: dict[tuple[tuple[str, int], bytes], list[str]] = {}
    for rid, (tag, vec) in others:
        key = (tag, len(vec))
        found: int | None = None
        if key in reps_of:
            hits = np.flatnonzero(np.abs(reps_of[key] - vec).max(axis=1) <= limit)
            compared += len(reps_of[key])
            if hits.size:
                found = by_key[key][int(hits[0])]
        if found is None:
            found = exact_of.get((key, vec.tobytes()))
        if found is None:
            extra.setdefault((key, vec.tobytes()), []).append(rid)
            continue
        out[rid] = FingerprintGroup(step, found, len(groups[found][2]), of, majority and found > 0)
    for n, members in enumerate(extra.values()):
        for rid in members:
            out[rid] = FingerprintGroup(step, len(groups) + n, len(members), of, majority)
    return compared


def group_step(
    step: int,
    vectors: Mapping[str, tuple[str, npt.NDArray[np.int32]]],
    tolerance: float = DEFAULT_TOLERANCE,
    bound: Collection[str] = (),
    *,
    max_representatives: int = MAX_REPRESENTATIVES,
    on_compare: Callable[[int], None] | None = None,
) -> dict[str, FingerprintGroup]:
    """Group the replicas audited at ``step`` (id -> parsed fingerprint, :func:`parse_fingerprint`).

    Only fingerprints of the same probe set (tag and length) can agree; two agree when no segment
    value differs by more than ``tolerance`` (the run's, never a report's). Agreement within a
    tolerance is not transitive, so groups are cut around representatives, per probe set:

    1. the *centre*, the coordinate-wise (lower) median of the deciding replicas' vectors: every
       replica within ``tolerance`` of it is a group. A strict majority that agrees pairwise lies in
       it whatever the others report (each coordinate's median lies within the majority's range);
    2. then up to ``max_representatives`` greedy groups: the smallest remaining id and every
       remaining replica within ``tolerance`` of it;
    3. the rest by identical vector.

    Groups are numbered by size (ties: the smallest id first): group 0 is the largest; when it
    holds more than half of the deciding replicas, every replica outside it is an odd one out.

    *Deciding* replicas: the ``bound`` ones (whose reports are bound to their identity) when any
    is audited at ``step``, else all. The others are placed in the first group whose representative
    they agree with (else the group of an identical vector, else groups of their own, numbered
    after), and never change a deciding replica's group, the sizes or the majority: ``size`` and
    ``of`` count deciding replicas only (the size of a group of undeciding replicas counts them).
    Cost: O((2 + max_representatives) * n * d) for n replicas of d segment values, however they
    disagree; ``on_compare`` is told the number of vector comparisons made (a work counter for
    tests and benchmarks).
    """
    limit = _limit(tolerance)
    ids = sorted(vectors)
    deciding = [r for r in ids if r in bound] or ids
    deciding_set = set(deciding)
    others = [r for r in ids if r not in deciding_set]
    compared = 0
    parts: dict[tuple[str, int], list[str]] = {}
    for rid in deciding:
        tag, vec = vectors[rid]
        parts.setdefault((tag, len(vec)), []).append(rid)
    groups: list[_Group] = []
    for key in sorted(parts):
        compared += _cut(key, [(r, vectors[r][1]) for r in parts[key]], limit, max_representatives, groups)
    groups.sort(key=lambda g: (-len(g[2]), g[2][0]))
    of = len(deciding)
    majority = bool(groups) and 2 * len(groups[0][2]) > of
    out: dict[str, FingerprintGroup] = {}
    for g, (_, _, members, _) in enumerate(groups):
        for rid in members:
            out[rid] = FingerprintGroup(step, g, len(members), of, majority and g > 0)
    if others:
        compared += _place(step, [(r, vectors[r]) for r in others], groups, limit, of, majority, out)
    if on_compare is not None:
        on_compare(compared)
    return out


def group_fingerprints(
    audits: Mapping[str, AuditReport],
    tolerance: float = DEFAULT_TOLERANCE,
    bound: Collection[str] = (),
) -> dict[str, FingerprintGroup]:
    """Group replicas (id -> last audit) by audited step, then by agreeing fingerprint (:func:`group_step`).

    ``tolerance`` is the run's fingerprint tolerance (its policy's); a report's own ``tolerance`` is
    ignored, so that no report can widen what counts as agreement. ``bound``: the ids whose reports
    are bound to their identity; where any is audited at a step, they alone decide the groups and
    the majority there. When group 0 holds more than half of a step's deciding replicas, every
    replica outside it is an odd one out; without a strict majority (two replicas that disagree,
    say) nobody is singled out, though the groups still show the disagreement.
    """
    by_step: dict[int, dict[str, tuple[str, npt.NDArray[np.int32]]]] = {}
    for rid, a in audits.items():
        by_step.setdefault(a.audited_step, {})[rid] = parse_fingerprint(a.fingerprint)
    out: dict[str, FingerprintGroup] = {}
    for step, vectors in by_step.items():
        out.update(group_step(step, vectors, tolerance, bound))
    return out
