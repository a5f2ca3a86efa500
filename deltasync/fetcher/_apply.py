"""Applying decoded steps to a target's tensors, all or nothing: the checks before, the writes, the undo log."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from deltasync._util.batches import map_batched
from deltasync._util.cpus import parallel_map
from deltasync.errors import ChecksumMismatch, InventoryMismatch, ProtocolError
from deltasync.fetcher._fold import Change, Folded, StepChange, new_bits, per_tensor, touched
from deltasync.fetcher._target import HostTensor, TargetTensor, TensorViews, digest_words, positions_in
from deltasync.protocol import DecodedEntry, Manifest, TensorInfo, kernels
from deltasync.protocol.digests import hex_words, tensor_digests, words_hex
from deltasync.protocol.manifest_v2 import DigestTable
from deltasync.protocol.patchfile import DecodedGroup

__all__ = [
    "HostGroup",
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
    for a, b in _SAME_INVENTORY:
        if a is have and b is m.inventory:  # these very tuples (immutable) were found equal before
            return
    if tuple(have) == m.inventory:
        if isinstance(have, tuple):
            _SAME_INVENTORY[:] = [(have, m.inventory)]
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


#: the last (target inventory, manifest inventory) found equal: a run's steps share one inventory
#: tuple, and a target's views keep theirs while nothing changed
_SAME_INVENTORY: list[tuple[tuple[TensorInfo, ...], tuple[TensorInfo, ...]]] = []


def alias_groups(tensors: Mapping[str, TargetTensor]) -> dict[str, str]:
    """Map each name to the first name (sorted) sharing its memory: tied weights are applied once.
    (Computed once per :class:`TensorViews`, which are read-only; do not modify the result.)"""
    if isinstance(tensors, TensorViews):
        return tensors.aliases()
    first: dict[Any, str] = {}
    out: dict[str, str] = {}
    for name in sorted(tensors):
        out[name] = first.setdefault(tensors[name].key, name)
    return out


def changed_names(m: Manifest, parent: Manifest | None, changes: Sequence[StepChange]) -> list[str]:
    """Tensors that step ``m`` changes: those it has entries for, plus every tensor whose digest
    differs from its parent's (a tensor the manifest says changed but whose entry is missing is
    still proven). Without the parent's digests every digested tensor counts; so does a large tensor
    under a parent of another format, whose digest is defined otherwise (SPEC "Digests")."""
    digests = m.tensor_digests
    if parent is None:
        out = list(digests)
    elif isinstance(digests, DigestTable) and _same_facts(digests, parent.tensor_digests):
        out = _differing(digests, cast(DigestTable, parent.tensor_digests))
    else:
        before = parent.tensor_digests
        out = [n for n, d in digests.items() if before.get(n) != d]
    if isinstance(digests, DigestTable) and len(out) == len(digests.facts.names):
        out.sort()  # every tensor of the inventory (distinct names): no change can name another
        return out
    listed = set(out)
    if listed.issuperset(touched(changes)):
        extra: set[str] = set()  # every tensor with an entry changed its digest (the usual step): one C pass
    else:
        extra = set(touched(changes))
        extra.difference_update(listed)
    if extra:
        return sorted(listed | extra)
    out.sort()  # a writer's digests come in inventory order, sorted by name: one pass
    return out


def _same_facts(a: DigestTable, b: Mapping[str, str]) -> bool:
    """Whether two steps' digests were read against the very same inventory."""
    return isinstance(b, DigestTable) and a.facts is b.facts


def _differing(digests: DigestTable, before: DigestTable) -> list[str]:
    """The names whose digest in ``digests`` is not the one in ``before`` (or is not there), in
    inventory order: one compare of their words, row by row."""
    pos = digests.positions()
    names = digests.facts.names
    if len(digests) == len(before) == len(names):  # both digest every tensor: row i is tensor i
        differ = (before.words() != digests.words()).any(axis=1)
        return list(map(names.__getitem__, np.flatnonzero(differ).tolist()))
    rows = before.rows()[pos]
    differ = rows < 0
    have = ~differ
    differ[have] = (before.words()[rows[have]] != digests.words()[have]).any(axis=1)
    return list(map(names.__getitem__, pos[differ].tolist()))


