"""The audit's math (deltasync.protocol.audit): fingerprints tolerate what an engine's non-determinism
moves and nothing more, the divergence figures are the documented ones, the policy names what it
breaches, and replicas group by (audited step, agreeing fingerprint) with the odd one out flagged
only under a strict majority. Hostile input is a ProtocolError."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import (
    DEFAULT_TOLERANCE,
    LOGPROB_FLOOR,
    QUANTUM,
    SEGMENTS,
    AuditPolicy,
    AuditReport,
    Divergence,
    check_fingerprint,
    divergence,
    fingerprint,
    fingerprint_distance,
    fingerprints_agree,
    group_fingerprints,
)

DIGEST = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2


def rows(base: float = -7.0, n: int = 3, length: int = 12) -> list[list[float]]:
    return [[base - 0.01 * i - 0.1 * p for i in range(length)] for p in range(n)]


def shift(lp: list[list[float]], delta: float, probe: int | None = None, token: int | None = None) -> list[list[float]]:
    out = [list(r) for r in lp]
    for p, r in enumerate(out):
        for t in range(len(r)):
            if (probe is None or p == probe) and (token is None or t == token):
                r[t] += delta
    return out


# ------------------------------------------------------------------ fingerprint


def test_a_fingerprint_is_deterministic_names_its_probes_and_has_four_segments_per_probe() -> None:
    lp = rows()
    fp = fingerprint(DIGEST, lp)
    assert fp == fingerprint(DIGEST, [list(r) for r in lp])
    assert fp.startswith("fp1-01234567-")
    assert len(fp.split("-")[2]) == 3 * SEGMENTS * 6
    assert check_fingerprint(fp) == fp
    assert fingerprint_distance(fp, fp) == 0.0


def test_fingerprints_agree_within_the_tolerance_and_not_beyond() -> None:
    lp = rows()
    fp = fingerprint(DIGEST, lp)
    # engine noise of a few 1e-3 nats on every token agrees
    assert fingerprints_agree(fp, fingerprint(DIGEST, shift(lp, 0.004)))
    # a segment mean moved by more than the tolerance does not: one token of 3 (a segment) moved by 0.3
    moved = fingerprint(DIGEST, shift(lp, 0.3, probe=1, token=0))
    d = fingerprint_distance(fp, moved)
    assert d is not None and abs(d - 0.1) <= QUANTUM
    assert not fingerprints_agree(fp, moved)
    assert fingerprints_agree(fp, moved, tolerance=0.11)
    # made from other probes: never comparable
    assert fingerprint_distance(fp, fingerprint(OTHER, lp)) is None
    assert not fingerprints_agree(fp, fingerprint(OTHER, lp), tolerance=1e9)
    assert fingerprint_distance(fp, fingerprint(DIGEST, lp[:2])) is None


def test_minus_infinity_and_huge_values_are_clamped_not_propagated() -> None:
    lp = rows()
    lp[0][3] = -math.inf
    fp = fingerprint(DIGEST, lp)
    lp[0][3] = LOGPROB_FLOOR * 10
    assert fingerprint(DIGEST, lp) == fp
    with pytest.raises(ProtocolError, match="NaN"):
        fingerprint(DIGEST, shift(lp, math.nan, probe=0, token=0))


@pytest.mark.parametrize(
    "bad",
    ["", "fp2-01234567-000000", "fp1-0123456-" + "0" * 24, "fp1-01234567-" + "0" * 23, "fp1-01234567-" + "G" * 24,
     "fp1-01234567", "fp1-01234567-" + "0" * 100000, 7, None],
)  # fmt: skip
def test_malformed_fingerprints_are_protocol_errors(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        check_fingerprint(bad)


def test_too_few_logprobs_for_the_segments_is_refused() -> None:
    with pytest.raises(ProtocolError, match="at least"):
        fingerprint(DIGEST, [[-1.0] * (SEGMENTS - 1)])
    with pytest.raises(ProtocolError, match="no probes"):
        fingerprint(DIGEST, [])


@given(st.lists(st.lists(st.floats(-50, 0), min_size=SEGMENTS, max_size=40), min_size=1, max_size=8))
def test_any_logprobs_make_a_well_formed_fingerprint_that_agrees_with_itself(lp: list[list[float]]) -> None:
    fp = fingerprint(DIGEST, lp)
    assert check_fingerprint(fp) == fp and fingerprints_agree(fp, fp, 0.0)


# ------------------------------------------------------------------ divergence


def test_divergence_is_mean_and_max_abs_and_the_k3_estimate() -> None:
    ref = [[-1.0, -2.0, -3.0, -4.0]]
    eng = [[-1.0, -2.5, -3.0, -3.0]]
    d = divergence(eng, ref)
    r = [0.0, 0.5, 0.0, -1.0]  # ref - engine
    assert d.mean_abs == pytest.approx(1.5 / 4)
    assert d.max_abs == pytest.approx(1.0)
    assert d.kl == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 4)
    same = divergence(ref, ref)
    assert same == Divergence(0.0, 0.0, 0.0)


def test_divergence_stays_finite_for_wild_engines_and_refuses_shape_mismatches() -> None:
    d = divergence([[-math.inf] * 4], [[0.0] * 4])
    assert math.isfinite(d.kl) and d.max_abs == -LOGPROB_FLOOR
    with pytest.raises(ProtocolError, match="probes"):
        divergence([[-1.0] * 4], [[-1.0] * 4, [-1.0] * 4])
    with pytest.raises(ProtocolError, match="probe 0"):
        divergence([[-1.0] * 4], [[-1.0] * 5])
    with pytest.raises(ProtocolError, match="no tokens"):
        divergence([[]], [[]])


# ------------------------------------------------------------------ policy and reports


def test_the_policy_names_each_threshold_a_divergence_goes_over() -> None:
    p = AuditPolicy(max_mean_abs=0.1, max_max_abs=1.0, max_kl=None)
    assert p.breaches(Divergence(0.05, 0.9, 100.0)) == ()
    assert p.breaches(Divergence(0.2, 1.5, 0.0)) == ("mean_abs 0.2 > 0.1", "max_abs 1.5 > 1")
    assert AuditPolicy.from_dict(p.to_dict()) == p
    assert AuditPolicy().fingerprint_tolerance == DEFAULT_TOLERANCE


@pytest.mark.parametrize(
    "raw",
    [
        {"max_mean_abs": -1, "max_max_abs": None, "max_kl": None, "fingerprint_tolerance": 0.1},
        {"max_mean_abs": None, "max_max_abs": None, "max_kl": None, "fingerprint_tolerance": None},
        {"max_mean_abs": True, "max_max_abs": None, "max_kl": None, "fingerprint_tolerance": 0.1},
        {"max_mean_abs": None, "max_max_abs": None, "max_kl": None},
        {"max_mean_abs": None, "max_max_abs": None, "max_kl": None, "fingerprint_tolerance": 0.1, "x": 1},
        "policy",
    ],
)
def test_a_bad_policy_is_a_protocol_error(raw: Any) -> None:
    with pytest.raises(ProtocolError):
        AuditPolicy.from_dict(raw)


def test_an_audit_report_round_trips_and_refuses_hostile_fields() -> None:
    fp = fingerprint(DIGEST, rows())
    a = AuditReport(5, fp, Divergence(0.01, 0.2, 0.001), 0.03)
    assert AuditReport.from_dict(a.to_dict()) == a
    assert AuditReport.from_dict({"audited_step": 5, "fingerprint": fp}) == AuditReport(5, fp)
    for bad in (
        {"audited_step": -1, "fingerprint": fp},
        {"audited_step": 5, "fingerprint": "fp1-x"},
        {"audited_step": 5, "fingerprint": fp, "divergence": {"mean_abs": math.inf, "max_abs": 0, "kl": 0}},
        {"audited_step": 5, "fingerprint": fp, "divergence": {"mean_abs": 0, "max_abs": 0}},
        {"audited_step": 5, "fingerprint": fp, "tolerance": -0.1},
        {"audited_step": 5, "fingerprint": fp, "extra": 1},
    ):
        with pytest.raises(ProtocolError):
            AuditReport.from_dict(bad)


# ------------------------------------------------------------------ grouping


def report(step: int, lp: list[list[float]], tol: float = DEFAULT_TOLERANCE) -> AuditReport:
    return AuditReport(step, fingerprint(DIGEST, lp), None, tol)


def test_the_odd_one_out_at_a_step_is_flagged_under_a_strict_majority() -> None:
    lp = rows()
    bad = shift(lp, 0.5, probe=0, token=0)
    groups = group_fingerprints(
        {
            "a": report(7, lp),
            "b": report(7, shift(lp, 0.003)),  # engine noise: same group
            "c": report(7, bad),
            "d": report(6, bad),  # another step: compared with nobody at 7
        }
    )
    assert {k: (g.step, g.group, g.size, g.of, g.odd_one_out) for k, g in groups.items()} == {
        "a": (7, 0, 2, 3, False),
        "b": (7, 0, 2, 3, False),
        "c": (7, 1, 1, 3, True),
        "d": (6, 0, 1, 1, False),
    }


def test_without_a_strict_majority_nobody_is_singled_out_but_the_groups_show_the_split() -> None:
    lp = rows()
    groups = group_fingerprints({"a": report(3, lp), "b": report(3, shift(lp, 1.0))})
    assert sorted((g.group, g.odd_one_out) for g in groups.values()) == [(0, False), (1, False)]
    # a report's own tolerance is ignored (one report must not widen agreement); the run's decides
    groups = group_fingerprints({"a": report(3, lp), "b": report(3, shift(lp, 1.0), tol=1.5)})
    assert {g.group for g in groups.values()} == {0, 1}
    groups = group_fingerprints({"a": report(3, lp), "b": report(3, shift(lp, 1.0))}, tolerance=1.5)
    assert {g.group for g in groups.values()} == {0} and group_fingerprints({}) == {}


# ------------------------------------------------------------------ fuzz


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=40,
)


@given(st.binary(max_size=300))
def test_garbage_bytes_are_only_ever_protocol_errors(data: bytes) -> None:
    from deltasync.protocol.probes import ProbeSet, Reference

    for parse in (ProbeSet.from_json, Reference.from_json):
        with pytest.raises(ProtocolError):
            parse(data)


@given(json_values)
def test_garbage_json_is_only_ever_a_protocol_error(value: Any) -> None:
    import json

    from deltasync.protocol.probes import ProbeSet, Reference

    body = json.dumps(value).encode()
    for parse in (ProbeSet.from_json, Reference.from_json):
        with pytest.raises(ProtocolError):
            parse(body)
    for parse_dict in (AuditReport.from_dict, AuditPolicy.from_dict, Divergence.from_dict):
        with contextlib.suppress(ProtocolError):  # anything but a ProtocolError fails the test
            parse_dict(value)


@given(
    st.fixed_dictionaries(
        {
            "format_version": st.just(1) | json_values,
            "vocab_size": st.integers(-5, 2**32) | json_values,
            "probes": st.lists(st.lists(st.integers(-3, 60), max_size=8), max_size=4) | json_values,
            "policy": st.just(AuditPolicy().to_dict()) | json_values,
        }
    )
)
def test_nearly_valid_probe_sets_parse_or_are_protocol_errors(raw: dict[str, Any]) -> None:
    import json

    from deltasync.protocol.probes import ProbeSet

    try:
        p = ProbeSet.from_json(json.dumps(raw).encode())
    except ProtocolError:
        return
    assert all(0 <= t < p.vocab_size for row in p.tokens for t in row)
    assert ProbeSet.from_json(p.to_json()) == p
