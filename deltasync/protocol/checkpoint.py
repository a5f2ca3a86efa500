"""HF-style sharded safetensors checkpoints (anchors and materialized dirs), built in memory."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from deltasync.errors import ProtocolError
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.entries import AnchorEntry, ByteRange, TensorInfo
from deltasync.protocol.keys import writer_file_name
from deltasync.protocol.manifest import Manifest
from deltasync.protocol.safetensors_io import StFile, TensorBytes, encode_header, parse_safetensors, to_bytes

__all__ = [
    "CHECKPOINT_METADATA",
    "INDEX_NAME",
    "anchor_arrays",
    "build_checkpoint",
    "checkpoint_shards",
    "group_by_size",
    "pack_shards",
    "shard_layout",
]

INDEX_NAME = "model.safetensors.index.json"


def group_by_size(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Greedy split of item indices into groups of at most ``limit`` bytes (a bigger item gets its own)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def pack_shards(items: Sequence[TensorBytes], shard_bytes: int) -> list[list[TensorBytes]]:
    """Greedy split into shards of at most ``shard_bytes`` (a bigger tensor gets its own shard)."""
    return [[items[i] for i in g] for g in group_by_size([t.nbytes for t in items], shard_bytes)]


def shard_layout(shard: Sequence[TensorBytes], metadata: Mapping[str, str]) -> dict[str, ByteRange]:
    """Absolute byte range of every tensor in the file ``to_bytes(shard, metadata)``."""
    pos = len(encode_header(shard, metadata))
    ranges: dict[str, ByteRange] = {}
    for t in shard:
        ranges[t.name] = ByteRange(pos, pos + t.nbytes)
        pos += t.nbytes
    return ranges


CHECKPOINT_METADATA: Mapping[str, str] = {"format": "pt"}


def checkpoint_shards(
    inventory: Sequence[TensorInfo], arrays: Mapping[str, Any], shard_bytes: int, *, writer_id: str | None = None
) -> tuple[list[tuple[str, list[TensorBytes]]], bytes]:
    """The layout :func:`build_checkpoint` writes, without building any file: each shard's file name
    and tensors (in file order), and the bytes of ``model.safetensors.index.json``. A shard's file
    is ``to_bytes(tensors, CHECKPOINT_METADATA)``. With ``writer_id`` the shards are that writer's
    own, in its subfolder (``w{writer_id}/model-...``); the index, which lives in that subfolder
    too, names them by their plain names, relative to itself (as transformers expects)."""
    items = [TensorBytes(t.name, t.dtype, t.shape, arrays[t.name]) for t in inventory]
    shards = pack_shards(items, shard_bytes)
    plain = [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", shard) for i, shard in enumerate(shards)]
    weight_map = {t.name: fname for fname, shard in plain for t in shard}
    index = {"metadata": {"total_size": sum(t.nbytes for t in items)}, "weight_map": weight_map}
    named = plain if writer_id is None else [(writer_file_name(writer_id, fname), shard) for fname, shard in plain]
    return named, json.dumps(index, indent=2, sort_keys=True).encode()


def build_checkpoint(
    inventory: Sequence[TensorInfo], arrays: Mapping[str, Any], shard_bytes: int, *, writer_id: str | None = None
) -> tuple[dict[str, bytes], list[AnchorEntry]]:
    """``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.

    ``arrays`` maps each inventory name to its raw bytes (numpy array or buffer).
    transformers and the ``safetensors`` package load the result as it is. With
    ``writer_id`` every file is that writer's own, in its subfolder
    (``w{writer_id}/model-00001-of-00001.safetensors``, ``w{writer_id}/model.safetensors.index.json``):
    the subfolder is an ordinary HF checkpoint dir, the index naming the shards by their plain names.
    """
    named, index = checkpoint_shards(inventory, arrays, shard_bytes, writer_id=writer_id)
    files: dict[str, bytes] = {}
    entries: list[AnchorEntry] = []
    for fname, shard in named:
        ranges = shard_layout(shard, CHECKPOINT_METADATA)
        files[fname] = to_bytes(shard, CHECKPOINT_METADATA)
        entries.extend(AnchorEntry(t.name, fname, ranges[t.name]) for t in shard)
    files[INDEX_NAME if writer_id is None else writer_file_name(writer_id, INDEX_NAME)] = index
    return files, entries


def anchor_arrays(m: Manifest, files: Mapping[str, bytes | bytearray | memoryview]) -> dict[str, Any]:
    """Flat bit arrays (read-only numpy views into ``files``) of every tensor of anchor ``m``.

    ``files`` maps the manifest's files to their downloaded bytes (sizes and digests
    already checked). Every shard an entry names is parsed as safetensors, and each
    entry's range must be exactly the data span of the same-named tensor there, with
    the inventory's dtype and shape (SPEC.md "Anchors"), so an array's size comes from
    bytes that are present. Anything else is a ProtocolError.
    """
    if m.kind != "anchor":
        raise ProtocolError(f"step {m.step} is a {m.kind}, not an anchor")
    inv = {t.name: t for t in m.inventory}
    parsed: dict[str, StFile] = {}
    out: dict[str, Any] = {}
    for e in m.entries:
        if not isinstance(e, AnchorEntry) or e.tensor not in inv:
            raise ProtocolError(f"step {m.step}: an anchor entry does not name a tensor of the inventory")
        data = files.get(e.file)
        if data is None:
            raise ProtocolError(f"step {m.step}: anchor file {e.file} was not downloaded")
        st = parsed.get(e.file)
        if st is None:
            st = parsed[e.file] = parse_safetensors(data, what=f"step {m.step} {e.file}")
        info = inv[e.tensor]
        ent = st.entries.get(e.tensor)
        if (
            ent is None
            or (ent.start, ent.end) != (e.range.start, e.range.end)
            or ent.dtype != info.dtype
            or ent.shape != info.shape
            or e.range.length != info.nbytes
        ):
            raise ProtocolError(
                f"step {m.step}: anchor file {e.file} does not hold {e.tensor!r} where the manifest says"
            )
        out[e.tensor] = np.frombuffer(data, dtype=dtype_info(info.dtype).bits, count=info.numel, offset=e.range.start)
    missing = sorted(set(inv) - set(out))
    if missing:
        raise ProtocolError(f"step {m.step}: anchor holds no bytes for tensors {missing[:5]} of its inventory")
    return out
