"""A format-2 group is applied whole (one compiled call over all its members, one undo record) where
the plain case holds, and member by member otherwise; either way the same bits, all or nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from deltasync.errors import ProtocolError
from deltasync.fetcher._apply import HostGroup, Undo, apply_changes, host_group
from deltasync.fetcher._fold import Folded, per_tensor
from deltasync.fetcher._target import DeviceTensor, HostTensor, TargetTensor, TensorViews
from deltasync.protocol import PatchEntry, kernels
from deltasync.protocol.entries import ByteRange
from deltasync.protocol.patchfile import DecodedGroup, split_group

pytest.importorskip("numba", reason="the group kernel is what these tests exercise")

Arr = np.ndarray[Any, np.dtype[Any]]


@pytest.fixture(autouse=True)
def _numba() -> Iterator[None]:
    with kernels.using("numba"):
        yield


def _entry(members: tuple[str, ...], count: int, coding: str = "xor-rank") -> PatchEntry:
    r = ByteRange(0, 0)
    return PatchEntry(members[0], "patch-00000.safetensors", count, "rice-z", 0, coding, r, r, members)  # type: ignore[arg-type]


def _group(sizes: list[int], density: float, seed: int, coding: str = "xor-rank", prefix: str = "t") -> DecodedGroup:
    rng = np.random.default_rng(seed)
    names = tuple(f"{prefix}{i:03d}" for i in range(len(sizes)))
    bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    idx = np.flatnonzero(rng.random(int(bounds[-1])) < density).astype(np.int64)
    vals = rng.integers(-(2**15), 2**15, idx.size, dtype=np.int16)  # the bits' signed view, as decoded
    return DecodedGroup(_entry(names, int(idx.size), coding), idx, vals, bounds)


def _arrays(g: DecodedGroup, seed: int) -> dict[str, Arr]:
    rng = np.random.default_rng(seed)
    sizes = np.diff(g.bounds).tolist()
    return {n: rng.integers(-(2**15), 2**15, s, dtype=np.int16) for n, s in zip(g.members, sizes, strict=True)}


def _expected(arrays: dict[str, Arr], changes: list[Any]) -> dict[str, Arr]:
    """The bits after ``changes`` (groups split per member, applied with numpy)."""
    out = {n: a.copy() for n, a in arrays.items()}
    for c in per_tensor(changes):
        view = out[c.tensor]
        if c.coding == "raw":
            view[c.idx] = c.values
        else:
            view[c.idx] ^= c.values
    return out


def _equal(a: dict[str, Arr], b: dict[str, Arr]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)


def _views(arrays: dict[str, Arr], **extra: TargetTensor) -> TensorViews:
    return TensorViews({**{n: HostTensor(a) for n, a in arrays.items()}, **extra})


@pytest.mark.parametrize("coding", ["xor-rank", "raw"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_group_is_applied_whole_and_rolled_back_whole(coding: str, threads: int) -> None:
    g = _group([7, 0, 300, 1, 64, 1000, 5], 0.2, seed=1, coding=coding)
    g2 = _group([50, 60], 0.5, seed=2, coding=coding, prefix="u")
    arrays = {**_arrays(g, 3), **_arrays(g2, 4)}
    before = {n: a.copy() for n, a in arrays.items()}
    tensors = _views(arrays)
    assert host_group(tensors, g, tensors.aliases()) is not None
    undo = Undo()
    apply_changes(tensors, [g, g2], undo, threads=threads)
    assert _equal(arrays, _expected(before, [g, g2]))
    assert undo.names == set(g.members) | set(g2.members)
    assert len(undo._log) == 2  # noqa: SLF001 - one record per group
    undo.rollback()
    assert _equal(arrays, before)


def test_a_later_failure_rolls_the_group_back() -> None:
    """A group applied, then a change whose positions fall outside its tensor: the rollback restores
    the group's members too."""
    g = _group([100] * 20, 0.3, seed=5)
    arrays = _arrays(g, 6)
    arrays["z"] = np.zeros(10, dtype=np.int16)
    before = {n: a.copy() for n, a in arrays.items()}
    bad = Folded("z", np.array([3, 12], dtype=np.int64), np.array([1, 2], dtype=np.int16), None)
    undo = Undo()
    with pytest.raises(ProtocolError, match="positions outside"):
        apply_changes(_views(arrays), [g, bad], undo)
    assert not _equal(arrays, before)  # the group was written...
    undo.rollback()
    assert _equal(arrays, before)  # ...and is undone


