"""Grouping a fleet's fingerprints (deltasync.protocol.audit.group_step / group_fingerprints): the
largest agreeing group is group 0 and a strict majority singles the rest out; different probe sets
never agree; the run's tolerance decides, never a report's; bound replicas alone decide where any is
audited; and the work is O(n) vector comparisons however the fingerprints disagree."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import ProtocolError
from deltasync.protocol.audit import (
    DEFAULT_TOLERANCE,
    MAX_FINGERPRINT,
    MAX_REPRESENTATIVES,
    QUANTUM,
    AuditReport,
    FingerprintGroup,
    check_fingerprint,
    fingerprint_distance,
    group_fingerprints,
    group_step,
    parse_fingerprint,
)

TAG = "01234567"
OTHER_TAG = "89abcdef"
#: the default tolerance in quanta (0.02 nats = 81.92 quanta: 82 agree, 83 do not)
TOL_Q = 82


def fp(values: list[int] | npt.NDArray[np.int64], tag: str = TAG) -> str:
    return f"fp1-{tag}-" + "".join(f"{int(v) % (1 << 24):06x}" for v in values)


def vec(values: list[int] | npt.NDArray[np.int64], tag: str = TAG) -> tuple[str, npt.NDArray[np.int32]]:
    return parse_fingerprint(fp(values, tag))


def summary(groups: dict[str, FingerprintGroup]) -> dict[str, tuple[int, int, int, bool]]:
    return {k: (g.group, g.size, g.of, g.odd_one_out) for k, g in sorted(groups.items())}


BASE = [100 * i - 3000 for i in range(8)]


def moved(delta: int, at: int | None = None) -> list[int]:
    return [v + delta if at is None or i == at else v for i, v in enumerate(BASE)]


# ------------------------------------------------------------------ parsing


def test_a_fingerprint_is_parsed_once_into_the_same_values_as_the_reference_parser() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(-(1 << 23), 1 << 23, size=256)
    f = fp(values)
    assert len(f) == MAX_FINGERPRINT and check_fingerprint(f) == f
    tag, v = parse_fingerprint(f)
    assert tag == TAG and v.dtype == np.int32 and v.tolist() == values.tolist()
    assert not v.flags.writeable  # shared by the book: nobody edits it in place
    for bad in ("fp1-zz", "fp2-01234567-000000000000000000000000", fp(BASE)[:-1], "fp1-0123456-" + "0" * 24):
        with pytest.raises(ProtocolError):
            parse_fingerprint(bad)


# ------------------------------------------------------------------ the rule


def test_a_strict_majority_is_group_0_and_the_rest_are_odd_ones_out() -> None:
    vectors = {
        "a": vec(BASE),
        "b": vec(moved(40)),  # noise within the tolerance
        "c": vec(moved(-40)),  # 80 quanta from b: still agrees with both
        "d": vec(moved(5000, at=3)),
        "e": vec(moved(5000, at=3)),  # d and e agree with each other, not with the majority
    }
    assert summary(group_step(7, vectors)) == {
        "a": (0, 3, 5, False),
        "b": (0, 3, 5, False),
        "c": (0, 3, 5, False),
        "d": (1, 2, 5, True),
        "e": (1, 2, 5, True),
    }


def test_a_tie_singles_nobody_out_and_numbers_the_groups_by_their_smallest_id() -> None:
    vectors = {"d": vec(BASE), "a": vec(moved(1000)), "b": vec(moved(1000)), "c": vec(BASE)}
    assert summary(group_step(1, vectors)) == {
        "a": (0, 2, 4, False),
        "b": (0, 2, 4, False),
        "c": (1, 2, 4, False),
        "d": (1, 2, 4, False),
    }
    assert group_step(1, {}) == {}


def test_fingerprints_of_other_probes_never_agree_and_are_the_odd_ones_out_of_a_majority() -> None:
    vectors = {"a": vec(BASE), "b": vec(BASE), "c": vec(BASE), "x": vec(BASE, OTHER_TAG), "y": vec(BASE + BASE)}
    assert summary(group_step(2, vectors)) == {
        "a": (0, 3, 5, False),
        "b": (0, 3, 5, False),
        "c": (0, 3, 5, False),
        "x": (1, 1, 5, True),
        "y": (2, 1, 5, True),
    }


def test_the_tolerance_is_the_runs_and_a_reports_own_tolerance_is_ignored() -> None:
    honest = AuditReport(4, fp(BASE))
    diverged = AuditReport(4, fp(moved(2000)))
    # one fake replica between the two, claiming a tolerance of 100 nats
    fake = AuditReport(4, fp(moved(1000)), None, 100.0)
    groups = group_fingerprints({"a": honest, "b": honest, "e": honest, "c": diverged, "f": fake})
    assert groups["c"].odd_one_out and not groups["a"].odd_one_out and groups["f"].odd_one_out
    # the run's own tolerance does decide: 1000 quanta (0.24 nats) is within 0.25 nats
    wide = group_fingerprints({"a": honest, "f": fake}, tolerance=0.25)
    assert {g.group for g in wide.values()} == {0}
    # the edge is the one fingerprints_agree uses
    assert fingerprint_distance(fp(BASE), fp(moved(TOL_Q))) == TOL_Q * QUANTUM
    assert summary(group_step(0, {"a": vec(BASE), "b": vec(moved(TOL_Q))}))["b"][0] == 0
    assert summary(group_step(0, {"a": vec(BASE), "b": vec(moved(TOL_Q + 1))}))["b"][0] == 1
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ProtocolError):
            group_step(0, {"a": vec(BASE)}, bad)


def test_bound_replicas_decide_and_unbound_ones_cannot_frame_or_mask() -> None:
    honest, other = vec(BASE), vec(moved(3000))
    # three fake (unbound) replicas reporting another fingerprint do not frame one bound honest replica
    framed = group_step(5, {"h": honest, "f1": other, "f2": other, "f3": other}, bound={"h"})
    assert summary(framed) == {  # a group of unbound replicas only: its size counts them
        "f1": (1, 3, 1, True),
        "f2": (1, 3, 1, True),
        "f3": (1, 3, 1, True),
        "h": (0, 1, 1, False),
    }
    # nor does a crowd of unbound replicas agreeing with a diverged bound one mask it
    vectors = {"a": honest, "b": vec(moved(20)), "c": other, **{f"u{i}": other for i in range(10)}}
    masked = group_step(5, vectors, bound={"a", "b", "c"})
    assert summary(masked)["c"] == (1, 1, 3, True) and summary(masked)["a"] == (0, 2, 3, False)
    assert {masked[f"u{i}"].group for i in range(10)} == {1}  # shown in the bound group they agree with
    # an unbound replica that agrees with no bound group gets a group of its own, after theirs
    alone = group_step(5, {"a": honest, "u": vec(moved(9000))}, bound={"a"})
    assert summary(alone) == {"a": (0, 1, 1, False), "u": (1, 1, 1, True)}
    # nobody bound at this step: everybody counts (the legacy rule)
    legacy = group_step(5, {"h": honest, "f1": other, "f2": other, "f3": other}, bound={"elsewhere"})
    assert legacy["h"].odd_one_out and legacy["f1"].group == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(3, 40).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(n // 2 + 1, n),  # the honest, agreeing majority
            st.integers(0, 2**32 - 1),
        )
    )
)
def test_an_honest_majority_within_the_tolerance_is_always_group_0(case: tuple[int, int, int]) -> None:
    n, honest, seed = case
    rng = np.random.default_rng(seed)
    d = 12
    centre = rng.integers(-(1 << 20), 1 << 20, size=d)
    vectors: dict[str, tuple[str, npt.NDArray[np.int32]]] = {}
    for i in range(n):
        if i < honest:  # every coordinate within [centre, centre + TOL_Q]: pairwise within the tolerance
            v = centre + rng.integers(0, TOL_Q + 1, size=d)
        else:  # anything else, near or far
            v = centre + rng.integers(-(1 << 12), 1 << 12, size=d)
        vectors[f"r{rng.integers(1 << 30):09d}-{i}"] = vec(v)
    ids = list(vectors)
    groups = group_step(3, vectors)
    assert all(groups[r].group == 0 and not groups[r].odd_one_out for r in ids[:honest])
    assert groups[ids[0]].size >= honest and groups[ids[0]].of == n
    assert all(groups[r].odd_one_out == (groups[r].group != 0) for r in ids)


# ------------------------------------------------------------------ cost


@pytest.mark.parametrize("how", ["all_disagree", "all_agree", "honest_majority", "many_probe_sets"])
def test_the_work_is_linear_in_replicas_however_they_disagree(how: str) -> None:
    rng = np.random.default_rng(1)
    n, d = 600, 256
    base = rng.integers(-(1 << 22), 1 << 22, size=d)
    vectors: dict[str, tuple[str, npt.NDArray[np.int32]]] = {}
    for i in range(n):
        if how == "all_disagree" or (how == "honest_majority" and i % 3 == 0):
            v = rng.integers(-(1 << 22), 1 << 22, size=d)
        else:
            v = base + rng.integers(0, 40, size=d)
        vectors[f"r{i:04d}"] = vec(v, f"{i:08x}" if how == "many_probe_sets" else TAG)
    counted: list[int] = []
    groups = group_step(9, vectors, DEFAULT_TOLERANCE, on_compare=counted.append)
    assert len(groups) == n and len(counted) == 1
    assert counted[0] <= (2 + MAX_REPRESENTATIVES) * n  # vs n**2 / 2 = 180,000 pairs
    if how == "all_disagree":
        assert max(g.group for g in groups.values()) == n - 1 and not any(g.odd_one_out for g in groups.values())
    if how == "honest_majority":
        assert sum(g.odd_one_out for g in groups.values()) == n // 3


def test_bound_and_unbound_work_stays_linear() -> None:
    rng = np.random.default_rng(2)
    vectors = {f"r{i:04d}": vec(rng.integers(-(1 << 22), 1 << 22, size=64)) for i in range(400)}
    counted: list[int] = []
    group_step(1, vectors, bound={f"r{i:04d}" for i in range(0, 400, 2)}, on_compare=counted.append)
    assert counted[0] <= (2 + MAX_REPRESENTATIVES) * 400