def _wanted(digests: Mapping[str, str], names: Sequence[str]) -> tuple[Sequence[str], np.ndarray[Any, Any] | None]:
    """(the names that have a digest, their digests as words), or the words None where a digest is
    not one (compared as text then)."""
    if isinstance(digests, DigestTable):
        try:
            at = positions_in(digests.facts.index, names, digests.facts.memo)
        except KeyError:  # a name the step's inventory does not hold
            pass
        else:
            rows = digests.rows()[at]
            keep = rows >= 0
            named = names if keep.all() else [names[i] for i in np.flatnonzero(keep).tolist()]
            return named, digests.words()[rows[keep]]
    named = [n for n in names if n in digests]
    try:
        return named, hex_words([digests[n] for n in named])
    except ValueError:
        return named, None


def check_digests(tensors: Mapping[str, TargetTensor], names: Sequence[str], m: Manifest, *, threads: int = 1) -> None:
    """Raise ChecksumMismatch unless each named tensor equals step ``m``'s digest of it (in ``m``'s
    format), hashed on up to ``threads`` threads at once."""
    digests = m.tensor_digests
    named, want = _wanted(digests, names)
    got = digest_words(tensors, named, m.format_version, threads=threads)
    if want is not None:
        bad = np.flatnonzero((got != want).any(axis=1))
    else:  # a digest that is not one (a parsed manifest's are): compared as text
        text = [digests[n] for n in named]
        bad = np.flatnonzero(np.array(words_hex(got), dtype=object) != np.array(text, dtype=object))
    if bad.size:
        name = named[int(bad[0])]
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


def check_aliases(tensors: Mapping[str, TargetTensor], m: Manifest, changes: Sequence[StepChange]) -> None:
    """Tied tensors (one memory, several names) must receive changes with the same effect on the
    target's current bits (the writer may have coded them differently)."""
    if isinstance(tensors, TensorViews) and not tensors.tied():
        return  # nothing tied
    alias = alias_groups(tensors)
    if all(primary == name for name, primary in alias.items()):
        return  # nothing tied
    by_name = {c.tensor: c for c in per_tensor(changes)}
    for name, primary in alias.items():
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


class HostGroup:
    """The members of a format-2 group as one target: host tensors, flat and C-contiguous, as wide as
    the group's values, written in place by one compiled call (:func:`host_group` builds one)."""

    def __init__(
        self, members: Sequence[TargetTensor], addrs: Bits, bounds: Bits, kern: Any, order: Bits | None = None
    ) -> None:
        self.members = members  # holds their arrays (the memory written through ``addrs``)
        self.addrs = addrs
        self.bounds = bounds
        self.kern = kern  # the compiled kernels (a rollback uses them whatever the backend is by then)
        #: the members by address when that is not their order (written so, memory walked forwards)
        self.order = order

    def apply(self, g: DecodedGroup) -> Bits:
        """Apply the group's change in place; returns the bits it overwrote (for the undo log).
        Positions outside the members or not ascending raise ProtocolError, nothing written."""
        kern = self.kern
        idx = g.idx
        old: Bits = np.empty(idx.size, dtype=g.values.dtype)
        mode = 0 if g.coding == "xor-rank" else 1
        # members named out of address order (a model's tensors sorted by name) are written in address
        # order, all positions checked first (-2: a bad one, nothing written; the plain pass finds it)
        if (
            self.order is not None
            and kern.group_apply_ordered(self.addrs, self.bounds, idx, g.values, old, mode, self.order) == idx.size
        ):
            return old
        done = kern.group_apply(self.addrs, self.bounds, idx, g.values, old, mode)
        if done != idx.size:
            if done > 0:  # the positions before the bad one were written: put them back
                kern.group_apply(self.addrs, self.bounds, idx[:done], old[:done], old[:done], 2)
            raise ProtocolError(
                f"group {g.entry.tensor!r}: positions outside its {int(self.bounds[-1])} elements or not ascending"
            )
        return old

    def put(self, idx: Bits, vals: Bits) -> None:
        """Write bits at positions ``idx`` of the members' concatenation (a rollback)."""
        if self.kern.group_apply(self.addrs, self.bounds, idx, vals, vals, 2) != idx.size:
            raise ProtocolError(f"positions outside a group of {int(self.bounds[-1])} elements")


