"""A node mirror's versions: what a version is (its tensors' places in the node's data files, the
positions of what its step changed), its index document, and its tensors mapped.

See :mod:`deltasync.serving.node.store` for the folder they live in and
:mod:`deltasync.serving.node.datafiles` for reading and writing the data files.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync.errors import UnsafePath
from deltasync.protocol import TensorChange
from deltasync.serving.node.datafiles import (  # populate: re-exported
    Carver,
    map_file,
    populate,
)

if TYPE_CHECKING:
    import mmap

    import torch

__all__ = [
    "INDEX_FORMAT",
    "PACK_ALIGN",
    "POSITIONS_ALIGN",
    "PositionsRef",
    "Version",
    "VersionFile",
    "changed_positions",
    "checked_file_name",
    "checked_version_id",
    "populate",
    "step_id",
    "trim_heap",
]

#: the ``format`` a version's index is written with: 2 names a tensor by (file, offset) in a pack file
#: (format 1: one file per tensor, read as offset 0). A node folder holds one format (see ``run_key``)
INDEX_FORMAT = 2
#: a tensor in a pack starts at a multiple of this (a page: CUDA registers each tensor's own pages,
#: and a page shared by two tensors could not be registered twice)
PACK_ALIGN = 4096
#: positions in a pack start at a multiple of this (a cache line)
POSITIONS_ALIGN = 64
#: the only data file names a node writes (24 random hex digits; ``.pack``/``.pos``, format 1's
#: ``.bin``/``.i32``/``.i64``) and version ids (:func:`step_id`; a seed's ``seed-<16 hex>``): an index
#: naming anything else (``/``, ``..``, a leading dot) is refused before a name is joined to a folder
_DATA_FILE = re.compile(r"[0-9a-f]{24}\.(?:pack|pos|bin|i32|i64)")
_VERSION_ID = re.compile(r"[0-9]{12,20}|seed-[0-9a-f]{16}")

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize
    return size


@dataclass(frozen=True, slots=True)
class VersionFile:
    """One tensor of a version: the data file that holds its raw bytes from ``offset`` on (a pack file
    holds the tensors one build wrote), its dtype (a torch dtype's name without ``torch.``) and its
    shape. Versions that share a tensor name the same file and offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @classmethod
    def of(cls, name: str, tensor: Any, offset: int = 0) -> VersionFile:
        """The entry of ``tensor``, written to the data file ``name`` at ``offset``."""
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset)

    def holds_layout_of(self, tensor: Any) -> bool:
        """Whether ``tensor`` has this entry's dtype and shape."""
        return str(tensor.dtype).removeprefix("torch.") == self.dtype and tuple(tensor.shape) == self.shape

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * _itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        """The index's form: ``[file, dtype, shape, offset]``."""
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_json(cls, doc: Any) -> VersionFile:
        """An entry read back from an index (see :meth:`to_json`; format 1 has no offset)."""
        name, dtype, shape, *rest = doc
        offset = int(rest[0]) if rest else 0
        if len(rest) > 1 or offset < 0:
            raise ValueError(f"not a tensor entry: {doc!r}")
        return cls(checked_file_name(name), str(dtype), tuple(map(int, shape)), offset)


@dataclass(frozen=True, slots=True)
class PositionsRef:
    """Where a tensor's changed flat positions (sorted) lie: ``count`` integers of ``width`` bytes
    (4: int32, 8: int64) from ``offset`` in data file ``file``. Format 1 named a whole file of them
    (``count`` -1: as many as the file holds; the width from its ``.i32``/``.i64`` suffix)."""

    file: str
    offset: int
    count: int
    width: int

    def to_json(self) -> list[Any]:
        return [self.file, self.offset, self.count, self.width]

    @classmethod
    def from_json(cls, doc: Any) -> PositionsRef:
        if isinstance(doc, str):  # format 1
            return cls(checked_file_name(doc), 0, -1, 4 if doc.endswith(".i32") else 8)
        file, offset, count, width = doc
        if width not in (4, 8) or int(offset) < 0 or int(count) < 0:
            raise ValueError(f"not a positions entry: {doc!r}")
        return cls(checked_file_name(file), int(offset), int(count), int(width))


