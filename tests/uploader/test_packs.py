"""Packed baselines (uploader/_pack.py): many small CPU tensors of one dtype held in one buffer.

What a pack changes is how the uploader holds and diffs the state, never what it writes: every
test here checks the store's contents against a reader (bit-exact), or the packed pieces against
the per-tensor ones they replace.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from spy_store import SpyStore
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync.protocol import TensorInfo, kernels
from deltasync.protocol.digests import packed_digests, tensor_digests
from deltasync.uploader._diff import TensorDiff
from deltasync.uploader._job import merge_change_sets
from deltasync.uploader._pack import MIN_PACKED, ChangeSet, Pack, PackedDiff

torch = pytest.importorskip("torch")
WAIT = 60.0


def _state(seed: int) -> dict[str, Any]:
    """Enough tensors of two dtypes to be packed, odd byte sizes, one tensor too few to pack."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for e in range(MIN_PACKED + 4):
        out[f"experts.{e:02d}.w"] = torch.randn(3 + e % 4, 5, generator=g).to(torch.bfloat16)  # 2*15.. bytes
        out[f"experts.{e:02d}.b"] = torch.randn(7 + e, generator=g)  # F32
    out["lonely"] = torch.randint(-5, 5, (3,), generator=g, dtype=torch.int8)  # I8: too few to pack
    return out


def _step(state: dict[str, Any], seed: int, frac: float = 0.2) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bits = v.clone().view({2: torch.int16, 4: torch.int32, 1: torch.int8}[v.element_size()]).reshape(-1)
        keep = torch.rand(bits.numel(), generator=g) >= frac
        bits[~keep] += 1
        out[k] = bits.view(v.dtype).reshape(v.shape)
    return out


def test_a_packed_state_round_trips_through_patches_and_spans() -> None:
    states = [_state(0)]
    for s in range(1, 10):
        states.append(_step(states[-1], s))
    # a tensor left untouched by a step, and one whose caller's tensor is a non-contiguous view
    states[3]["experts.05.w"] = states[2]["experts.05.w"].clone()
    states[4]["experts.07.w"] = states[4]["experts.07.w"].clone().t().contiguous().t()
    store = ds.MemoryStore("packs")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, span_levels=(2, 4)) as up:
        for i, s in enumerate(states):
            up.push(s, i).result(30)
        assert sorted(p.dtype for p in up._snapshots._baseline.packs) == ["BF16", "F32"]
    f = ds.DeltaFetcher(store, verify="full")
    target = snapshot(states[0])
    for step in (1, 3, 4, 9, 6):
        f.sync(target, step=step)
        assert_state_equal(target, states[step])
    assert ds.DeltaFetcher(store).manifest(4).format_version == 2


def test_packed_steps_fold_into_a_later_one_bit_exactly(tmp_path: Path) -> None:
    """on_backlog="coalesce" merges a waiting packed step's changes with the next one's (the change
    sets are read tensor by tensor there). No clock: the store holds the first step's writes."""
    states = [_state(5)]
    for s in range(1, 5):
        states.append(_step(states[-1], 10 + s))
    store = SpyStore(ds.LocalStore(tmp_path / "store", fsync=False))
    gate, handed = threading.Event(), threading.Event()
    with ds.DeltaUploader(store, max_pending=1, anchor_every=100, anchor_bytes_fraction=0, span_levels=()) as up:
        up.push(states[0], 0).result(WAIT)
        store.blocked.clear()
        store.gate = gate
        up._pipeline.after_release = lambda job: handed.set() if job.step == 4 else None
        try:
            futs = [up.push(states[1], 1)]
            assert store.blocked.wait(WAIT)
            futs += [up.push(states[s], s) for s in (2, 3, 4)]
            assert handed.wait(WAIT)
        finally:
            gate.set()
        up.flush(WAIT)
        infos = [f.result(0) for f in futs]
    assert [(i.step, i.kind, i.committed_step) for i in infos] == [
        (1, "patch", 1), (2, "skipped", 4), (3, "skipped", 4), (4, "patch", 4),
    ]  # fmt: skip
    target = snapshot(states[0])
    f = ds.DeltaFetcher(store, verify="full")
    f.sync(target, step=1)
    assert_state_equal(target, states[1])
    f.sync(target, step=4)
    assert_state_equal(target, states[4])