#: the most groups' members a :class:`TensorViews` remembers (steps that change other tensors each
#: time make other groups)
GROUP_MEMO = 4096


def host_group(tensors: Mapping[str, TargetTensor], g: DecodedGroup, alias: Mapping[str, str]) -> HostGroup | None:
    """``g``'s members as one :class:`HostGroup`, or None where the plain case does not hold and the
    group is applied member by member: no compiled kernels, a coding other than one step's, a member
    tied to another name (applied through that one), a member that is not a flat C-contiguous writable
    host array of the group's width and size (an accelerator's tensor, say). What only depends on the
    target is kept with read-only views (:class:`TensorViews`) for the next step's same group."""
    kern = kernels.impl()
    if kern is None or g.coding not in ("xor-rank", "raw") or g.idx.dtype != np.int64:
        return None
    members = g.entry.members
    memo = tensors.memo if isinstance(tensors, TensorViews) else None
    found: Any = memo.get(members, False) if memo is not None else False
    if found is False:
        found = _members(tensors, members, alias)
        if memo is not None:
            if len(memo) >= GROUP_MEMO:
                memo.clear()
            memo[members] = found
    if found is None:
        return None
    targets, addrs, sizes, itemsize, order = found
    if itemsize != g.values.dtype.itemsize or not np.array_equal(sizes, np.diff(g.bounds)):
        return None
    return HostGroup(targets, addrs, g.bounds, kern, order)


def _members(
    tensors: Mapping[str, TargetTensor], members: tuple[str, ...], alias: Mapping[str, str]
) -> tuple[list[TargetTensor], Bits, Bits, int, Bits | None] | None:
    """(the members' tensors, their addresses, sizes, the common itemsize (-1: several), their order
    by address or None when that is theirs) when they are all untied flat C-contiguous writable host
    arrays; None otherwise."""
    try:
        if any(alias[n] != n for n in members):
            return None
        targets = [tensors[n] for n in members]
    except KeyError:
        return None
    layouts = [t.layout for t in targets]
    if None in layouts:
        return None
    lay = np.array(layouts, dtype=np.int64).reshape(len(members), 3)
    widths = np.unique(lay[:, 2])
    itemsize = int(widths[0]) if widths.size == 1 else -1
    addrs = np.ascontiguousarray(lay[:, 0])
    order = np.argsort(addrs, kind="stable") if bool((addrs[1:] < addrs[:-1]).any()) else None
    return targets, addrs, np.ascontiguousarray(lay[:, 1]), itemsize, order


#: what the undo log restores: a tensor, or a group's members together
Written = TargetTensor | HostGroup


class Undo:
    """Old bits of every element written, so a whole plan can be rolled back; ``names`` are the tensors written."""

    def __init__(self) -> None:
        self._log: list[tuple[Written, Bits | None, Bits]] = []
        self.names: set[str] = set()

    def put(self, tensor: TargetTensor, c: Change) -> None:
        """Apply one decoded (or folded) change, remembering what it overwrote."""
        self.record(tensor, c.idx, tensor.apply(c))

    def record(self, tensor: Written, idx: Bits, old: Bits) -> None:
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

    def drain(self) -> tuple[list[tuple[Written, Bits | None, Bits]], set[str]]:
        """This log and its names, handed over: this undo is empty afterwards."""
        log, names = self._log, self.names
        self._log, self.names = [], set()
        return log, names

    def rollback(self) -> None:
        """Restore every element written, newest first."""
        for tensor, idx, old in reversed(self._log):
            if idx is None:  # a whole tensor (only :meth:`load` logs one; a group is written at positions)
                assert isinstance(tensor, TargetTensor)
                tensor.load(old)
            else:
                tensor.put(idx, old)
        self._log.clear()
        self.names.clear()


