"""HF-style sharded safetensors checkpoints (anchors and materialized dirs), built in memory."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deltasync.protocol.manifest import AnchorEntry, ByteRange, TensorInfo
from deltasync.protocol.safetensors_io import TensorBytes, encode_header, to_bytes

__all__ = ["INDEX_NAME", "build_checkpoint", "group_by_size", "pack_shards", "shard_layout"]

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


def build_checkpoint(
    inventory: Sequence[TensorInfo], arrays: Mapping[str, Any], shard_bytes: int
) -> tuple[dict[str, bytes], list[AnchorEntry]]:
    """``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.

    ``arrays`` maps each inventory name to its raw bytes (numpy array or buffer).
    transformers and the ``safetensors`` package load the result as it is.
    """
    items = [TensorBytes(t.name, t.dtype, t.shape, arrays[t.name]) for t in inventory]
    shards = pack_shards(items, shard_bytes)
    files: dict[str, bytes] = {}
    entries: list[AnchorEntry] = []
    weight_map: dict[str, str] = {}
    meta = {"format": "pt"}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        ranges = shard_layout(shard, meta)
        files[fname] = to_bytes(shard, meta)
        for t in shard:
            entries.append(AnchorEntry(t.name, fname, ranges[t.name]))
            weight_map[t.name] = fname
    index = {"metadata": {"total_size": sum(t.nbytes for t in items)}, "weight_map": weight_map}
    files[INDEX_NAME] = json.dumps(index, indent=2, sort_keys=True).encode()
    return files, entries
