"""One rank's part of a (DTensor) state dict: its local shards as flat bits, and where each sits.

A sharded push diffs only what a rank holds. :func:`local_shards` reads a state dict of
DTensors (``Shard(dim)`` / ``Replicate()`` placements) or plain tensors (held whole,
replicated) into flat local bits, the :class:`~deltasync.uploader.sharded._shardmap.Box` each fills
in its global tensor, and the global inventory every rank agrees on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync._util.tensors import flat_bits, st_dtype, state_tensors
from deltasync.errors import InventoryMismatch
from deltasync.protocol import TensorInfo
from deltasync.uploader.sharded._shardmap import Box

if TYPE_CHECKING:
    import torch

__all__ = ["local_shards"]


def local_shards(
    state: Any, cast_dtype: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Box | None], list[TensorInfo]]:
    """This rank's flat local bits, the box each sits in (None: held replicated), and the global inventory."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bits: dict[str, torch.Tensor] = {}
    boxes: dict[str, Box | None] = {}
    infos: list[TensorInfo] = []
    for name, t in state_tensors(state).items():
        shape = tuple(t.shape)
        if isinstance(t, DTensor):
            bad = [p for p in t.placements if type(p) not in (Shard, Replicate)]
            if bad:
                raise InventoryMismatch(
                    f"tensor {name!r}: placement {type(bad[0]).__name__} ({bad[0]}) is not supported by a sharded push (only Shard(dim) "
                    "and Replicate()); reduce or redistribute it first, e.g. t.redistribute(placements=[...])"
                )
            local = t.to_local()
            coord = t.device_mesh.get_coordinate()
            if all(isinstance(p, Replicate) for p in t.placements):
                box: Box | None = None
            elif coord is None or any(isinstance(p, Replicate) and coord[i] for i, p in enumerate(t.placements)):
                box = Box((0,) * len(shape), (0,) * len(shape))  # another rank holds the same shard
                local = local.new_empty(0)
            else:
                lshape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                box = Box(tuple(lshape), tuple(offset))
                if tuple(local.shape) != box.shape:
                    raise InventoryMismatch(f"tensor {name!r}: local shard {tuple(local.shape)} is not {box.shape}")
        else:
            local, box = t, None
        cast = cast_dtype
        if cast is not None and local.is_floating_point() and local.dtype != cast:
            local = local.to(cast)
        infos.append(TensorInfo(name, st_dtype(local.dtype), shape))
        bits[name] = flat_bits(local)
        boxes[name] = box
    return bits, boxes, sorted(infos, key=lambda i: i.name)