def _backwards(g: DecodedGroup, seed: int, backwards: bool = True) -> tuple[dict[str, Arr], Arr]:
    """``g``'s members as views of one buffer laid out last member first (addresses descending in
    the members' order, as a model's tensors sorted by name often are; first member first with
    ``backwards=False``), and the buffer."""
    sizes = np.diff(g.bounds).tolist()
    buf = np.random.default_rng(seed).integers(-(2**15), 2**15, int(g.bounds[-1]) + 8 * len(sizes), dtype=np.int16)
    out: dict[str, Arr] = {}
    at = buf.size if backwards else 0
    for n, size in zip(g.members, sizes, strict=True):
        if backwards:
            at -= size + 8  # a gap between members
        out[n] = buf[at : at + size]
        if not backwards:
            at += size + 8
    return out, buf


@pytest.mark.parametrize("coding", ["xor-rank", "raw"])
def test_members_out_of_address_order_are_written_in_address_order_with_the_same_bits(coding: str) -> None:
    g = _group([7, 0, 300, 1, 64, 1000, 5, 2000], 0.2, seed=21, coding=coding)
    arrays, buf = _backwards(g, 22)
    before, buf_before = {n: a.copy() for n, a in arrays.items()}, buf.copy()
    tensors = _views(arrays)
    group = host_group(tensors, g, tensors.aliases())
    assert group is not None and group.order is not None  # the ordered pass is the one taken
    undo = Undo()
    apply_changes(tensors, [g], undo)
    assert _equal(arrays, _expected(before, [g]))
    written = np.zeros(buf.size, dtype=bool)
    for a in arrays.values():
        if a.size:
            lo = (a.ctypes.data - buf.ctypes.data) // 2
            written[lo : lo + a.size] = True
    assert np.array_equal(buf[~written], buf_before[~written])  # the gaps between members untouched
    undo.rollback()
    assert np.array_equal(buf, buf_before)


@pytest.mark.parametrize(
    "idx",
    [
        [0, 5, 40, 1000],  # past the last member
        [0, 5, 5, 9],  # repeated
        [0, 30, 20, 90],  # descending across members
        [3, 2],  # descending within a member
        [-1, 3],  # negative
        [95, 99, 100],  # one past the end
    ],
)
@pytest.mark.parametrize("backwards", [False, True])
def test_bad_positions_write_nothing(idx: list[int], backwards: bool) -> None:
    """Members in address order (their own arrays) or out of it (the ordered pass checks first)."""
    sizes = [10, 10, 10, 70]
    bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    pos = np.array(idx, dtype=np.int64)
    g = DecodedGroup(_entry(("a", "b", "c", "d"), pos.size), pos, np.full(pos.size, 0x7FFF, np.int16), bounds)
    arrays, _ = _backwards(g, 23, backwards)
    before = {n: a.copy() for n, a in arrays.items()}
    tensors = _views(arrays)
    group = host_group(tensors, g, tensors.aliases())
    assert group is not None and (group.order is not None) == backwards
    with pytest.raises(ProtocolError):
        group.apply(g)
    assert _equal(arrays, before)


def test_the_ordered_kernel_checks_everything_before_writing() -> None:
    """-1 for malformed bounds or an order outside the members, -2 for bad positions; nothing written."""
    kern = kernels.impl()
    assert kern is not None
    a = np.zeros(8, dtype=np.int16)
    addrs = np.array([a.ctypes.data + 8, a.ctypes.data], dtype=np.int64)
    bounds = np.array([0, 4, 8], dtype=np.int64)
    vals = np.ones(2, dtype=np.int16)
    old = np.zeros(2, dtype=np.int16)
    good = np.array([1, 0], dtype=np.int64)
    two = np.array([1, 6], dtype=np.int64)
    assert kern.group_apply_ordered(addrs, np.array([0, 4], dtype=np.int64), two, vals, old, 0, good) == -1
    assert kern.group_apply_ordered(addrs, bounds, two, vals, old, 0, np.array([1, 2], dtype=np.int64)) == -1
    assert kern.group_apply_ordered(addrs, bounds, two, vals, old, 0, np.array([0], dtype=np.int64)) == -1
    for bad in ([6, 1], [1, 8], [-1, 3], [2, 2]):
        assert kern.group_apply_ordered(addrs, bounds, np.array(bad, dtype=np.int64), vals, old, 0, good) == -2
    assert not a.any()
    assert kern.group_apply_ordered(addrs, bounds, two, vals, old, 0, good) == 2
    assert a.tolist() == [0, 0, 1, 0, 0, 1, 0, 0]  # member 0 (position 1) at a[5], member 1 (position 6) at a[2]