#: a change of more positions than this is applied in parts of this many, on several threads at once
APPLY_CHUNK = 1 << 22
#: changes of at most this many positions in all are applied on the calling thread: a pool's threads
#: cost more to start than their writes
INLINE_POSITIONS = 1 << 16


def _part(c: Change, a: int, b: int) -> Change:
    """Positions ``a:b`` of change ``c`` (views), as a change of the same kind."""
    if isinstance(c, Folded):
        return Folded(c.tensor, c.idx[a:b], c.values[a:b], None if c.is_raw is None else c.is_raw[a:b])
    return DecodedEntry(c.entry, c.idx[a:b], c.values[a:b], c.name)


def apply_changes(
    tensors: Mapping[str, TargetTensor], changes: Sequence[StepChange], undo: Undo, *, threads: int = 1
) -> None:
    """Apply a decoded (or folded) patch in place (tied names once), logging into ``undo``.

    A format-2 group is applied to all its members by one compiled call where it can
    (:func:`host_group`), member by member otherwise. With ``threads`` > 1 different tensors and
    groups (and parts of a large change to a host tensor) are written at once (the compiled apply
    releases the GIL). Every write that happened is in ``undo`` even when another one raised.
    """
    alias = alias_groups(tensors)
    # (what is written, the change, the names it writes)
    jobs: list[tuple[Written, StepChange, tuple[str, ...]]] = []
    for c in changes:
        if isinstance(c, DecodedGroup):
            group = host_group(tensors, c, alias)
            if group is not None:
                jobs.append((group, c, c.entry.members))
                continue
            shares: Sequence[Change] = c.split()
        else:
            shares = (c,)
        for d in shares:
            if alias[d.tensor] != d.tensor:
                continue
            t, n = tensors[d.tensor], int(d.idx.size)
            # a large change is applied in parts of disjoint positions at once (a host tensor's compiled
            # apply releases the GIL), so one embedding does not hold up the step on one core
            if threads > 1 and n > APPLY_CHUNK and isinstance(t, HostTensor):
                jobs.extend((t, _part(d, a, min(n, a + APPLY_CHUNK)), (d.tensor,)) for a in range(0, n, APPLY_CHUNK))
            else:
                jobs.append((t, d, (d.tensor,)))
    if threads <= 1 or len(jobs) < 2 or sum(int(j[1].idx.size) for j in jobs) <= INLINE_POSITIONS:
        for target, c, names in jobs:
            undo.record(target, c.idx, _apply_one(target, c))
            undo.names.update(names)
        return
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="deltasync-apply") as pool:
        # in batches of about even size: a pool task per tensor costs more than a small tensor's write
        outcomes = map_batched(pool, lambda j: _apply_one(j[0], j[1]), jobs, [int(j[1].idx.size) + 64 for j in jobs])
    failed: BaseException | None = None
    for (target, c, names), (old, err) in zip(jobs, outcomes, strict=True):  # each part once: the log's order is free
        if err is not None or old is None:
            failed = failed or err or RuntimeError(f"{names[0]!r}: the apply returned nothing")
            continue
        undo.record(target, c.idx, old)  # a part's positions with its old bits
        undo.names.update(names)
    if failed is not None:
        raise failed


def _apply_one(target: Written, c: StepChange) -> Bits:
    """Apply ``c`` to ``target`` (a group to its :class:`HostGroup`); the bits it overwrote."""
    if isinstance(target, HostGroup):
        assert isinstance(c, DecodedGroup)
        return target.apply(c)
    assert not isinstance(c, DecodedGroup)
    return target.apply(c)
