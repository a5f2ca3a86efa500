"""The pure chain planner, without I/O: manifests are built in memory.

Notation in the comments: ``A0`` is an anchor at step 0, ``P3<-1`` a patch at
step 3 whose parent is step 1, ``(12)`` a payload of 12 bytes.
"""

from __future__ import annotations

import dataclasses

import pytest

from deltasync.errors import ChainBroken
from deltasync.protocol import (
    Committed,
    FetchPlan,
    FileInfo,
    Manifest,
    Stats,
    TensorInfo,
    Writer,
    WriterClaim,
    inventory_digest,
    plan_fetch,
    superseded_by,
)

INVENTORY = (TensorInfo("w", "BF16", (2, 2)),)


def _digest(step: int, salt: int = 0) -> str:
    return f"{salt:016x}{step:016x}"


class Run:
    """A dict of committed steps, built one step at a time."""

    def __init__(self) -> None:
        self.committed: dict[int, Committed] = {}

    def add(self, step: int, kind: str, parent: int | None = None, nbytes: int = 100) -> Run:
        p = self.committed[parent] if parent is not None else None
        m = Manifest(
            run_id="run",
            step=step,
            kind=kind,  # type: ignore[arg-type]
            parent_step=parent,
            parent_digest=p.digest if p else None,
            anchor_step=step if kind == "anchor" else (p.manifest.anchor_step if p else 0),
            inventory=INVENTORY,
            inventory_digest=inventory_digest(INVENTORY),
            files=(FileInfo(f"f{step}.safetensors", nbytes, "00" * 16),) if nbytes else (),
            entries=(),
            tensor_digests={},
            stats=Stats(0, 4, nbytes),
        )
        self.committed[step] = Committed(m, _digest(step))
        return self

    def anchor(self, step: int, parent: int | None = None, nbytes: int = 100) -> Run:
        return self.add(step, "anchor", parent, nbytes)

    def patch(self, step: int, parent: int, nbytes: int = 10) -> Run:
        return self.add(step, "patch", parent, nbytes)

    def drop(self, step: int) -> Run:
        del self.committed[step]
        return self

    def plan(self, target: int, have: int | None = None, have_digest: str | None = None) -> FetchPlan:
        return plan_fetch(self.committed, target, have, have_digest)


def linear(n: int, anchor_bytes: int = 100, patch_bytes: int = 10) -> Run:
    """A0 <- P1 <- ... <- P(n-1)."""
    run = Run().anchor(0, nbytes=anchor_bytes)
    for s in range(1, n):
        run.patch(s, s - 1, patch_bytes)
    return run


# ----------------------------------------------------------------- the two kinds of plan


def test_patches_from_the_current_step_when_on_the_chain() -> None:
    run = linear(5)
    assert run.plan(4, have=1) == FetchPlan(4, "current", (2, 3, 4), 30)
    assert run.plan(4, have=3) == FetchPlan(4, "current", (4,), 10)
    assert run.plan(4, have=0) == FetchPlan(4, "current", (1, 2, 3, 4), 40)  # from the anchor we hold
    # with the digest of what we hold, which must match the committed manifest
    assert run.plan(4, have=2, have_digest=_digest(2)).base == "current"


def test_anchor_when_nothing_is_held() -> None:
    run = linear(5)
    assert run.plan(4) == FetchPlan(4, "anchor", (0, 1, 2, 3, 4), 140)
    assert run.plan(0) == FetchPlan(0, "anchor", (0,), 100)


def test_anchor_when_off_the_chain() -> None:
    run = linear(5)
    # same step number, other content (another branch or a diverged target)
    assert run.plan(4, have=2, have_digest=_digest(2, salt=1)) == FetchPlan(4, "anchor", (0, 1, 2, 3, 4), 140)
    # a step that is not committed at all
    assert run.plan(4, have=17).base == "anchor"


def test_noop_when_already_there() -> None:
    run = linear(3)
    assert run.plan(2, have=2) == FetchPlan(2, "current", (), 0)
    assert run.plan(2, have=2).is_noop
    assert run.plan(2, have=2, have_digest=_digest(2)).is_noop
    assert run.plan(0, have=0).is_noop
    # same step, different content: start over from the anchor
    assert run.plan(2, have=2, have_digest=_digest(2, salt=9)) == FetchPlan(2, "anchor", (0, 1, 2), 120)


