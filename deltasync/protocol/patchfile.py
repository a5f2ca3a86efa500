"""The layout of patch files (SPEC.md, "Patches"): entry names, metadata, building and checking them.

A patch step's data files are ``patch-{i:05d}.safetensors`` (``w{writer}/patch-{i:05d}.safetensors``,
in the writer's subfolder, when a writer names them as its own:
:func:`~deltasync.protocol.keys.writer_file_name`). Each holds, for every
changed tensor ``T`` it carries, two ``U8`` 1-D entries ``T/positions`` and
``T/values`` (the coded blobs), and ``__metadata__`` ``{"format": "deltasync-patch",
"step": "<step>"}``. The manifest's patch entries give the blobs' absolute byte
ranges; a reader checks that they are exactly the entries' data spans.

Writers call :func:`build_patch_files`; readers call :func:`check_patch_file` on
each downloaded file (or :func:`decode_patch` for the whole step), then
:func:`decode_patch_entry` per entry. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.errors import ProtocolError
from deltasync.protocol.checkpoint import group_by_size, shard_layout
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.encoding import EncodedTensor, decode_positions, decode_values
from deltasync.protocol.entries import PatchEntry, TensorInfo
from deltasync.protocol.keys import writer_file_name
from deltasync.protocol.manifest import Manifest
from deltasync.protocol.safetensors_io import StFile, TensorBytes, parse_safetensors, to_bytes

__all__ = [
    "PATCH_FORMAT",
    "DecodedEntry",
    "DecodedGroup",
    "build_patch_file",
    "build_patch_files",
    "check_patch_file",
    "decode_patch",
    "decode_patch_entry",
    "decode_patch_groups",
    "group_bounds",
    "inventory_sizes",
    "patch_entry_names",
    "patch_file_name",
    "patch_metadata",
    "split_group",
]

PATCH_FORMAT = "deltasync-patch"
Ints = np.ndarray[Any, np.dtype[Any]]


def patch_file_name(index: int) -> str:
    """``patch-{index:05d}.safetensors``: the name of a step's ``index``-th patch file (from 0)."""
    return f"patch-{index:05d}.safetensors"


def patch_metadata(step: int) -> dict[str, str]:
    """The ``__metadata__`` of every patch file of ``step``."""
    return {"format": PATCH_FORMAT, "step": str(step)}


def patch_entry_names(tensor: str) -> tuple[str, str]:
    """Safetensors entry names of ``tensor``'s position blob and value blob in a patch file."""
    return f"{tensor}/positions", f"{tensor}/values"


#: what a patch file carries one coded change of: a tensor's name, or (format 2) a group's names
Coded = str | tuple[str, ...]


def _names(what: Coded) -> tuple[str, tuple[str, ...]]:
    """(the name of the blobs: the first tensor's, the group's members: () for one tensor)."""
    if isinstance(what, str):
        return what, ()
    return what[0], (what if len(what) > 1 else ())


def build_patch_file(
    step: int, file_name: str, items: Sequence[tuple[Coded, EncodedTensor]]
) -> tuple[bytes, list[PatchEntry]]:
    """One patch file holding ``items`` (tensor name or group of names, coded change) in that order,
    and their entries. A group's blobs are named after its first tensor."""
    meta = patch_metadata(step)
    shard: list[TensorBytes] = []
    for what, e in items:
        pos_name, val_name = patch_entry_names(_names(what)[0])
        shard.append(TensorBytes(pos_name, "U8", (len(e.pos_blob),), e.pos_blob))
        shard.append(TensorBytes(val_name, "U8", (len(e.val_blob),), e.val_blob))
    ranges = shard_layout(shard, meta)
    entries = []
    for what, e in items:
        name, members = _names(what)
        pos_name, val_name = patch_entry_names(name)
        entries.append(
            PatchEntry(
                name, file_name, e.count, e.positions, e.rice_k, e.values, ranges[pos_name], ranges[val_name], members
            )
        )
    return to_bytes(shard, meta), entries


