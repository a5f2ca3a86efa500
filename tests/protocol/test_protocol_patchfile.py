"""The patch-file layout (protocol/patchfile.py), the anchor reader, and the size bounds of protocol v1.

Every declared count, shape and size is checked against bytes that are present before
anything is allocated from it: these tests feed declarations that would need huge
buffers and expect a ProtocolError (or ChainBroken), never a MemoryError.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from manifests import anchor_manifest

from deltasync.errors import ChainBroken, ProtocolError
from deltasync.protocol import (
    AnchorEntry,
    ByteRange,
    Committed,
    FileInfo,
    Manifest,
    PatchEntry,
    Stats,
    TensorInfo,
    anchor_arrays,
    build_patch_files,
    check_patch_file,
    decode_patch,
    decode_positions,
    decode_values,
    encode_changes,
    inventory_digest,
    patch_entry_names,
    plan_fetch,
    xxh3_128,
)
from deltasync.protocol.encoding import EncodedTensor
from deltasync.protocol.patchfile import patch_metadata
from deltasync.protocol.safetensors_io import TensorBytes, to_bytes
from deltasync.protocol.streams import compress as _compress
from deltasync.protocol.values import encode_xor_rank as _encode_xor_rank

INV = (TensorInfo("a", "BF16", (4, 8)), TensorInfo("b", "F32", (100,)), TensorInfo("c", "I8", (3,)))


def _states() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    old = {
        "a": rng.integers(-(2**15), 2**15, 32, dtype=np.int16),
        "b": rng.integers(-(2**31), 2**31, 100, dtype=np.int32),
        "c": rng.integers(-128, 128, 3, dtype=np.int8),
    }
    new = {k: v.copy() for k, v in old.items()}
    new["a"][[3, 17, 30]] ^= 1
    new["b"][::2] ^= 5
    return old, new


def _items(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> list[tuple[str, EncodedTensor]]:
    out = []
    for name in sorted(new):
        idx = np.flatnonzero(old[name] != new[name]).astype(np.int64)
        if idx.size:
            out.append((name, encode_changes(new[name].size, idx, old[name][idx], new[name][idx])))
    return out


def _patch_manifest(
    step: int, files: dict[str, bytes], entries: list[PatchEntry], inv: tuple[TensorInfo, ...] = INV
) -> Manifest:
    infos = tuple(FileInfo(n, len(d), xxh3_128(d)) for n, d in sorted(files.items()))
    return Manifest(
        run_id="r",
        step=step,
        kind="patch",
        parent_step=step - 1,
        parent_digest="0" * 32,
        anchor_step=0,
        inventory=inv,
        inventory_digest=inventory_digest(inv),
        files=infos,
        entries=tuple(entries),
        tensor_digests={},
        stats=Stats(0, sum(t.numel for t in inv), sum(f.size for f in infos)),
    )


def test_build_and_decode_roundtrip_across_files() -> None:
    old, new = _states()
    files, entries = build_patch_files(3, _items(old, new), shard_bytes=16)
    assert sorted(files) == ["patch-00000.safetensors", "patch-00001.safetensors"]
    m = Manifest.from_json(_patch_manifest(3, files, entries).to_json())
    decoded = decode_patch(m, files)
    assert [d.tensor for d in decoded] == ["a", "b"]
    for d in decoded:
        out = old[d.tensor].copy()
        out[d.idx] = out[d.idx] ^ d.values if d.coding == "xor-rank" else d.values
        np.testing.assert_array_equal(out, new[d.tensor])


def test_no_change_still_makes_one_empty_file() -> None:
    files, entries = build_patch_files(4, [], shard_bytes=1 << 20)
    assert list(files) == ["patch-00000.safetensors"] and entries == []
    m = _patch_manifest(4, files, entries)
    assert decode_patch(m, files) == []


def _one_file() -> tuple[Manifest, bytes, list[PatchEntry], list[tuple[str, EncodedTensor]]]:
    old, new = _states()
    items = _items(old, new)
    files, entries = build_patch_files(5, items, shard_bytes=1 << 20)
    (data,) = files.values()
    return _patch_manifest(5, files, entries), data, entries, items


def _file_of(tensors: list[TensorBytes], meta: dict[str, str]) -> bytes:
    return to_bytes(tensors, meta)


def test_check_patch_file_refuses_what_the_manifest_does_not_say() -> None:
    m, data, entries, items = _one_file()
    name = "patch-00000.safetensors"
    st = check_patch_file(m, name, data)
    assert set(st.entries) == {n for e in entries for n in patch_entry_names(e.tensor)}
    # the same bytes under another step: the metadata names step 5
    with pytest.raises(ProtocolError, match="metadata"):
        check_patch_file(dataclasses.replace(m, step=6), name, data)
    blobs = [
        TensorBytes(n, "U8", (len(b),), b)
        for t, e in items
        for n, b in zip(patch_entry_names(t), (e.pos_blob, e.val_blob), strict=True)
    ]
    # an extra entry the manifest does not list
    extra = _file_of([*blobs, TensorBytes("z/values", "U8", (1,), b"\0")], patch_metadata(5))
    with pytest.raises(ProtocolError, match="unexpected"):
        check_patch_file(m, name, extra)
    # an entry missing
    with pytest.raises(ProtocolError, match="missing"):
        check_patch_file(m, name, _file_of(blobs[:-1], patch_metadata(5)))
    # the right names and sizes, but not U8 1-D
    odd = [TensorBytes(t.name, "I8", t.shape, t.data) if i == 0 else t for i, t in enumerate(blobs)]
    with pytest.raises(ProtocolError, match="U8"):
        check_patch_file(m, name, _file_of(odd, patch_metadata(5)))
    # positions and values swapped in the file: the ranges no longer match
    swapped = [blobs[1], blobs[0], *blobs[2:]]
    with pytest.raises(ProtocolError):
        check_patch_file(m, name, _file_of(swapped, patch_metadata(5)))


def test_patch_entries_may_not_declare_more_than_their_tensor() -> None:
    m, data, entries, _ = _one_file()
    body = m.to_json()
    for bad in (
        body.replace(b'"count":3,', b'"count":33,'),  # a has 32 elements
        body.replace(b'"positions":"rice"', b'"positions":"dense"', 1),  # dense needs count == numel, no bytes
    ):
        with pytest.raises(ProtocolError):
            Manifest.from_json(bad)


def test_dense_entries_carry_no_position_bytes() -> None:
    files, entries = build_patch_files(5, [("c", EncodedTensor(3, "dense", 0, "raw", b"", _compress(b"abc")))], 1 << 20)
    m = Manifest.from_json(_patch_manifest(5, files, entries).to_json())
    (d,) = decode_patch(m, files)
    assert d.idx.tolist() == [0, 1, 2] and bytes(d.values.tobytes()) == b"abc"
    e = dataclasses.replace(
        entries[0], positions_range=ByteRange(entries[0].values_range.start - 1, entries[0].values_range.start)
    )
    with pytest.raises(ProtocolError, match="dense"):
        Manifest.from_json(_patch_manifest(5, files, [e]).to_json())


@pytest.mark.parametrize("count", [2**20, 2**30, 2**40])
def test_value_streams_are_bounded_by_their_bytes(count: int) -> None:
    """A frame cannot expand more than 32768-fold: a tiny blob declaring a huge count is refused up front."""
    tiny = _compress(b"\0" * 64)
    bits = np.dtype(np.int64)
    with pytest.raises(ProtocolError, match="cannot hold"):
        decode_values(tiny, "raw", count, bits, "t")
    with pytest.raises(ProtocolError):
        decode_values(b"\0\0" + (4).to_bytes(4, "little") + (0).to_bytes(4, "little"), "xor-rank", count, bits, "t")
    with pytest.raises(ProtocolError):
        decode_positions(b"\0" * 16, "rice-z", 0, count, 2**41, "t")
    with pytest.raises(ProtocolError):
        decode_positions(b"\0" * 16, "rice", 0, count, 2**41, "t")


def test_empty_expected_streams_have_no_bytes() -> None:
    """No escaped rank means no escape frame at all: an (empty) frame in its place is refused."""
    blob = _encode_xor_rank(np.array([1, 1, 2], dtype=np.int16))
    assert decode_values(blob, "xor-rank", 3, np.dtype(np.int16), "t").tolist() == [1, 1, 2]
    with pytest.raises(ProtocolError, match="no zstd frame belongs"):
        decode_values(blob + _compress(b""), "xor-rank", 3, np.dtype(np.int16), "t")


# ----------------------------------------------------------------- anchors


def _anchor() -> tuple[Manifest, dict[str, bytes]]:
    old, _ = _states()
    return anchor_manifest(INV, old)


def test_anchor_arrays_are_views_of_checked_shards() -> None:
    m, files = _anchor()
    old, _ = _states()
    arrays = anchor_arrays(m, files)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(arr, old[name])


def test_anchor_arrays_refuse_a_shard_that_disagrees() -> None:
    m, files = _anchor()
    shard = next(n for n in files if n.endswith(".safetensors"))
    old, _ = _states()
    # same sizes, another dtype in the shard header
    other = [TensorBytes(t.name, {"BF16": "F16", "F32": "I32", "I8": "U8"}[t.dtype], t.shape, old[t.name]) for t in INV]
    with pytest.raises(ProtocolError, match="does not hold"):
        anchor_arrays(m, {**files, shard: to_bytes(other, {"format": "pt"})})
    # a tensor's entry pointing at another tensor's bytes
    e0, e1 = m.entries[0], m.entries[1]
    assert isinstance(e0, AnchorEntry) and isinstance(e1, AnchorEntry)
    with pytest.raises(ProtocolError):
        anchor_arrays(
            dataclasses.replace(m, entries=(e0, dataclasses.replace(e1, range=e0.range), m.entries[2])), files
        )
    with pytest.raises(ProtocolError, match="not downloaded"):
        anchor_arrays(m, {})


# ----------------------------------------------------------------- planning


def test_a_patch_with_another_inventory_breaks_the_chain() -> None:
    """A patch must have its parent's inventory: a huge declared shape cannot ride on a small anchor."""
    anchor, _ = _anchor()
    a_body = anchor.to_json()
    a = Committed(anchor, xxh3_128(a_body))
    huge = (TensorInfo("a", "BF16", (2**40,)), *INV[1:])
    files, entries = build_patch_files(1, [], 1 << 20)
    patch = dataclasses.replace(_patch_manifest(1, files, entries, huge), parent_step=0, parent_digest=a.digest)
    p = Committed(Manifest.from_json(patch.to_json()), xxh3_128(patch.to_json()))
    with pytest.raises(ChainBroken, match="inventory"):
        plan_fetch({0: a, 1: p}, 1)
    same = dataclasses.replace(_patch_manifest(1, files, entries), parent_step=0, parent_digest=a.digest)
    ok = Committed(same, xxh3_128(same.to_json()))
    assert plan_fetch({0: a, 1: ok}, 1).steps == (0, 1)


