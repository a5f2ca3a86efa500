"""The planner with spans, without I/O: manifests are built in memory.

Notation: ``A0`` an anchor at step 0, ``P3<-2`` a patch, ``S0-4`` a span from step 0 to step 4,
``(12)`` a payload of 12 bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.errors import ChainBroken
from deltasync.protocol import (
    SPAN_OF,
    Committed,
    FetchPlan,
    FileInfo,
    Manifest,
    PlanStep,
    Stats,
    TensorInfo,
    Writer,
    WriterClaim,
    inventory_digest,
    parse_span_key,
    plan_fetch,
    span_file_key,
    span_manifest_key,
)

INVENTORY = (TensorInfo("w", "BF16", (2, 2)),)
OTHER = (TensorInfo("w", "BF16", (4,)),)


def _digest(step: int, salt: int = 0) -> str:
    return f"{salt:016x}{step:016x}"


def _manifest(step: int, kind: str, parent: Committed | None, nbytes: int, epoch: int = 1) -> Manifest:
    return Manifest(
        run_id="run",
        step=step,
        kind=kind,  # type: ignore[arg-type]
        parent_step=parent.manifest.step if parent else None,
        parent_digest=parent.digest if parent else None,
        anchor_step=step if kind == "anchor" else (parent.manifest.anchor_step if parent else 0),
        inventory=INVENTORY,
        inventory_digest=inventory_digest(INVENTORY),
        files=(FileInfo(f"f{step}.safetensors", nbytes, "00" * 16),),
        entries=(),
        tensor_digests={"w": _digest(step, 7)},
        stats=Stats(0, 4, nbytes),
        writer=Writer("w", epoch),
    )


class Run:
    """Committed steps and spans, built one at a time."""

    def __init__(self) -> None:
        self.committed: dict[int, Committed] = {}
        self.spans: dict[tuple[int, int], Committed] = {}
        self.claims: list[WriterClaim] = []

    def anchor(self, step: int, nbytes: int = 100) -> Run:
        self.committed[step] = Committed(_manifest(step, "anchor", None, nbytes), _digest(step))
        return self

    def patch(self, step: int, parent: int, nbytes: int = 10, epoch: int = 1) -> Run:
        m = _manifest(step, "patch", self.committed[parent], nbytes, epoch)
        self.committed[step] = Committed(m, _digest(step))
        return self

    def span(self, start: int, end: int, nbytes: int, **change: object) -> Run:
        lo, hi = self.committed[start], self.committed[end]
        m = dataclasses.replace(
            hi.manifest,
            kind="patch",
            parent_step=start,
            parent_digest=lo.digest,
            files=(FileInfo("patch-00000.safetensors", nbytes, "00" * 16),),
            stats=Stats(0, 4, nbytes),
            extra={SPAN_OF: hi.digest},
        )
        m = dataclasses.replace(m, **change)  # type: ignore[arg-type]
        self.spans[(start, end)] = Committed(m, _digest(end, salt=start + 1))
        return self

    def plan(self, target: int, have: int | None = None, have_digest: str | None = None) -> FetchPlan:
        return plan_fetch(self.committed, target, have, have_digest, self.claims, self.spans)


def linear(n: int, anchor_bytes: int = 100, patch_bytes: int = 10) -> Run:
    run = Run().anchor(0, anchor_bytes)
    for s in range(1, n):
        run.patch(s, s - 1, patch_bytes)
    return run


def test_span_keys() -> None:
    assert span_manifest_key(4, 8) == "spans/000000000004-000000000008/manifest.json"
    assert span_file_key(4, 8, "patch-00000.safetensors") == "spans/000000000004-000000000008/patch-00000.safetensors"
    assert parse_span_key("spans/000000000004-000000000008/manifest.json") == (4, 8)
    for bad in (
        "spans/000000000008-000000000004/manifest.json",  # backwards
        "spans/000000000004-000000000004/manifest.json",
        "spans/4-8/manifest.json",
        "spans/000000000004-000000000008/patch-00000.safetensors",
        "steps/000000000004/manifest.json",
    ):
        assert parse_span_key(bad) is None
    with pytest.raises(ValueError):
        span_manifest_key(8, 4)
    with pytest.raises(Exception, match="invalid file"):
        span_file_key(4, 8, "../x")


def test_span_is_chosen_when_cheaper() -> None:
    run = linear(10).span(1, 9, 25)
    plan = run.plan(9, have=1)
    assert plan == FetchPlan(9, "current", (9,), 25, ((1, 9),))
    assert plan.elements == (PlanStep(9, 1),)
    assert plan.elements[0].is_span
    # from the anchor: A0 (100) + P1 (10) + S1-9 (25)
    assert run.plan(9) == FetchPlan(9, "anchor", (0, 1, 9), 135, ((1, 9),))
    # a span costing more than its patches is not used
    assert linear(10).span(1, 9, 81).plan(9, have=1) == FetchPlan(9, "current", tuple(range(2, 10)), 80)
    # spans and patches mix: P2..P3, S3-7, P8, P9
    mixed = linear(10).span(3, 7, 15).plan(9, have=1)
    assert mixed == FetchPlan(9, "current", (2, 3, 7, 8, 9), 55, ((3, 7),))
    assert [e.is_span for e in mixed.elements] == [False, False, True, False, False]


def test_spans_compose_and_ties_favour_fewer_elements_then_current() -> None:
    run = linear(17).span(0, 4, 20).span(4, 8, 20).span(0, 8, 40).span(8, 16, 30)
    # S0-8 and S0-4 + S4-8 cost the same: the fewer elements win
    assert run.plan(16, have=0) == FetchPlan(16, "current", (8, 16), 70, ((0, 8), (8, 16)))
    # equal bytes and elements from the anchor and from the held state: the held state wins
    tie = Run().anchor(0, 10).patch(1, 0, 10).patch(2, 1, 10).span(0, 2, 10)
    assert tie.plan(2, have=1) == FetchPlan(2, "current", (2,), 10)
    assert tie.plan(2) == FetchPlan(2, "anchor", (0, 2), 20, ((0, 2),))


def test_anchor_route_may_win_through_a_span() -> None:
    """A tiny anchor plus one span beats many patches from a held state the span does not start at."""
    run = linear(20, anchor_bytes=5).span(0, 19, 10)
    assert run.plan(19, have=1) == FetchPlan(19, "anchor", (0, 19), 15, ((0, 19),))


@pytest.mark.parametrize(
    "change",
    [
        {"parent_digest": _digest(1, salt=9)},  # names another manifest of step 1
        {"extra": {SPAN_OF: _digest(9, salt=9)}},  # says it yields another manifest of step 9
        {"extra": {}},  # no span_of at all
        {"inventory": OTHER, "inventory_digest": inventory_digest(OTHER)},
        {"tensor_digests": {"w": "ff" * 16}},
        {"anchor_step": 3},
        {"run_id": "other"},
        {"kind": "anchor"},
        {"step": 8},  # the manifest under key 1-9 says step 8
        {"parent_step": 2},
    ],
)
def test_lying_spans_are_ignored(change: dict[str, object]) -> None:
    run = linear(10).span(1, 9, 5, **change)
    assert run.plan(9, have=1) == FetchPlan(9, "current", tuple(range(2, 10)), 80)


def test_spans_whose_ends_are_missing_superseded_or_off_chain_are_ignored() -> None:
    run = linear(10).span(1, 9, 5).span(2, 9, 5).span(3, 8, 1)
    del run.committed[2]  # a missing end (and a broken chain below 3)
    assert run.plan(9, have=3) == FetchPlan(9, "current", (8, 9), 11, ((3, 8),))
    with pytest.raises(ChainBroken):
        run.plan(9, have=1)  # S1-9 cannot help: step 1 is not on the target's chain any more
    # a superseded end: a newer writer took over after step 5, so 6.. of epoch 1 are not the run
    run = linear(10).span(1, 9, 5).span(1, 5, 1)
    run.claims = [WriterClaim(2, "w2", 5)]
    with pytest.raises(ChainBroken, match="epoch"):
        run.plan(9, have=1)
    assert run.plan(5, have=1) == FetchPlan(5, "current", (5,), 1, ((1, 5),))
    # the span's end is a rewritten step 9 (another manifest): its span_of no longer matches
    run = linear(10).span(1, 9, 5)
    run.committed[9] = dataclasses.replace(run.committed[9], digest=_digest(9, salt=3))
    assert run.plan(9, have=1).spans == ()
    # a span across an anchor is off the target's chain above it: ignored
    run = linear(4).anchor(4).patch(5, 4).patch(6, 5).span(2, 6, 1)
    assert run.plan(6, have=2) == FetchPlan(6, "anchor", (4, 5, 6), 120)


def test_plan_without_spans_is_unchanged() -> None:
    run = linear(5)
    assert run.plan(4, have=1) == FetchPlan(4, "current", (2, 3, 4), 30)
    assert run.plan(4) == FetchPlan(4, "anchor", (0, 1, 2, 3, 4), 140)
    assert run.plan(4, have=4).is_noop


@st.composite
def runs(draw: st.DrawFn) -> tuple[Run, int, int | None]:
    n = draw(st.integers(2, 24))
    run = Run().anchor(0, draw(st.integers(1, 400)))
    for s in range(1, n):
        run.patch(s, s - 1, draw(st.integers(0, 50)))
    for _ in range(draw(st.integers(0, 20))):
        a = draw(st.integers(0, n - 2))
        b = draw(st.integers(a + 1, n - 1))
        lie = draw(st.sampled_from([None, None, None, "parent", "span_of", "digests"]))
        change: dict[str, object] = {}
        if lie == "parent":
            change = {"parent_digest": _digest(a, salt=5)}
        elif lie == "span_of":
            change = {"extra": {SPAN_OF: _digest(b, salt=5)}}
        elif lie == "digests":
            change = {"tensor_digests": {"w": "ee" * 16}}
        run.span(a, b, draw(st.integers(0, 300)), **change)
    target = draw(st.integers(0, n - 1))
    have = draw(st.none() | st.integers(0, n - 1))
    return run, target, have


@settings(max_examples=300, deadline=None)
@given(runs())
def test_planned_route_reaches_the_target_with_any_subset_of_spans(case: tuple[Run, int, int | None]) -> None:
    run, target, have = case
    plan = run.plan(target, have)
    without = plan_fetch(run.committed, target, have)
    assert plan.nbytes <= without.nbytes
    if plan.is_noop:
        assert have == target
        return
    at = have if plan.base == "current" else None
    total = 0
    for e in plan.elements:
        if e.span is None:
            m = run.committed[e.step].manifest
            if at is None:
                assert m.kind == "anchor"
            else:
                assert m.kind == "patch" and m.parent_step == at
            total += m.total_bytes
        else:
            assert at == e.span and e.step > e.span
            span = run.spans[(e.span, e.step)].manifest
            # only honest spans are ever used
            assert span.parent_digest == run.committed[e.span].digest
            assert span.extra[SPAN_OF] == run.committed[e.step].digest
            assert span.tensor_digests == run.committed[e.step].manifest.tensor_digests
            total += span.total_bytes
        at = e.step
    assert at == target and total == plan.nbytes