@dataclass(frozen=True)
class Version:
    """One complete version of a run's tensors in a node mirror (immutable).

    ``step``: the deltasync step (None for an engine's own checkpoint of unknown step);
    ``files``: checkpoint name -> its :class:`VersionFile`; ``stats``: what building it cost.
    """

    id: str
    step: int | None
    files: Mapping[str, VersionFile]
    data: Path
    stats: Mapping[str, Any] = field(default_factory=dict)
    #: the digest of the step's manifest when built (a run re-created at the same URL does not match)
    digest: str | None = None
    #: the version this one was built from, and for each tensor that changed sparsely since, where its
    #: changed flat positions lie (sorted; int32 or int64)
    base: str | None = None
    positions: Mapping[str, PositionsRef] = field(default_factory=dict)
    #: tensors this version holds with the very bits of the entry given, at another place: moved into
    #: the build's pack (a compaction) without changing (not changed since a version naming that entry)
    moved: Mapping[str, VersionFile] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """The version's index document (``versions/<id>.json``; the data folder is where it lies)."""
        return {
            "format": INDEX_FORMAT,
            "id": self.id,
            "step": self.step,
            "digest": self.digest,
            "files": {n: f.to_json() for n, f in self.files.items()},
            "stats": dict(self.stats),
            "base": self.base,
            "positions": {n: p.to_json() for n, p in self.positions.items()},
            "moved": {n: f.to_json() for n, f in self.moved.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], data: Path) -> Version:
        """A version read back from its index (see :meth:`to_json`), its files in ``data``; an id or a
        file name the node does not write is refused (:class:`~deltasync.errors.UnsafePath`)."""
        return cls(
            checked_version_id(doc["id"]),
            doc["step"],
            {n: VersionFile.from_json(f) for n, f in doc["files"].items()},
            data,
            doc.get("stats", {}),
            doc.get("digest"),
            doc.get("base"),
            {n: PositionsRef.from_json(p) for n, p in doc.get("positions", {}).items()},
            {n: VersionFile.from_json(f) for n, f in doc.get("moved", {}).items()},
        )

    def changes(self, served: Version | None, names: Iterable[str] | None = None) -> dict[str, TensorChange]:
        """What changed since ``served``, for ``names`` (default: :meth:`changed_from`): one
        :class:`~deltasync.protocol.TensorChange` per name, with the flat positions (sorted; int32 or
        int64 numpy arrays mapped from the node's positions files) of the tensors changed sparsely
        since ``served`` when this version was built straight from it, and ``positions`` None (the
        whole tensor) for the others."""
        import mmap

        known = self.base is not None and served is not None and self.base == served.id
        out: dict[str, TensorChange] = {}
        maps: dict[str, mmap.mmap] = {}
        for name in self.changed_from(served) if names is None else names:
            ref = self.positions.get(name) if known else None
            if ref is None:
                out[name] = TensorChange(name)
                continue
            mm = maps.get(ref.file)
            if mm is None:
                with open(self.data / ref.file, "rb") as fh:  # private: the arrays are writable, the file is not
                    mm = maps[ref.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            count = (len(mm) - ref.offset) // ref.width if ref.count < 0 else ref.count
            dtype = np.int32 if ref.width == 4 else np.int64
            out[name] = TensorChange(name, np.frombuffer(mm, dtype=dtype, count=count, offset=ref.offset))
        return out

    def changed_from(self, other: Version | None) -> list[str]:
        """The names whose bits may differ from ``other`` (all of them when ``other`` is None): not a
        tensor at the same place, nor one moved here from the place ``other`` names."""
        if other is None:
            return sorted(self.files)
        theirs, moved = other.files, self.moved
        return sorted(
            n for n, f in self.files.items() if (o := theirs.get(n)) != f and (o is None or moved.get(n) != o)
        )

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        reuse: Mapping[tuple[str, int], Any] | None = None,
        read_only: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The tensors, mapped from the node's files: copy-on-write (a write stays private), or with
        ``read_only`` shared and write-protected (see :func:`~deltasync.serving.node.datafiles.map_file`). ``reuse``: tensors already
        mapped, by data file name (another version's that shares files)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        data = str(self.data)  # joined as strings: a Path per file costs more than the mapping at 18k files
        wanted = list(self.files) if names is None else list(names)
        extent: dict[str, int] = {}  # bytes of each file to map: up to the end of its last tensor wanted
        for name in wanted:
            entry = self.files[name]
            end = entry.offset + entry.nbytes
            if end > extent.get(entry.name, 0):
                extent[entry.name] = end
        carvers: dict[str, Carver] = {}
        for name in wanted:
            entry = self.files[name]
            have = None if reuse is None else reuse.get((entry.name, entry.offset))
            if have is not None and entry.holds_layout_of(have):
                out[name] = have
                continue
            if entry.nbytes == 0:
                out[name] = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
                continue
            carver = carvers.get(entry.name)
            if carver is None:
                path = os.path.join(data, entry.name)
                carver = carvers[entry.name] = Carver(map_file(torch, path, extent[entry.name], read_only))
            out[name] = carver(entry)
        return out

    def by_file(self, view: Mapping[str, Any]) -> dict[tuple[str, int], Any]:
        """``view`` (this version's tensors by name) by (data file, offset), for :meth:`tensors` ``reuse``."""
        files = self.files
        return {(f.name, f.offset): t for n, t in view.items() if (f := files.get(n)) is not None}

    def layout(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """checkpoint name -> (torch dtype, shape)."""
        import torch

        return {n: (getattr(torch, f.dtype), f.shape) for n, f in self.files.items()}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        files = self.files
        return sum(files[n].nbytes for n in (files if names is None else names))


def checked_file_name(name: object) -> str:
    """``name`` when it is one the node gives its data files (see ``_DATA_FILE``), else :class:`UnsafePath`."""
    if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
        raise UnsafePath(f"the data file name {name!r} is not one a node writes (24 hex digits and .pack or .pos)")
    return name


def checked_version_id(vid: object) -> str:
    """``vid`` when it is one the node gives its versions (:func:`step_id`, ``seed-<16 hex>``), else
    :class:`UnsafePath`."""
    if not isinstance(vid, str) or not _VERSION_ID.fullmatch(vid):
        raise UnsafePath(f"the version id {vid!r} is not one a node writes (a 12-digit step or seed-<16 hex>)")
    return vid


def step_id(step: int) -> str:
    """The id (and index file stem) of a step's version: zero-padded, so names sort by step."""
    return f"{step:012d}"


def changed_positions(old: Any, new: Any) -> Any:
    """Flat positions (int64, sorted) where ``new``'s bits differ from ``old``'s (same dtype and shape):
    a full compare, which the build does only where the fetcher wrote a whole tensor (an anchor)."""
    import torch

    if new.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    diff = old.contiguous().view(-1).view(bits) != new.contiguous().view(-1).view(bits)
    return torch.nonzero(diff).view(-1)


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise); a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