def test_a_count_the_value_bytes_cannot_code_is_refused_by_the_manifest() -> None:
    m, _, entries, _ = _one_file()
    e = entries[0]
    tiny = dataclasses.replace(e, count=32, values_range=ByteRange(e.values_range.start, e.values_range.start))
    with pytest.raises(ProtocolError, match="cannot code"):
        Manifest.from_json(dataclasses.replace(m, entries=(tiny, *entries[1:])).to_json())


def test_entries_of_one_file_may_not_overlap() -> None:
    m, _, entries, _ = _one_file()
    a, b = entries
    # b's positions claim a's value bytes (each range still inside the file)
    bad = dataclasses.replace(b, positions_range=ByteRange(a.values_range.start, b.positions_range.end))
    with pytest.raises(ProtocolError, match="overlap"):
        Manifest.from_json(dataclasses.replace(m, entries=(a, bad)).to_json())
    am, _ = _anchor()
    e0, e1 = am.entries[0], am.entries[1]
    assert isinstance(e0, AnchorEntry) and isinstance(e1, AnchorEntry)
    shifted = dataclasses.replace(e1, range=ByteRange(e1.range.start - 1, e1.range.end - 1))
    with pytest.raises(ProtocolError, match="overlap"):
        Manifest.from_json(dataclasses.replace(am, entries=(e0, shifted, *am.entries[2:])).to_json())


def test_group_bounds_are_kept_per_inventory_not_by_names_alone() -> None:
    """A group's bounds are kept for its members within one inventory; the same names in another
    inventory (other shapes) get their own."""
    from deltasync.protocol import PatchEntry, TensorInfo
    from deltasync.protocol.entries import ByteRange
    from deltasync.protocol.patchfile import group_bounds, inventory_sizes

    entry = PatchEntry("a", "f", 1, "rice", 0, "raw", ByteRange(0, 0), ByteRange(0, 0), ("a", "b"))
    small = (TensorInfo("a", "BF16", (2, 3)), TensorInfo("b", "BF16", (4,)))
    large = (TensorInfo("a", "BF16", (5, 3)), TensorInfo("b", "BF16", (7,)))
    first = group_bounds(entry, *inventory_sizes(small))
    assert first.tolist() == [0, 6, 10]
    assert group_bounds(entry, *inventory_sizes(small)) is first  # kept
    assert group_bounds(entry, *inventory_sizes(large)).tolist() == [0, 15, 22]
    assert group_bounds(entry, *inventory_sizes(small)).tolist() == [0, 6, 10]
