"""Who writes what in a sharded push: pure functions of the global inventory (no torch, no I/O).

Every rank computes the same answers from the same inventory, so ranks agree on
tensor owners, anchor shard names and patch file names without talking.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.protocol import TensorInfo
from deltasync.protocol.checkpoint import group_by_size
from deltasync.protocol.keys import writer_file_name
from deltasync.protocol.patchfile import patch_file_name

__all__ = [
    "AnchorPlan",
    "Box",
    "anchor_plan",
    "owner_map",
    "patch_file_names",
    "rounds",
    "to_global",
    "write_box",
]

Ints = np.ndarray[Any, np.dtype[Any]]


def owner_map(inventory: Sequence[TensorInfo], world: int) -> dict[str, int]:
    """Owner rank of every tensor: a contiguous split of the (name-sorted) inventory balanced by bytes.

    A tensor goes to the rank whose byte range holds its middle byte, so owners
    are non-decreasing along the inventory (anchor shards then stay in inventory
    order across ranks) and each rank owns about ``1/world`` of the bytes.
    """
    infos = sorted(inventory, key=lambda t: t.name)
    total = sum(t.nbytes for t in infos)
    owners: dict[str, int] = {}
    start = 0
    for t in infos:
        mid2 = 2 * start + t.nbytes  # twice the middle byte, in integers
        owners[t.name] = min(world - 1, mid2 * world // (2 * total)) if total else 0
        start += t.nbytes
    return owners


@dataclass(frozen=True, slots=True)
class AnchorPlan:
    """The anchor layout: each rank's shards (file name, tensor names in file order) and the index."""

    shards: dict[int, list[tuple[str, list[str]]]]
    index: bytes

    @property
    def count(self) -> int:
        """Number of shard files over all ranks."""
        return sum(len(v) for v in self.shards.values())


def anchor_plan(
    inventory: Sequence[TensorInfo],
    owners: dict[str, int],
    world: int,
    shard_bytes: int,
    *,
    writer_id: str | None = None,
) -> AnchorPlan:
    """Shard files of an anchor written by ``world`` owners: ``model-{i:05d}-of-{n:05d}.safetensors``.

    Each rank packs the tensors it owns, in inventory order, into shards of at most
    ``shard_bytes``; the shards are numbered in rank order, so the whole checkpoint
    is still packed in inventory order (SPEC "Anchors"). The index is the bytes of
    ``model.safetensors.index.json`` as the single-process writer makes it. With ``writer_id``
    (every rank passes rank 0's: the group writes as one writer) the shards are that writer's
    own, in its subfolder (``w{writer_id}/model-...``, SPEC "Commit rule"); the index, which
    goes in the same subfolder, names them by their plain names.
    """
    infos = sorted(inventory, key=lambda t: t.name)
    per_rank: list[list[list[str]]] = []
    for r in range(world):
        mine = [t for t in infos if owners[t.name] == r]
        groups = group_by_size([t.nbytes for t in mine], shard_bytes) if mine else []
        per_rank.append([[mine[i].name for i in g] for g in groups])
    n = sum(len(g) for g in per_rank) or 1

    def own(fname: str) -> str:
        return fname if writer_id is None else writer_file_name(writer_id, fname)

    shards: dict[int, list[tuple[str, list[str]]]] = {}
    i = 0
    weight_map: dict[str, str] = {}
    for r, rank_groups in enumerate(per_rank):
        shards[r] = []
        for names in rank_groups:
            i += 1
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            shards[r].append((own(fname), names))
            weight_map.update(dict.fromkeys(names, fname))
    if not infos:  # an empty model still gets one (empty) shard, written by rank 0
        shards[0] = [(own("model-00001-of-00001.safetensors"), [])]
    index = {"metadata": {"total_size": sum(t.nbytes for t in infos)}, "weight_map": weight_map}
    return AnchorPlan(shards, json.dumps(index, indent=2, sort_keys=True).encode())


def patch_file_names(rank: int, world: int, count: int, *, writer_id: str | None = None) -> list[str]:
    """Names of ``rank``'s ``count`` patch files of a step: ``patch-{j * world + rank:05d}``
    (in ``w{writer_id}/``, with ``writer_id``: rank 0's, on every rank).

    Indices are disjoint across ranks without any coordination; they need not be
    contiguous (SPEC "Patches").
    """
    names = [patch_file_name(j * world + rank) for j in range(count)]
    return names if writer_id is None else [writer_file_name(writer_id, n) for n in names]


@dataclass(frozen=True, slots=True)
class Box:
    """Where a rank's local shard sits in the global tensor: its shape and the global offset."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor."""
        return cls(tuple(shape), (0,) * len(shape))

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return int(np.prod(self.shape, dtype=np.int64))


def to_global(idx: Ints, box: Box, global_shape: Sequence[int]) -> Ints:
    """Global flat positions (int64) of flat positions ``idx`` within ``box``'s row-major local shard.

    Sorted positions stay sorted: a box's row-major order is the global row-major
    order restricted to the box.
    """
    gshape = tuple(global_shape)
    idx = np.asarray(idx, dtype=np.int64)
    if box.shape == gshape:
        return idx
    if len(gshape) >= 1 and box.shape[1:] == gshape[1:]:  # split on dim 0: one offset
        row = int(np.prod(gshape[1:], dtype=np.int64))
        return idx + box.offset[0] * row
    coords = np.unravel_index(idx, box.shape)
    shifted = tuple(c + o for c, o in zip(coords, box.offset, strict=True))
    return np.ravel_multi_index(shifted, gshape).astype(np.int64, copy=False)


def write_box(full: Ints, global_shape: Sequence[int], box: Box, local: Ints) -> None:
    """Copy a local shard's flat bits ``local`` into its box of the flat global array ``full``."""
    region = tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))
    full.reshape(tuple(global_shape))[region] = local.reshape(box.shape)


ROUND_BYTES = 256 << 20  # tensor bytes per round when ranks send whole shards to owners


def rounds(inventory: Sequence[TensorInfo]) -> list[list[str]]:
    """Groups of tensors (the same on every rank) whose whole shards cross to the owners together."""
    return [[inventory[i].name for i in g] for g in group_by_size([t.nbytes for t in inventory], ROUND_BYTES)]