def test_bounds_that_are_not_cumulative_are_refused() -> None:
    kern = kernels.impl()
    assert kern is not None
    a = np.zeros(4, dtype=np.int16)
    addrs = np.array([a.ctypes.data], dtype=np.int64)
    old = np.ones(1, dtype=np.int16)
    one = np.array([0], dtype=np.int64)
    for bounds in ([1, 4], [0, 4, 5], [0]):
        assert kern.group_apply(addrs, np.array(bounds, dtype=np.int64), one, old, old, 0) == -1
    assert not a.any()


def test_a_tied_member_falls_back_member_by_member() -> None:
    """A member tied to another name (one memory) is applied through its primary: the group is split."""
    g = _group([30, 40, 50], 0.3, seed=8)
    arrays = _arrays(g, 9)
    shared = arrays[g.members[0]]
    tensors = _views(arrays, a_tied=HostTensor(shared))  # "a_tied" sorts first: the primary
    alias = tensors.aliases()
    assert alias[g.members[0]] == "a_tied"
    assert host_group(tensors, g, alias) is None
    before = {n: a.copy() for n, a in arrays.items()}
    undo = Undo()
    apply_changes(tensors, [g], undo)
    want = _expected(before, [g])
    # the tied member's own change is not applied through its name (check_aliases proves that the
    # primary's change has the same effect; here the primary has none)
    want[g.members[0]] = before[g.members[0]]
    assert _equal(arrays, want)
    assert g.members[0] not in undo.names
    undo.rollback()
    assert _equal(arrays, before)


def test_an_accelerator_member_falls_back() -> None:
    """A member that is not a host array (DeviceTensor: torch indexing, on the CPU here) splits the group."""
    torch = pytest.importorskip("torch")
    g = _group([30, 40, 50], 0.3, seed=10)
    arrays = _arrays(g, 11)
    before = {n: a.copy() for n, a in arrays.items()}
    last = g.members[-1]
    t = torch.from_numpy(arrays[last])  # shares memory with the array
    tensors = _views({n: a for n, a in arrays.items() if n != last}, **{last: DeviceTensor(t)})
    assert host_group(tensors, g, tensors.aliases()) is None
    undo = Undo()
    apply_changes(tensors, [g], undo)
    assert _equal(arrays, _expected(before, [g]))
    undo.rollback()
    assert _equal(arrays, before)


def test_a_member_of_another_size_or_width_falls_back() -> None:
    g = _group([30, 40], 0.3, seed=12)
    arrays = _arrays(g, 13)
    wide = {**arrays, g.members[0]: np.zeros(15, dtype=np.int32)}  # as many bytes, half the elements
    tensors = _views(wide)
    assert host_group(tensors, g, tensors.aliases()) is None
    strided = np.zeros(80, dtype=np.int16)[::2]  # not contiguous
    tensors = _views({**arrays, g.members[1]: strided})
    assert host_group(tensors, g, tensors.aliases()) is None


def test_the_numpy_backend_gives_the_same_bits() -> None:
    g = _group([7, 300, 1, 64, 1000], 0.25, seed=14)
    raw = _group([20, 20], 0.5, seed=15, coding="raw", prefix="r")
    arrays = {**_arrays(g, 16), **_arrays(raw, 17)}
    compiled = {n: a.copy() for n, a in arrays.items()}
    apply_changes(_views(compiled), [g, raw], Undo())
    with kernels.using("numpy"):
        tensors = _views(arrays)
        assert host_group(tensors, g, tensors.aliases()) is None
        undo = Undo()
        apply_changes(tensors, [g, raw], undo)
    assert _equal(arrays, compiled)
    undo.rollback()  # a rollback after the backend changed back still restores
    assert _equal(arrays, {**_arrays(g, 16), **_arrays(raw, 17)})


def test_a_group_rolled_back_after_the_backend_changed() -> None:
    g = _group([100, 100], 0.3, seed=18)
    arrays = _arrays(g, 19)
    before = {n: a.copy() for n, a in arrays.items()}
    undo = Undo()
    apply_changes(_views(arrays), [g], undo)
    with kernels.using("numpy"):
        undo.rollback()
    assert _equal(arrays, before)


def test_split_group_matches_member_by_member() -> None:
    g = _group([5, 0, 17, 1, 300], 0.4, seed=20)
    shares = g.split()
    assert [s.tensor for s in shares] == list(g.members)
    bounds = g.bounds.tolist()
    for i, s in enumerate(shares):
        inside = (g.idx >= bounds[i]) & (g.idx < bounds[i + 1])
        assert np.array_equal(s.idx, g.idx[inside] - bounds[i]) and np.array_equal(s.values, g.values[inside])
    again = split_group(shares[0].__class__(g.entry, g.idx, g.values), np.diff(g.bounds).tolist())
    assert all(np.array_equal(a.idx, b.idx) for a, b in zip(again, shares, strict=True))