def test_a_resumed_uploader_packs_the_proven_state_and_goes_on_with_patches() -> None:
    states = [_state(6)]
    for s in range(1, 5):
        states.append(_step(states[-1], 20 + s))
    store = ds.MemoryStore("resume-packs")
    kw: dict[str, Any] = {"anchor_every": 100, "anchor_bytes_fraction": 0, "span_levels": ()}
    with ds.DeltaUploader(store, **kw) as up:
        for i in range(3):
            up.push(states[i], i).result(WAIT)
    with ds.DeltaUploader(store, **kw) as up:
        assert up.resume(states[2], 2) is True
        assert sorted(p.dtype for p in up._snapshots._baseline.packs) == ["BF16", "F32"]
        infos = [up.push(states[i], i).result(WAIT) for i in (3, 4)]
    assert [i.kind for i in infos] == ["patch", "patch"]
    target = snapshot(states[0])
    ds.DeltaFetcher(store, verify="full").sync(target, step=4)
    assert_state_equal(target, states[4])


def test_the_packed_staging_copies_what_a_caller_hands_in_whatever_its_layout() -> None:
    """Non-contiguous tensors are copied through torch, contiguous ones by the compiled gather; the
    buffer must hold every tensor's bits either way (the caller may change its tensors at once)."""
    a, b = _state(1), _state(2)
    b = {k: (v.t().contiguous().t() if v.dim() == 2 else v) for k, v in b.items()}  # same shapes, not contiguous
    assert not all(v.is_contiguous() for v in b.values())
    store = ds.MemoryStore("staging")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, span_levels=()) as up:
        up.push(a, 0).result(30)
        fut = up.push(b, 1)
        for v in b.values():  # the caller's tensors change as soon as push() returns
            v.zero_()
        fut.result(30)
    target = snapshot(a)
    ds.DeltaFetcher(store, verify="full").sync(target, step=1)
    want = {k: v.contiguous() for k, v in _state(2).items()}
    assert_state_equal(target, want)


@pytest.mark.skipif(kernels.impl() is None, reason="the compiled kernels are not available here")
def test_gather_copies_unaligned_spans_and_tails_exactly() -> None:
    kern = kernels.impl()
    rng = np.random.default_rng(3)
    sizes = [0, 1, 7, 8, 9, 23, 64, 1000, 3]
    srcs = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    # some sources start off an 8-byte boundary
    srcs = [np.concatenate([np.zeros(1, np.uint8), s])[1:] if i % 2 else s for i, s in enumerate(srcs)]
    addrs = np.array([s.__array_interface__["data"][0] for s in srcs], dtype=np.int64)
    for order in (np.arange(len(sizes)), np.arange(len(sizes))[::-1].copy(), np.argsort(addrs)):
        dst = np.zeros(int(starts[-1]) + 5, dtype=np.uint8)
        assert kern.gather_bytes(dst, addrs, starts, order.astype(np.int64))
        assert np.array_equal(dst[: starts[-1]], np.concatenate(srcs))
        assert not dst[starts[-1] :].any()


@pytest.mark.skipif(kernels.impl() is None, reason="the compiled kernels are not available here")
def test_gather_refuses_starts_or_an_order_outside_its_buffer() -> None:
    """Malformed starts (past the buffer, descending, negative) or order: False, nothing copied."""
    kern = kernels.impl()
    src = np.arange(1, 9, dtype=np.uint8)
    addrs = np.array([src.ctypes.data, src.ctypes.data], dtype=np.int64)
    good = np.array([0, 1], dtype=np.int64)
    for starts, order in (
        ([0, 4, 9], good),  # past the 8-byte buffer
        ([0, 5, 4], good),  # descending
        ([-1, 2, 4], good),
        ([0, 4, 8], np.array([0, 2], dtype=np.int64)),
        ([0, 4], good),  # one start short
    ):
        dst = np.zeros(8, dtype=np.uint8)
        assert not kern.gather_bytes(dst, addrs, np.array(starts, dtype=np.int64), order)
        assert not dst.any()


@pytest.mark.parametrize("version", [1, 2])
def test_packed_digests_are_the_tensors_digests(version: int) -> None:
    rng = np.random.default_rng(4)
    buf = rng.integers(0, 255, (40 << 20) + 77, dtype=np.uint8)
    cuts = [0, 0, 5, 300, 70_000, 70_000 + (17 << 20), (40 << 20) + 77]  # empty, tiny, large, tree-digested
    names = [f"t{i}" for i in range(len(cuts) - 1)]
    want = tensor_digests({n: buf[a:b] for n, a, b in zip(names, cuts, cuts[1:], strict=False)}, version)
    assert packed_digests(buf, names, cuts[:-1], cuts[1:], version) == want


