"""The ranks' side channel: a gloo process group of the uploader's own, for metadata and sparse payloads.

A sharded uploader talks over a gloo group it builds itself (also when the
trainer's group is NCCL), only from its commit thread, in step order on every
rank. Every call here is a collective: all ranks of the group call it, in the
same order, or it fails after ``timeout`` seconds with :class:`ChannelError`.

The group is not made with ``torch.distributed.new_group``: that numbers groups
with one process-wide counter shared with the trainer's own groups, so a rank
that builds one group more than the others would shift every group made after
it. Instead each channel meets the other ranks under a name of its own (the
uploader's number in this process and the push that opened it) in the default
group's rendezvous store. A group that lost contact (a timeout, a dead peer) is
never used again: the next push opens a new one under a new name, so a rank
that arrives late can never be paired with another step's messages.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
from datetime import timedelta
from typing import Any

from deltasync._util.tensors import require_torch

__all__ = ["ChannelError", "RankChannel", "next_uploader_number"]

_UPLOADERS = itertools.count()


def next_uploader_number() -> int:
    """The number of a new sharded uploader in this process. Every rank creates its uploaders in the
    same order (creating one is a collective), so the n-th uploader has the same number on every rank."""
    return next(_UPLOADERS)


class ChannelError(Exception):
    """A collective of the channel failed (a peer timed out or died): this channel is done."""


class RankChannel:
    """Collectives over one gloo group of every rank of the default group.

    Opening it is itself a collective: it waits up to ``join_timeout`` seconds for every
    rank to open the channel of the same ``name``, then each call waits up to ``timeout``.
    """

    def __init__(self, name: str, *, timeout: float, join_timeout: float) -> None:
        torch = require_torch()
        dist = torch.distributed
        from torch.distributed import distributed_c10d  # the default group's rendezvous store

        self._torch = torch
        self.name = name
        self.rank: int = dist.get_rank()
        self.world: int = dist.get_world_size()
        self._tag = 0
        store = dist.PrefixStore(f"deltasync/{name}/", distributed_c10d._get_default_store())
        try:
            self._pg: Any = dist.ProcessGroupGloo(store, self.rank, self.world, timedelta(seconds=join_timeout))
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistStoreError here
            raise ChannelError(
                f"not every rank opened the uploader's group {name!r} within {join_timeout:g} s ({_short(exc)})"
            ) from exc
        self._pg._set_default_timeout(timedelta(seconds=timeout))

    def close(self) -> None:
        """Drop the group's connections (idempotent; peers still in a call get an error)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # best effort: the channel is done either way
                pg.shutdown()

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - a timeout or a closed connection
            raise ChannelError(_short(exc)) from exc

    def _call(self, fn: Any, *args: Any) -> None:
        if self._pg is None:
            raise ChannelError(f"the uploader's group {self.name!r} is closed")
        try:
            work = fn(self._pg, *args)
        except Exception as exc:  # noqa: BLE001 - gloo may fail before returning a work object
            raise ChannelError(_short(exc)) from exc
        self._wait(work)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled; sizes cross first)."""
        torch = self._torch
        data = pickle.dumps(obj, protocol=5)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._call(lambda pg, o, i: pg.allgather(o, i), [sizes], [torch.tensor([len(data)], dtype=torch.int64)])
        width = max(int(s) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
        self._call(lambda pg, o, i: pg.allgather(o, i), [out], [buf])
        return [pickle.loads(out[r][: int(sizes[r])].numpy().tobytes()) for r in range(self.world)]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return self.all_gather(obj if self.rank == 0 else None)[0]

    def send_to(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        """Send ``outgoing[r]`` to rank ``r`` (only there); return what each rank sent to this one.

        Objects are pickled; sizes cross first (one all-gather of ``world`` integers),
        then the bytes point to point. Ranks with nothing for each other exchange nothing.
        The object for this rank itself is returned without a copy.
        """
        torch = self._torch
        blobs = {r: pickle.dumps(o, protocol=5) for r, o in outgoing.items() if r != self.rank}
        sizes = torch.zeros(self.world, dtype=torch.int64)
        for r, b in blobs.items():
            sizes[r] = len(b)
        table = [torch.zeros(self.world, dtype=torch.int64) for _ in range(self.world)]
        self._call(lambda pg, o, i: pg.allgather(o, i), [table], [sizes])
        self._tag += 1
        works: list[Any] = []
        recv: dict[int, Any] = {}
        try:
            for r in range(self.world):
                if r == self.rank:
                    continue
                if blobs.get(r):
                    src = torch.frombuffer(bytearray(blobs[r]), dtype=torch.uint8)
                    works.append(self._pg.send([src], r, self._tag))
                n = int(table[r][self.rank])
                if n:
                    recv[r] = torch.empty(n, dtype=torch.uint8)
                    works.append(self._pg.recv([recv[r]], r, self._tag))
        except Exception as exc:  # noqa: BLE001 - gloo may fail before returning a work object
            raise ChannelError(_short(exc)) from exc
        for w in works:
            self._wait(w)
        got: dict[int, Any] = {r: pickle.loads(t.numpy().data) for r, t in recv.items()}
        if self.rank in outgoing:
            got[self.rank] = outgoing[self.rank]
        return got


def _short(exc: BaseException) -> str:
    """gloo's messages start with a source path in brackets; keep the part a user can act on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:300]