def build_patch_files(
    step: int, items: Sequence[tuple[Coded, EncodedTensor]], shard_bytes: int, *, writer_id: str | None = None
) -> tuple[dict[str, bytes], list[PatchEntry]]:
    """Pack coded changes into ``patch-NNNNN.safetensors`` files of about ``shard_bytes`` each.

    Items stay in the given order; a tensor's two blobs always share a file. Returns
    the files by name and the manifest's patch entries. With ``writer_id`` the files are
    that writer's own: ``w{writer_id}/patch-NNNNN.safetensors``.
    """
    files: dict[str, bytes] = {}
    entries: list[PatchEntry] = []
    # no items still makes one (empty) file: a patch step has at least one file
    for i, group in enumerate(group_by_size([e.nbytes for _, e in items], shard_bytes)):
        fname = patch_file_name(i) if writer_id is None else writer_file_name(writer_id, patch_file_name(i))
        files[fname], ents = build_patch_file(step, fname, [items[j] for j in group])
        entries.extend(ents)
    return files, entries


def check_patch_file(m: Manifest, file_name: str, data: bytes | bytearray | memoryview) -> StFile:
    """Parse one downloaded patch file of ``m`` and check its layout against the manifest.

    The file must be a valid safetensors file with the patch metadata of ``m.step``
    whose entries are exactly the ``T/positions`` and ``T/values`` pairs of the
    patch entries naming this file, ``U8`` and 1-D, spanning exactly the entries'
    ranges. Anything else is a ProtocolError.
    """
    what = f"step {m.step} {file_name}"
    st = parse_safetensors(data, what=what)
    if dict(st.metadata) != patch_metadata(m.step):
        raise ProtocolError(f"{what}: patch file metadata {dict(st.metadata)!r} is not {patch_metadata(m.step)!r}")
    expected: dict[str, tuple[int, int]] = {}
    for e in m.entries:
        if isinstance(e, PatchEntry) and e.file == file_name:
            pos_name, val_name = patch_entry_names(e.tensor)
            expected[pos_name] = (e.positions_range.start, e.positions_range.end)
            expected[val_name] = (e.values_range.start, e.values_range.end)
    if set(st.entries) != set(expected):
        extra = sorted(set(st.entries) - set(expected))[:3]
        missing = sorted(set(expected) - set(st.entries))[:3]
        raise ProtocolError(f"{what}: entries do not match the manifest (missing {missing}, unexpected {extra})")
    for name, ent in st.entries.items():
        if ent.dtype != "U8" or len(ent.shape) != 1 or (ent.start, ent.end) != expected[name]:
            raise ProtocolError(f"{what}: entry {name!r} is not the U8 blob at the range the manifest gives")
    return st


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    """One tensor's decoded change: sorted flat positions and the value stream to combine with old bits.

    ``name``: the tensor, where the entry codes a group (format 2) and this is one member's share
    (positions local to the member); None: the entry's own tensor."""

    entry: PatchEntry
    idx: Ints
    values: Ints
    name: str | None = None

    @property
    def tensor(self) -> str:
        """The tensor's name."""
        return self.name if self.name is not None else self.entry.tensor

    @property
    def coding(self) -> str:
        """The value coding (``xor-rank``: XOR onto old bits; ``raw``: new bits)."""
        return self.entry.values


