"""The ranks' side channel: a dedicated gloo group for small metadata and sparse payloads.

A sharded uploader talks over its own gloo process group (also when the
trainer's group is NCCL), only from its commit thread, in step order on every
rank. Every call here is a collective: all ranks of the group call it, in the
same order, or it times out after the group's timeout.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

from deltasync._tensors import require_torch

__all__ = ["RankChannel"]


class RankChannel:
    """Collectives of one uploader over its own gloo group (created here: a collective call)."""

    def __init__(self, timeout: float) -> None:
        torch = require_torch()
        self._torch = torch
        self._dist = dist = torch.distributed
        self.group: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.rank: int = dist.get_rank(self.group)
        self.world: int = dist.get_world_size(self.group)
        self._ranks = [dist.get_global_rank(self.group, r) for r in range(self.world)]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the others."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._ranks[0], group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._ranks[0], group=self.group)
        return box[0]

    def send_to(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        """Send ``outgoing[r]`` to rank ``r`` (only there); return what each rank sent to this one.

        Objects are pickled; sizes cross first (one all-gather of ``world`` integers),
        then the bytes point to point. Ranks with nothing for each other exchange nothing.
        Object for this rank itself is returned without a copy.
        """
        torch, dist = self._torch, self._dist
        blobs = {r: pickle.dumps(o, protocol=5) for r, o in outgoing.items() if r != self.rank}
        sizes = torch.zeros(self.world, dtype=torch.int64)
        for r, b in blobs.items():
            sizes[r] = len(b)
        table = [torch.zeros(self.world, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(table, sizes, group=self.group)
        works: list[Any] = []
        recv: dict[int, Any] = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            if r in blobs and blobs[r]:
                src = torch.frombuffer(bytearray(blobs[r]), dtype=torch.uint8)
                works.append(dist.isend(src, self._ranks[r], group=self.group))
            n = int(table[r][self.rank])
            if n:
                recv[r] = torch.empty(n, dtype=torch.uint8)
                works.append(dist.irecv(recv[r], self._ranks[r], group=self.group))
        for w in works:
            w.wait()
        got: dict[int, Any] = {r: pickle.loads(t.numpy().data) for r, t in recv.items()}
        if self.rank in outgoing:
            got[self.rank] = outgoing[self.rank]
        return got