def test_a_host_group_is_kept_with_the_views() -> None:
    g = _group([30, 40], 0.3, seed=21)
    tensors = _views(_arrays(g, 22))
    first = host_group(tensors, g, tensors.aliases())
    again = host_group(tensors, g, tensors.aliases())
    assert isinstance(first, HostGroup) and isinstance(again, HostGroup)
    assert again.members is first.members  # what depends on the target only was kept
    with pytest.raises(TypeError):
        tensors["x"] = HostTensor(np.zeros(1, dtype=np.int16))  # the views are read-only


# ------------------------------------------------------------------ through DeltaFetcher.sync


def _many(step: int, n: int = 40) -> dict[str, Any]:
    """``n`` small bf16 tensors (one format-2 group per step), ~20% of their elements changed a step."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    out = {f"layer.{i:02d}.w": torch.randn(96, generator=g).to(torch.bfloat16) for i in range(n)}
    for s in range(1, step + 1):
        g.manual_seed(50 + s)
        for v in out.values():
            mask = torch.rand(96, generator=g) < 0.2
            v[mask] = (v[mask].float() * 1.05 + 0.01).to(torch.bfloat16)
    return out


def _bits_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_later_steps_digest_failure_restores_the_groups_applied_before(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 2 and 3 applied one by one (no fold), step 3's digest of one tensor a lie: the sync raises
    and every tensor of the target holds step 1's bits, the group step 2 wrote included."""
    import json

    torch = pytest.importorskip("torch")
    import deltasync as ds
    from deltasync.errors import ChecksumMismatch
    from deltasync.protocol import Manifest, manifest_key
    from deltasync.protocol.manifest import canonical_json

    store = ds.MemoryStore("groups")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, span_levels=()) as up:
        for s in range(4):
            up.push(_many(s), s).result()
    m2 = Manifest.from_json(store.get(manifest_key(2)))
    assert any(len(e.tensors) > 1 for e in m2.entries if isinstance(e, PatchEntry))  # a group indeed
    body = json.loads(store.get(manifest_key(3)))
    hexes = body["tensor_digests"]["xxh3_128"]
    body["tensor_digests"]["xxh3_128"] = ("0" if hexes[0] != "0" else "1") + hexes[1:]
    store.put(manifest_key(3), canonical_json(body))
    applied: list[DecodedGroup] = []
    whole = HostGroup.apply

    def counted(self: HostGroup, g: DecodedGroup) -> Arr:
        applied.append(g)
        return whole(self, g)

    monkeypatch.setattr(HostGroup, "apply", counted)
    fetcher = ds.DeltaFetcher(store, fold=False, threads=threads)
    target = {k: v.clone() for k, v in _many(0).items()}
    assert fetcher.sync(target, step=1) == 1
    applied.clear()
    with pytest.raises(ChecksumMismatch, match="layer.00.w"):
        fetcher.sync(target, step=3)
    assert len(applied) >= 2  # steps 2 and 3 were applied as groups
    assert _bits_equal(target, _many(1))
    assert fetcher.sync(target, step=2) == 2
    assert _bits_equal(target, _many(2))
    del torch


def test_a_journal_reports_and_undoes_a_group_step() -> None:
    torch = pytest.importorskip("torch")
    import deltasync as ds
    from deltasync.fetcher import SyncJournal

    store = ds.MemoryStore("groups-journal")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, span_levels=()) as up:
        for s in range(3):
            up.push(_many(s), s).result()
    fetcher = ds.DeltaFetcher(store)
    target = {k: v.clone() for k, v in _many(0).items()}
    fetcher.sync(target, step=1)
    journal = SyncJournal()
    assert fetcher.sync(target, step=2, journal=journal) == 2
    one, two = _many(1), _many(2)
    assert _bits_equal(target, two)
    for name, change in journal.changes.items():
        differ = np.flatnonzero((one[name].view(torch.int16) != two[name].view(torch.int16)).numpy())
        assert change.positions is not None and set(differ.tolist()) <= set(change.positions.tolist())
    assert set(journal.names) == {n for n in one if not torch.equal(one[n], two[n])}
    journal.rollback()
    assert _bits_equal(target, one)
    assert fetcher.current_step(target) == 1