def decode_patch_entry(
    m: Manifest,
    entry: PatchEntry,
    data: bytes | bytearray | memoryview,
    info: TensorInfo | None = None,
    *,
    numel: int | None = None,
) -> DecodedEntry:
    """Decode one patch entry of ``m`` from its (already checked) file's bytes.

    Allocations are bounded by ``entry.count`` and the tensor's ``numel``, which
    :meth:`Manifest.from_json` checked against each other. ``numel``: the element count the entry
    codes (a group's: its members' together), when the caller has it at hand.
    """
    if info is None:
        found = [t for t in m.inventory if t.name == entry.tensor]
        if not found:
            raise ProtocolError(f"step {m.step}: patch entry {entry.tensor!r} is not in the inventory")
        info = found[0]
    if numel is None:
        numel = info.numel
        if entry.members:
            inv = {t.name: t for t in m.inventory}
            numel = sum(inv[n].numel for n in entry.members)
    mv = memoryview(data).cast("B")
    for r in (entry.positions_range, entry.values_range):
        if r.end > len(mv):
            raise ProtocolError(f"step {m.step}: patch entry {entry.tensor!r} points past the end of {entry.file}")
    what = f"step {m.step} tensor {entry.tensor!r}"
    idx = decode_positions(
        mv[entry.positions_range.start : entry.positions_range.end],
        entry.positions,
        entry.rice_k,
        entry.count,
        numel,
        what,
    )
    vals = decode_values(
        mv[entry.values_range.start : entry.values_range.end],
        entry.values,
        entry.count,
        dtype_info(info.dtype).bits,
        what,
    )
    return DecodedEntry(entry, idx, vals)


@dataclass(frozen=True, slots=True)
class DecodedGroup:
    """A group entry's decoded change (format 2), kept whole: sorted positions into the concatenation
    of ``entry.members``' flat elements, the value stream, and ``bounds``: the members' cumulative
    element counts (``bounds[i]:bounds[i + 1]`` are member ``i``'s positions; int64, from 0)."""

    entry: PatchEntry
    idx: Ints
    values: Ints
    bounds: Ints

    @property
    def members(self) -> tuple[str, ...]:
        """The tensors, in the order of their elements."""
        return self.entry.members

    @property
    def coding(self) -> str:
        """The value coding (``xor-rank``: XOR onto old bits; ``raw``: new bits)."""
        return self.entry.values

    def split(self) -> list[DecodedEntry]:
        """One change per member, positions local to it (see :func:`split_group`)."""
        return split_group(DecodedEntry(self.entry, self.idx, self.values), bounds=self.bounds)


#: the newest inventory's (name -> index, element counts): a run's steps share one inventory object
_SIZES: list[tuple[tuple[TensorInfo, ...], dict[str, int], Ints]] = []


def inventory_sizes(inventory: tuple[TensorInfo, ...]) -> tuple[dict[str, int], Ints]:
    """(name -> index, int64 element count per index) of ``inventory`` (the last one asked is kept:
    every step of a run carries the very same inventory tuple)."""
    for inv, index, numels in _SIZES[-1:]:
        if inv is inventory:
            return index, numels
    index = {t.name: i for i, t in enumerate(inventory)}
    numels = np.fromiter((t.numel for t in inventory), dtype=np.int64, count=len(inventory))
    _SIZES[:] = [(inventory, index, numels)]  # one slot, replaced whole (a reader in another thread sees either)
    return index, numels


#: the bounds of the newest inventory's groups by members (a run's groups recur step after step)
_BOUNDS: list[tuple[dict[str, int], dict[tuple[str, ...], Ints]]] = []
#: groups whose bounds are kept (for one inventory; a writer's grouping of it is a few thousand at most)
_BOUNDS_KEPT = 8192


def group_bounds(entry: PatchEntry, index: Mapping[str, int], numels: Ints) -> Ints:
    """A group entry's members' cumulative element counts, from 0 (see :class:`DecodedGroup`), kept
    for the same members of the same inventory (``index``, from :func:`inventory_sizes`): shared,
    never to be written (writeable only because the compiled kernels take plain arrays)."""
    kept = _BOUNDS[-1][1] if _BOUNDS and _BOUNDS[-1][0] is index else None
    if kept is not None and (hit := kept.get(entry.members)) is not None:
        return hit
    bounds = np.zeros(len(entry.members) + 1, dtype=np.int64)
    np.cumsum(numels[[index[n] for n in entry.members]], out=bounds[1:])
    if isinstance(index, dict):
        if kept is None or len(kept) >= _BOUNDS_KEPT:
            kept = {}
            _BOUNDS[:] = [(index, kept)]  # one slot, replaced whole (a reader in another thread sees either)
        kept[entry.members] = bounds
    return bounds