def test_going_backwards_loads_an_anchor() -> None:
    run = linear(6)
    assert run.plan(3, have=5) == FetchPlan(3, "anchor", (0, 1, 2, 3), 130)


def test_target_not_committed() -> None:
    with pytest.raises(ChainBroken, match="step 9 is not committed"):
        linear(3).plan(9, have=1)


# ----------------------------------------------------------------- choosing by bytes


def test_choose_by_bytes_big_patch_chain_vs_small_anchor() -> None:
    """A0(10) <- P1(1e9) <- P2(1e9) <- A3(50) <- P4(5).

    Held at 1, the 2 GB of patches would have to run through anchor 3, which is a full
    checkpoint anyway: the plan is A3 + P4 (55 bytes). Held at 3, only P4 is needed.
    """
    run = Run().anchor(0, nbytes=10).patch(1, 0, 10**9).patch(2, 1, 10**9).anchor(3, 2, 50).patch(4, 3, 5)
    assert run.plan(4, have=1) == FetchPlan(4, "anchor", (3, 4), 55)
    assert run.plan(4, have=2) == FetchPlan(4, "anchor", (3, 4), 55)
    assert run.plan(4, have=3) == FetchPlan(4, "current", (4,), 5)
    assert run.plan(3, have=2) == FetchPlan(3, "anchor", (3,), 50)  # an anchor is never applied as a patch


def test_patching_wins_over_the_anchor_below_it() -> None:
    """With the held step above the chain's anchor, the anchor plan holds every patch
    of the current plan plus the anchor, so patching is never more bytes (ties favour it)."""
    run = linear(6, anchor_bytes=1, patch_bytes=10**9)
    plan = run.plan(5, have=1)
    assert plan == FetchPlan(5, "current", (2, 3, 4, 5), 4 * 10**9)
    tie = linear(4, anchor_bytes=0, patch_bytes=10)
    assert tie.plan(3, have=0) == FetchPlan(3, "current", (1, 2, 3), 30)


def test_nearest_anchor_is_used() -> None:
    """A0 <- P1 <- A2(30) <- P3 <- P4: the walk stops at the first anchor below the target."""
    run = Run().anchor(0).patch(1, 0).anchor(2, 1, 30).patch(3, 2).patch(4, 3)
    assert run.plan(4) == FetchPlan(4, "anchor", (2, 3, 4), 50)
    assert run.plan(1) == FetchPlan(1, "anchor", (0, 1), 110)


# ----------------------------------------------------------------- broken chains


def test_broken_parent_digest() -> None:
    """P2's parent_digest does not match the committed manifest of step 1 (rewritten step)."""
    run = linear(4)
    bad = run.committed[1]
    run.committed[1] = Committed(bad.manifest, _digest(1, salt=5))
    with pytest.raises(ChainBroken, match="parent digest"):
        run.plan(3)
    with pytest.raises(ChainBroken, match="parent digest"):
        run.plan(3, have=1)  # the link from 2 to 1 is what is broken
    # holding 2 (verified by digest) the patch to 3 is still fine
    assert run.plan(3, have=2, have_digest=_digest(2)) == FetchPlan(3, "current", (3,), 10)


def test_missing_parent_without_a_reachable_anchor() -> None:
    """A0 <- P1 (garbage-collected) <- P2 <- P3: anchor 0 exists but cannot be reached from 3."""
    run = linear(4).drop(1)
    with pytest.raises(ChainBroken, match="parent step 1 is not committed"):
        run.plan(3)
    with pytest.raises(ChainBroken):
        run.plan(3, have=0)
    # an anchor above the target does not help either
    run.anchor(7, 3)
    with pytest.raises(ChainBroken):
        run.plan(3)
    # but a fetcher already at 2 can still patch forward
    assert run.plan(3, have=2) == FetchPlan(3, "current", (3,), 10)


