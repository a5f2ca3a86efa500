"""Applying decoded steps to a target's tensors, all or nothing: the checks before, the writes, the undo log."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltasync._util.batches import map_batched
from deltasync._util.cpus import parallel_map
from deltasync.errors import ChecksumMismatch, InventoryMismatch
from deltasync.fetcher._fold import Change, Folded, new_bits
from deltasync.fetcher._target import HostTensor, TargetTensor, target_digests
from deltasync.protocol import DecodedEntry, Manifest, TensorInfo
from deltasync.protocol.digests import tensor_digests

__all__ = [
    "Undo",
    "alias_groups",
    "apply_changes",
    "changed_names",
    "check_aliases",
    "check_anchor",
    "check_digests",
    "check_inventory",
    "same_effect",
]

Bits = np.ndarray[Any, np.dtype[Any]]


def check_inventory(have: Sequence[TensorInfo], m: Manifest) -> None:
    """Raise InventoryMismatch, naming the differences, unless the target matches the manifest."""
    if tuple(have) == m.inventory:
        return
    mine = {t.name: t for t in have}
    theirs = {t.name: t for t in m.inventory}
    missing = sorted(set(theirs) - set(mine))
    extra = sorted(set(mine) - set(theirs))
    differ = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    parts = []
    if missing:
        parts.append(f"missing in target: {missing[:5]}")
    if extra:
        parts.append(f"not in the run: {extra[:5]}")
    if differ:
        n = differ[0]
        parts.append(
            f"dtype/shape differ for {differ[:5]} (e.g. {n}: target {mine[n].dtype}{list(mine[n].shape)}, run {theirs[n].dtype}{list(theirs[n].shape)})"
        )
    raise InventoryMismatch(f"target does not match step {m.step}'s tensors: " + "; ".join(parts))


def alias_groups(tensors: Mapping[str, TargetTensor]) -> dict[str, str]:
    """Map each name to the first name (sorted) sharing its memory: tied weights are applied once."""
    first: dict[Any, str] = {}
    out: dict[str, str] = {}
    for name in sorted(tensors):
        out[name] = first.setdefault(tensors[name].key, name)
    return out


def changed_names(m: Manifest, parent: Manifest | None, changes: Sequence[Change]) -> list[str]:
    """Tensors that step ``m`` changes: those it has entries for, plus every tensor whose digest
    differs from its parent's (a tensor the manifest says changed but whose entry is missing is
    still proven). Without the parent's digests every digested tensor counts; so does a large tensor
    under a parent of another format, whose digest is defined otherwise (SPEC "Digests")."""
    names = {c.tensor for c in changes}
    for name, want in m.tensor_digests.items():
        if parent is None or parent.tensor_digests.get(name) != want:
            names.add(name)
    return sorted(names)


def check_digests(tensors: Mapping[str, TargetTensor], names: Sequence[str], m: Manifest, *, threads: int = 1) -> None:
    """Raise ChecksumMismatch unless each named tensor equals step ``m``'s digest of it (in ``m``'s
    format), hashed on up to ``threads`` threads at once."""
    want = {n: d for n in names if (d := m.tensor_digests.get(n)) is not None}
    got = target_digests(tensors, want, m.format_version, threads=threads)
    for name in names:
        if name in want and got[name] != want[name]:
            raise ChecksumMismatch(f"step {m.step}: tensor {name!r} is not bit-exact after applying (digest mismatch)")


def _result(idx: Bits, old: Bits, c: Change | None) -> Bits:
    """The bits at ``idx`` after applying ``c`` onto ``old`` (``c.idx`` is a subset of ``idx``)."""
    out: Bits = np.array(old)
    if c is not None and c.idx.size:
        pos = np.searchsorted(idx, c.idx)
        out[pos] = new_bits(c, old[pos])
    return out


def same_effect(bits: TargetTensor, a: Change | None, b: Change | None) -> bool:
    """Whether two changes turn the bits of ``bits`` into the same bits (codings may differ)."""
    if a is None and b is None:
        return True
    empty = np.zeros(0, dtype=np.int64)
    idx = np.union1d(a.idx if a is not None else empty, b.idx if b is not None else empty)
    old = bits.take(idx)
    return bool(np.array_equal(_result(idx, old, a), _result(idx, old, b)))


def check_aliases(tensors: Mapping[str, TargetTensor], m: Manifest, changes: Sequence[Change]) -> None:
    """Tied tensors (one memory, several names) must receive changes with the same effect on the
    target's current bits (the writer may have coded them differently)."""
    by_name = {c.tensor: c for c in changes}
    for name, primary in alias_groups(tensors).items():
        if primary != name and not same_effect(tensors[primary], by_name.get(primary), by_name.get(name)):
            raise InventoryMismatch(
                f"target ties {primary!r} and {name!r} to one tensor, but step {m.step} changes them differently"
            )