def decode_patch_groups(
    m: Manifest,
    files: Mapping[str, bytes | bytearray | memoryview],
    *,
    mapper: Callable[[Callable[[PatchEntry], DecodedEntry], Sequence[PatchEntry]], Iterable[DecodedEntry]] = map,
) -> list[DecodedEntry | DecodedGroup]:
    """:func:`decode_patch`, but each group entry (format 2) as one :class:`DecodedGroup` (not split
    per member): the same checks, the same errors."""
    if m.kind != "patch":
        raise ProtocolError(f"step {m.step} is an {m.kind}, not a patch")
    for f in m.files:
        if f.path not in files:
            raise ProtocolError(f"step {m.step}: file {f.path} was not downloaded")
        check_patch_file(m, f.path, files[f.path])
    index, numels = inventory_sizes(m.inventory)
    inventory = m.inventory
    entries: list[PatchEntry] = []
    bounds: dict[int, Ints] = {}
    for e in m.entries:
        if not isinstance(e, PatchEntry):
            raise ProtocolError(f"step {m.step}: a patch lists an anchor entry for {e.tensor!r}")
        if e.members:
            bounds[len(entries)] = group_bounds(e, index, numels)
        entries.append(e)
    at = {e.tensor: k for k, e in enumerate(entries)}  # a tensor is in one entry (checked by the parse)

    def one(e: PatchEntry) -> DecodedEntry:
        b = bounds.get(at[e.tensor])
        numel = int(b[-1]) if b is not None else int(numels[index[e.tensor]])
        return decode_patch_entry(m, e, files[e.file], inventory[index[e.tensor]], numel=numel)

    out: list[DecodedEntry | DecodedGroup] = []
    for k, d in enumerate(mapper(one, entries)):
        b = bounds.get(k)
        out.append(d if b is None else DecodedGroup(d.entry, d.idx, d.values, b))
    return out


def decode_patch(
    m: Manifest,
    files: Mapping[str, bytes | bytearray | memoryview],
    *,
    mapper: Callable[[Callable[[PatchEntry], DecodedEntry], Sequence[PatchEntry]], Iterable[DecodedEntry]] = map,
) -> list[DecodedEntry]:
    """Check every patch file of ``m`` (:func:`check_patch_file`) and decode every entry.

    ``files`` maps each file the manifest lists to its downloaded bytes (sizes
    and digests already checked). Nothing is applied; errors are ProtocolErrors.
    ``mapper`` runs the decode of each entry (``map``; a thread pool's ``map`` to decode tensors in
    parallel, as the fetcher does: the compiled decoders release the GIL); it must keep the entries'
    order and raise the first failing entry's error. This module starts no threads. A group entry
    (format 2) comes out as one change per member (:func:`decode_patch_groups` keeps it whole).
    """
    out: list[DecodedEntry] = []
    for d in decode_patch_groups(m, files, mapper=mapper):
        if isinstance(d, DecodedGroup):
            out.extend(d.split())
        else:
            out.append(d)
    return out


def split_group(
    d: DecodedEntry, numels: Sequence[int] | None = None, *, bounds: Ints | None = None
) -> list[DecodedEntry]:
    """A group's decoded change as one change per member, positions local to it (views of one
    array of local positions); a member no position falls in gets an empty change (still proven).
    ``numels``: the members' element counts, or ``bounds`` their cumulative counts from 0."""
    if bounds is None:
        assert numels is not None
        bounds = np.zeros(len(numels) + 1, dtype=np.int64)
        np.cumsum(numels, out=bounds[1:])
    cuts = np.searchsorted(d.idx, bounds)
    # every position less its member's offset, in one pass: the members' shares are views of it
    local = d.idx - np.repeat(bounds[:-1], np.diff(cuts))
    vals, entry = d.values, d.entry
    c = cuts.tolist()
    return [
        DecodedEntry(entry, local[a:b], vals[a:b], name) for name, a, b in zip(entry.members, c, c[1:], strict=False)
    ]