def test_missing_parent_below_a_reachable_anchor_is_harmless() -> None:
    """A0 <- P1 (gone) <- A2 <- P3: the chain from 3 ends at anchor 2 before the gap."""
    run = Run().anchor(0).patch(1, 0).anchor(2, 1, 50).patch(3, 2).drop(1)
    assert run.plan(3) == FetchPlan(3, "anchor", (2, 3), 60)
    assert run.plan(3, have=2) == FetchPlan(3, "current", (3,), 10)


def test_first_anchor_missing() -> None:
    run = linear(3).drop(0)
    with pytest.raises(ChainBroken, match="no anchor is reachable"):
        run.plan(2)


# ----------------------------------------------------------------- coalesced chains


def test_coalesced_chain_skips_step_numbers() -> None:
    """The uploader may coalesce a backlog: A0 <- P1 <- P2 <- P5 <- P9 (3, 4, 6-8 never exist)."""
    run = Run().anchor(0).patch(1, 0).patch(2, 1).patch(5, 2, 30).patch(9, 5, 40)
    assert run.plan(9, have=2) == FetchPlan(9, "current", (5, 9), 70)
    assert run.plan(9, have=5) == FetchPlan(9, "current", (9,), 40)
    assert run.plan(9, have=1) == FetchPlan(9, "current", (2, 5, 9), 80)
    assert run.plan(9) == FetchPlan(9, "anchor", (0, 1, 2, 5, 9), 190)
    assert run.plan(9, have=3).base == "anchor"  # 3 was never committed: not on the chain
    with pytest.raises(ChainBroken):
        run.plan(4)


def test_sibling_branches_after_a_failed_commit() -> None:
    """A0 <- P1 <- P2, and P3 re-parented onto 1 (step 2 later superseded): holding 2 is off chain."""
    run = linear(3).patch(3, 1)
    assert run.plan(3, have=2).base == "anchor"
    assert run.plan(3, have=1) == FetchPlan(3, "current", (3,), 10)


# ----------------------------------------------------------------- inconsistent input


def test_inconsistent_in_memory_manifests_do_not_loop() -> None:
    """Manifest.from_json forbids parent_step >= step; the planner must not rely on it."""
    run = linear(3)
    m = run.committed[2].manifest
    run.committed[2] = Committed(dataclasses.replace(m, parent_step=2, parent_digest=_digest(2)), _digest(2))
    with pytest.raises(ChainBroken):
        run.plan(2)
    run = linear(3)
    # the manifest stored under key 1 claims to be step 7
    run.committed[1] = Committed(dataclasses.replace(run.committed[1].manifest, step=7), _digest(1))
    with pytest.raises(ChainBroken):
        run.plan(2)


def test_plan_is_pure() -> None:
    run = linear(4)
    before = dict(run.committed)
    assert run.plan(3, have=1) == run.plan(3, have=1)
    assert run.committed == before


# ----------------------------------------------------------------- single writer


def _with_writer(run: Run, step: int, epoch: int) -> None:
    c = run.committed[step]
    run.committed[step] = Committed(dataclasses.replace(c.manifest, writer=Writer(f"w{epoch}", epoch)), c.digest)


def test_a_fenced_writers_late_step_is_superseded() -> None:
    """Epoch 2 claimed the run after step 3; epoch 1 still landed step 4 (a race it lost)."""
    run = linear(5)
    for s in range(5):
        _with_writer(run, s, 1)
    claims = [WriterClaim(2, "w2", after_step=3)]
    assert superseded_by(run.committed[3].manifest, claims) is None
    assert superseded_by(run.committed[4].manifest, claims) == claims[0]
    with pytest.raises(ChainBroken, match="epoch 2 had taken over the run at step 3"):
        plan_fetch(run.committed, 4, claims=claims)
    assert plan_fetch(run.committed, 3, claims=claims).steps == (0, 1, 2, 3)
    # the newer writer's own steps are never superseded by its claim
    run.anchor(5)
    _with_writer(run, 5, 2)
    assert superseded_by(run.committed[5].manifest, claims) is None
    assert superseded_by(run.committed[5].manifest, [WriterClaim(3, "w3", None)]) is not None
