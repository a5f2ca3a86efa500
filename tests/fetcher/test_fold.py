"""Folding decoded steps: one change per tensor with exactly the effect of applying them in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.fetcher._fold import Folded, fold_steps, new_bits
from deltasync.protocol import ByteRange, DecodedEntry, PatchEntry


def _entry(tensor: str, idx: np.ndarray, coding: str, values: np.ndarray) -> DecodedEntry:
    e = PatchEntry(
        tensor, "patch-00000.safetensors", max(1, idx.size), "rice", 0, coding, ByteRange(0, 0), ByteRange(0, 0)
    )  # type: ignore[arg-type]
    return DecodedEntry(e, idx.astype(np.int64), values)


@st.composite
def chains(draw: st.DrawFn) -> tuple[np.ndarray, list[list[DecodedEntry]]]:
    numel = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**16, numel, dtype=np.uint16)
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        changes = []
        for name in ("x", "y"):
            if rng.random() < 0.3:
                continue
            idx = np.flatnonzero(rng.random(numel) < rng.random())
            if not idx.size:
                continue
            coding = "raw" if rng.random() < 0.4 else "xor-rank"
            # small masks so that XORs cancel out now and then
            vals = rng.integers(0, 4 if coding == "xor-rank" else 2**16, idx.size, dtype=np.uint16)
            changes.append(_entry(name, idx, coding, vals))
        steps.append(changes)
    return base, steps


@settings(max_examples=400, deadline=None)
@given(chains())
def test_folding_equals_applying_in_order(case: tuple[np.ndarray, list[list[DecodedEntry]]]) -> None:
    base, steps = case
    want = {"x": base.copy(), "y": base[::-1].copy()}
    got = {k: v.copy() for k, v in want.items()}
    for changes in steps:
        for c in changes:
            want[c.tensor][c.idx] = new_bits(c, want[c.tensor][c.idx])
    folded = fold_steps(steps)
    assert len({c.tensor for c in folded}) == len(folded)  # one change per tensor
    for c in folded:
        assert np.all(np.diff(c.idx) > 0)
        got[c.tensor][c.idx] = new_bits(c, got[c.tensor][c.idx])
        if isinstance(c, Folded) and c.is_raw is None:
            assert np.all(c.values != 0)  # masks that cancel out are dropped
    for k in want:
        assert np.array_equal(got[k], want[k])


def test_cancelling_masks_leave_nothing() -> None:
    idx = np.array([1, 5])
    a = _entry("x", idx, "xor-rank", np.array([3, 4], dtype=np.uint16))
    assert fold_steps([[a], [a]]) == []
    raw = _entry("x", idx, "raw", np.array([7, 8], dtype=np.uint16))
    (c,) = fold_steps([[a], [raw], [a]])
    assert isinstance(c, Folded) and c.coding == "raw"
    assert np.array_equal(c.values, [7 ^ 3, 8 ^ 4])