def test_a_change_set_reads_as_the_per_tensor_changes() -> None:
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.int16) for i, n in enumerate([4, 0, 6, 5, 3])}
    inv = tuple(sorted((TensorInfo(k, "I16", tuple(v.shape)) for k, v in tensors.items()), key=lambda t: t.name))
    pack = Pack("I16", inv, 2)
    # buffer positions 1, 3 (t0: 0..4), 5, 9 (t2: 4..10), 15, 17 (t4: 15..18); t1 is empty, t3 unchanged
    idx = np.array([1, 3, 5, 9, 15, 17], dtype=np.int64)
    old = np.arange(6, dtype=np.int16)
    new = old + 100
    d = PackedDiff.of(pack, idx, old, new)
    cs = ChangeSet([d], {"other": TensorDiff(np.array([0]), np.array([1], np.int16), np.array([2], np.int16))})
    assert sorted(cs) == ["other", "t0", "t2", "t4"] and len(cs) == 4 and cs.changed == 7
    assert "t1" not in cs and "t3" not in cs
    assert cs["t0"].idx.tolist() == [1, 3] and cs["t2"].idx.tolist() == [1, 5] and cs["t4"].idx.tolist() == [0, 2]
    assert cs["t2"].new.tolist() == [102, 103]
    assert dict(cs)["t4"].old.tolist() == [4, 5]
    # a run of consecutive changed tensors is one group: positions into t0 ++ t2 ++ t4
    idx_g, old_g, new_g, numel = cs.group(["t0", "t2", "t4"])
    assert idx_g.tolist() == [1, 3, 5, 9, 10, 12] and numel == 13 and old_g.tolist() == old.tolist()
    assert cs.group(["t2", "t4"])[0].tolist() == [1, 5, 6, 8]
    assert cs.group(["t0", "other"]) is None and cs.group(["t0", "t4"]) is None
    # read without the per-name table (what a commit asks), then with it: the same answers
    fresh = ChangeSet([d], {"other": cs.other["other"]})
    assert fresh.sorted_names() == ["other", "t0", "t2", "t4"] and len(fresh) == 4
    assert [n in fresh for n in ("t0", "t1", "t3", "t4", "other", "nope", 3)] == [
        True,
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert not fresh.whole(pack)
    assert sorted(fresh) == ["other", "t0", "t2", "t4"]  # iterating makes the table
    assert [n in fresh for n in ("t0", "t1", "t3", "t4")] == [True, False, False, True]
    every = ChangeSet([PackedDiff.of(pack, np.array([0, 4, 10, 17], dtype=np.int64), old[:4], new[:4])])
    assert every.sorted_names() == ["t0", "t2", "t3", "t4"] and not every.whole(pack)  # t1 is empty
    all_of = Pack("I16", tuple(i for i in inv if i.name != "t1"), 2)
    full = ChangeSet([PackedDiff.of(all_of, np.array([0, 4, 10, 17], dtype=np.int64), old[:4], new[:4])])
    assert full.whole(all_of) and not full.whole(pack)


def test_packed_change_sets_merge_pack_by_pack_as_tensor_by_tensor() -> None:
    """What spans and folds compose: two packed sets merged at once equal the per-tensor merge."""
    rng = np.random.default_rng(8)
    names = [f"t{i:02d}" for i in range(20)]
    inv = tuple(TensorInfo(n, "I16", (int(rng.integers(0, 9)),)) for n in names)
    pack = Pack("I16", inv, 2)
    state = rng.integers(-50, 50, pack.numel).astype(np.int16)

    def step() -> ChangeSet:
        idx = np.flatnonzero(rng.random(pack.numel) < 0.4).astype(np.int64)
        old = state[idx].copy()
        state[idx] += rng.choice(np.array([-1, 1], dtype=np.int16), idx.size)  # some go back where they were
        return ChangeSet([PackedDiff.of(pack, idx, old, state[idx].copy())])

    a, b = step(), step()
    merged = merge_change_sets(a, b)
    assert isinstance(merged, ChangeSet)
    want = merge_change_sets(dict(a), dict(b))
    assert not isinstance(want, ChangeSet) and sorted(merged) == sorted(want)
    for n, c in want.items():
        got = merged[n]
        assert (got.idx.tolist(), got.old.tolist(), got.new.tolist()) == (
            c.idx.tolist(),
            c.old.tolist(),
            c.new.tolist(),
        )
