"""The baseline and staging of many small CPU tensors as one flat buffer per dtype (a :class:`Pack`),
and a step's changes of a pack as one sorted array (:class:`PackedDiff`, read through :class:`ChangeSet`).

At 18k MoE tensors a step's cost was per-tensor Python work: a copy call, a diff call and a
:class:`~deltasync.uploader._diff.TensorDiff` per tensor, and a concatenation per format-2 group.
Packed, ``push()`` copies a state into its staging buffer with one ``torch._foreach_copy_`` call,
the diff runs over the whole buffer in a few large chunks (compiled, the GIL released), and a
format-2 group, a run of consecutive tensors of one dtype in name order, is a slice of the
step's sorted positions with its offsets moved. The per-tensor views (``Baseline.tensors``) share
the buffer's memory, so everything that reads one tensor works unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.tensors import torch_bits_dtype
from deltasync.protocol import TensorInfo
from deltasync.uploader._diff import TensorDiff

if TYPE_CHECKING:
    import torch

__all__ = ["ChangeSet", "Pack", "PackedDiff", "plan_packs", "wait_changes"]

Bits = np.ndarray[Any, np.dtype[Any]]
Ints = np.ndarray[Any, np.dtype[np.int64]]

#: fewer CPU tensors of one dtype than this are not packed (a pack pays off at many small tensors)
MIN_PACKED = 16


class Pack:
    """CPU tensors of one dtype laid end to end in name order in one flat bit buffer: ``names``,
    and ``starts`` (element offsets, one more than names: the last is the total)."""

    def __init__(self, dtype: str, infos: Sequence[TensorInfo], itemsize: int) -> None:
        self.dtype = dtype
        self.names = tuple(t.name for t in infos)
        self.shapes = tuple(t.shape for t in infos)
        self.itemsize = itemsize
        starts = np.zeros(len(infos) + 1, dtype=np.int64)
        np.cumsum([t.numel for t in infos], out=starts[1:])
        self.starts: Ints = starts
        self.numel = int(starts[-1])
        self.index = {n: i for i, n in enumerate(self.names)}

    def alloc(self) -> torch.Tensor:
        """A new flat bit buffer for this pack (uninitialised)."""
        import torch

        return torch.empty(self.numel, dtype=torch_bits_dtype(self.itemsize))

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor's flat bit view into ``buf``."""
        s = self.starts.tolist()
        return {n: buf[a:b] for n, a, b in zip(self.names, s, s[1:], strict=False)}

    def shaped(self, buf: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each tensor's view into ``buf`` as ``dtype`` with its own shape (the targets of one
        ``_foreach_copy_`` from the caller's tensors), in pack order."""
        flat = buf.view(dtype)
        s = self.starts.tolist()
        return [flat[a:b].view(shape) for shape, a, b in zip(self.shapes, s, s[1:], strict=False)]


def plan_packs(inventory: Sequence[TensorInfo], tensors: Mapping[str, torch.Tensor]) -> list[Pack]:
    """The packs of a state: its CPU tensors grouped by dtype (each group in name order; dtypes
    with fewer than :data:`MIN_PACKED` tensors stay unpacked)."""
    by: dict[str, list[TensorInfo]] = {}
    sizes: dict[str, int] = {}
    for info in inventory:  # sorted by name
        t = tensors[info.name]
        if t.device.type == "cpu":
            by.setdefault(info.dtype, []).append(info)
            sizes[info.dtype] = t.element_size()
    return [Pack(dtype, infos, sizes[dtype]) for dtype, infos in by.items() if len(infos) >= MIN_PACKED]


@dataclass(slots=True)
class PackedDiff:
    """A step's changes of one pack: sorted positions into the pack's buffer with their old and new
    bits; ``members``: the pack indices of the tensors that changed (ascending), ``bounds``: where
    each one's elements lie in the arrays (one more than ``members``)."""

    pack: Pack
    idx: Ints
    old: Bits
    new: Bits
    members: Ints
    bounds: Ints

    @classmethod
    def of(cls, pack: Pack, idx: Ints, old: Bits, new: Bits) -> PackedDiff:
        """Split sorted buffer positions among the pack's tensors (one search per tensor, not per element)."""
        cuts = np.searchsorted(idx, pack.starts)  # cuts[i]: the first position at or after tensor i
        members = np.flatnonzero(cuts[1:] > cuts[:-1])
        bounds = np.empty(members.size + 1, dtype=np.int64)
        bounds[:-1] = cuts[members]
        bounds[-1] = cuts[members + 1][-1] if members.size else 0
        return cls(pack, idx, old, new, members.astype(np.int64), bounds)

    def one(self, k: int) -> TensorDiff:
        """The ``k``-th changed tensor's change (positions local to it; values are views)."""
        a, b = int(self.bounds[k]), int(self.bounds[k + 1])
        start = int(self.pack.starts[self.members[k]])
        return TensorDiff(self.idx[a:b] - start, self.old[a:b], self.new[a:b])

    def run(self, k0: int, k1: int) -> tuple[Ints, Bits, Bits, int]:
        """Changed tensors ``k0..k1-1`` as one format-2 group: positions into the concatenation of
        those tensors, old and new bits, and the concatenation's element count."""
        a, b = int(self.bounds[k0]), int(self.bounds[k1])
        members = self.members[k0:k1]
        starts = self.pack.starts
        numels = starts[members + 1] - starts[members]
        offsets = np.zeros(members.size, dtype=np.int64)
        np.cumsum(numels[:-1], out=offsets[1:])
        shift = starts[members] - offsets  # a member's position in the buffer minus its place in the group
        idx = self.idx[a:b] - np.repeat(shift, np.diff(self.bounds[k0 : k1 + 1]))
        return idx, self.old[a:b], self.new[a:b], int(numels.sum())


class ChangeSet(Mapping[str, TensorDiff]):
    """A step's changes by tensor name: the packed ones (:class:`PackedDiff`, each tensor's
    :class:`TensorDiff` made when asked for) and the others as they are. Iterates in no set order."""

    def __init__(self, packed: Sequence[PackedDiff] = (), other: Mapping[str, TensorDiff] | None = None) -> None:
        self.packed = tuple(packed)
        self.other = dict(other or {})
        self._where_made: dict[str, tuple[int, int]] | None = None

    @property
    def _where(self) -> dict[str, tuple[int, int]]:
        """Each packed changed tensor's (pack, rank among the pack's changed ones), made on first use
        (a step's commit asks :meth:`sorted_names`, :meth:`whole` and :meth:`group` instead: no
        per-name dict at 18k tensors)."""
        if self._where_made is None:
            where: dict[str, tuple[int, int]] = {}
            for p, d in enumerate(self.packed):
                names = d.pack.names
                for k, m in enumerate(d.members.tolist()):
                    where[names[m]] = (p, k)
            self._where_made = where
        return self._where_made

    def _find(self, name: str) -> tuple[int, int] | None:
        """:attr:`_where`'s entry of ``name`` by a search in its pack's changed members (a name is in one
        pack at most: packs hold distinct names)."""
        if self._where_made is not None:
            return self._where_made.get(name)
        for p, d in enumerate(self.packed):
            m = d.pack.index.get(name)
            if m is not None:
                k = int(np.searchsorted(d.members, m))
                return (p, k) if k < d.members.size and int(d.members[k]) == m else None
        return None

    def __getitem__(self, name: str) -> TensorDiff:
        hit = self._find(name)
        if hit is None:
            return self.other[name]
        return self.packed[hit[0]].one(hit[1])

    def __contains__(self, name: object) -> bool:
        return (isinstance(name, str) and self._find(name) is not None) or name in self.other

    def __iter__(self) -> Iterator[str]:
        yield from self._where
        yield from self.other

    def __len__(self) -> int:
        return sum(int(d.members.size) for d in self.packed) + len(self.other)

    def sorted_names(self) -> list[str]:
        """The changed tensors' names, sorted (a pack's changed members are in name order already:
        one C-level pass per pack)."""
        out: list[str] = []
        for d in self.packed:
            out.extend(map(d.pack.names.__getitem__, d.members.tolist()))
        if len(self.packed) > 1 or self.other:
            out.extend(self.other)
            out.sort()  # sorted runs: merged
        return out

    def whole(self, pack: Pack) -> bool:
        """Whether every tensor of ``pack`` changed (a MoE step at RL densities)."""
        return any(d.pack is pack and int(d.members.size) == len(pack.names) for d in self.packed)

    @property
    def changed(self) -> int:
        """Elements changed in all."""
        return sum(int(d.idx.size) for d in self.packed) + sum(int(c.idx.size) for c in self.other.values())

    def wait(self) -> None:
        """Block until every change's arrays hold their data (device changes copy asynchronously)."""
        for c in self.other.values():
            c.wait()

    def mergeable(self, other: ChangeSet) -> bool:
        """Whether this set and ``other`` can merge pack by pack: no tensor of a pack of either one
        is among the other's unpacked changes, and packs holding the same tensors are the same."""
        mine = {id(d.pack): d.pack for d in self.packed}
        theirs = {id(d.pack): d.pack for d in other.packed}
        for packs, others in ((mine, other.other), (theirs, self.other)):
            if any(n in p.index for p in packs.values() for n in others):
                return False
        packs = {**mine, **theirs}
        if len(packs) > 1:
            seen: dict[str, int] = {}
            for i, p in packs.items():
                if any(seen.setdefault(n, i) != i for n in p.names):
                    return False
        return True

    def group(self, names: Sequence[str]) -> tuple[Ints, Bits, Bits, int] | None:
        """``names`` as one format-2 group straight from their pack (positions into the
        concatenation, old, new, element count), when they are consecutive changed tensors of one
        pack; else None (the caller joins the tensors' own changes)."""
        first = self._find(names[0])
        last = self._find(names[-1])
        if first is None or last is None or first[0] != last[0] or last[1] - first[1] != len(names) - 1:
            return None
        return self.packed[first[0]].run(first[1], last[1] + 1)


def wait_changes(changes: Mapping[str, TensorDiff]) -> None:
    """Block until every change of a step holds its data (packed ones always do: they are made on
    the host)."""
    if isinstance(changes, ChangeSet):
        changes.wait()
    else:
        for c in changes.values():
            c.wait()