def check_anchor(
    tensors: Mapping[str, TargetTensor], m: Manifest, arrays: Mapping[str, Bits], *, verify: bool, threads: int = 1
) -> None:
    """Digests of a downloaded anchor (when verifying; on up to ``threads`` threads at once) and tied
    tensors, before anything is written."""
    if verify:
        want = {n: d for n in arrays if (d := m.tensor_digests.get(n)) is not None}
        got = tensor_digests(
            {n: arrays[n] for n in want}, m.format_version, mapper=functools.partial(parallel_map, threads=threads)
        )
        for name in arrays:
            if name in want and got[name] != want[name]:
                raise ChecksumMismatch(f"step {m.step}: anchor tensor {name!r} does not match its digest")
    for name, primary in alias_groups(tensors).items():
        if primary != name and not np.array_equal(arrays[name], arrays[primary]):
            raise InventoryMismatch(
                f"target ties {primary!r} and {name!r} to one tensor, but step {m.step} holds different values"
            )


class Undo:
    """Old bits of every element written, so a whole plan can be rolled back; ``names`` are the tensors written."""

    def __init__(self) -> None:
        self._log: list[tuple[TargetTensor, Bits | None, Bits]] = []
        self.names: set[str] = set()

    def put(self, tensor: TargetTensor, c: Change) -> None:
        """Apply one decoded (or folded) change, remembering what it overwrote."""
        self.record(tensor, c.idx, tensor.apply(c))

    def record(self, tensor: TargetTensor, idx: Bits, old: Bits) -> None:
        """Remember that the bits at ``idx`` of ``tensor`` were ``old`` before a write."""
        self._log.append((tensor, idx, old))

    def load(self, tensor: TargetTensor, old: Bits, new: Bits) -> None:
        """Overwrite a whole tensor (``old`` is a copy of its current bits), remembering ``old``."""
        self._log.append((tensor, None, old))
        tensor.load(new)

    def extend(self, other: Undo) -> None:
        """Take over ``other``'s log (it is applied after this one's)."""
        log, names = other.drain()
        self._log.extend(log)
        self.names |= names

    def drain(self) -> tuple[list[tuple[TargetTensor, Bits | None, Bits]], set[str]]:
        """This log and its names, handed over: this undo is empty afterwards."""
        log, names = self._log, self.names
        self._log, self.names = [], set()
        return log, names

    def rollback(self) -> None:
        """Restore every element written, newest first."""
        for tensor, idx, old in reversed(self._log):
            if idx is None:
                tensor.load(old)
            else:
                tensor.put(idx, old)
        self._log.clear()
        self.names.clear()


#: a change of more positions than this is applied in parts of this many, on several threads at once
APPLY_CHUNK = 1 << 22


def _part(c: Change, a: int, b: int) -> Change:
    """Positions ``a:b`` of change ``c`` (views), as a change of the same kind."""
    if isinstance(c, Folded):
        return Folded(c.tensor, c.idx[a:b], c.values[a:b], None if c.is_raw is None else c.is_raw[a:b])
    return DecodedEntry(c.entry, c.idx[a:b], c.values[a:b], c.name)


def apply_changes(
    tensors: Mapping[str, TargetTensor], changes: Sequence[Change], undo: Undo, *, threads: int = 1
) -> None:
    """Apply a decoded (or folded) patch in place (tied names once), logging into ``undo``.

    With ``threads`` > 1 different tensors (and parts of a large change to a host tensor) are
    written at once (the compiled apply releases the GIL). Every write that happened is in
    ``undo`` even when another one raised.
    """
    alias = alias_groups(tensors)
    todo = [c for c in changes if alias[c.tensor] == c.tensor]
    # a large change is applied in parts of disjoint positions at once (a host tensor's compiled apply
    # releases the GIL), so one embedding does not hold up the step on one core
    parts: list[Change] = []
    for c in todo:
        n = int(c.idx.size)
        if threads > 1 and n > APPLY_CHUNK and isinstance(tensors[c.tensor], HostTensor):
            parts.extend(_part(c, a, min(n, a + APPLY_CHUNK)) for a in range(0, n, APPLY_CHUNK))
        else:
            parts.append(c)
    if threads <= 1 or len(parts) < 2:
        for c in todo:
            undo.put(tensors[c.tensor], c)
            undo.names.add(c.tensor)
        return
    with ThreadPoolExecutor(min(threads, len(parts)), thread_name_prefix="deltasync-apply") as pool:
        # in batches of about even size: a pool task per tensor costs more than a small tensor's write
        outcomes = map_batched(pool, lambda p: tensors[p.tensor].apply(p), parts, [int(p.idx.size) + 64 for p in parts])
    failed: BaseException | None = None
    for c, (old, err) in zip(parts, outcomes, strict=True):  # each part once: the log's order is free
        if err is not None or old is None:
            failed = failed or err or RuntimeError(f"{c.tensor!r}: the apply returned nothing")
            continue
        undo.record(tensors[c.tensor], c.idx, old)  # a part's positions with its old bits
        undo.names.add(c.tensor)
    if failed is not None:
        raise failed
