"""A node mirror's versions and their files: what a version is, its index document, and reading and
writing its tensors.

See :mod:`deltasync.serving.node.store` for the folder they live in.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltasync.protocol import TensorChange

__all__ = [
    "INDEX_FORMAT",
    "Version",
    "VersionFile",
    "changed_positions",
    "map_tensor",
    "populate",
    "step_id",
    "trim_heap",
    "write_tensor",
]

#: the ``format`` a version's index is written with
INDEX_FORMAT = 1


@dataclass(frozen=True, slots=True)
class VersionFile:
    """One tensor of a version: the data file that holds its raw bytes, its dtype (a torch dtype's name
    without ``torch.``) and its shape. Versions that share a tensor name the same file."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: Any) -> VersionFile:
        """The entry of ``tensor``, written to the data file ``name``."""
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def to_json(self) -> list[Any]:
        """The index's form: ``[file, dtype, shape]``."""
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, doc: Any) -> VersionFile:
        """An entry read back from an index (see :meth:`to_json`)."""
        name, dtype, shape = doc
        return cls(str(name), str(dtype), tuple(int(x) for x in shape))


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
    #: the version this one was built from, and for each tensor that changed sparsely since, the file
    #: of its changed flat positions (sorted; int32 or int64)
    base: str | None = None
    positions: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The version's index document (``versions/<id>.json``; the data folder is where it lies)."""
        return {
            "format": INDEX_FORMAT,
            "id": self.id,
            "step": self.step,
            "digest": self.digest,
            "files": {n: f.to_json() for n, f in self.files.items()},
            "stats": dict(self.stats),
            "base": self.base,
            "positions": dict(self.positions),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], data: Path) -> Version:
        """A version read back from its index (see :meth:`to_json`), its files in ``data``."""
        return cls(
            doc["id"],
            doc["step"],
            {n: VersionFile.from_json(f) for n, f in doc["files"].items()},
            data,
            doc.get("stats", {}),
            doc.get("digest"),
            doc.get("base"),
            doc.get("positions", {}),
        )

    def changes(self, served: Version | None, names: Iterable[str] | None = None) -> dict[str, TensorChange]:
        """What changed since ``served``, for ``names`` (default: :meth:`changed_from`): one
        :class:`~deltasync.protocol.TensorChange` per name, with the flat positions (sorted; int32 or
        int64 numpy arrays mapped from the node's positions files) of the tensors changed sparsely
        since ``served`` when this version was built straight from it, and ``positions`` None (the
        whole tensor) for the others."""
        import torch

        known = self.base is not None and served is not None and self.base == served.id
        out: dict[str, TensorChange] = {}
        for name in self.changed_from(served) if names is None else names:
            file = self.positions.get(name) if known else None
            if file is None:
                out[name] = TensorChange(name)
                continue
            size = (self.data / file).stat().st_size
            dtype = torch.int32 if file.endswith(".i32") else torch.int64
            out[name] = TensorChange(
                name, map_tensor(torch, self.data / file, dtype, (size // dtype.itemsize,)).numpy()
            )
        return out

    def changed_from(self, other: Version | None) -> list[str]:
        """The names whose bits may differ from ``other`` (all of them when ``other`` is None)."""
        if other is None:
            return sorted(self.files)
        return sorted(n for n, f in self.files.items() if other.files.get(n) != f)

    def tensors(
        self, names: Iterable[str] | None = None, *, reuse: Mapping[str, Any] | None = None, read_only: bool = False
    ) -> dict[str, Any]:
        """The tensors, mapped from the node's files: copy-on-write (a write stays private), or with
        ``read_only`` shared and write-protected (see :func:`map_tensor`). ``reuse``: tensors already
        mapped, by data file name (another version's that shares files)."""
        import torch

        out: dict[str, Any] = {}
        data = str(self.data)  # joined as strings: a Path per file costs more than the mapping at 18k files
        for name in self.files if names is None else names:
            entry = self.files[name]
            have = None if reuse is None else reuse.get(entry.name)
            if have is not None and VersionFile.of(entry.name, have) == entry:
                out[name] = have
            else:
                dtype = getattr(torch, entry.dtype)
                path = os.path.join(data, entry.name)
                out[name] = map_tensor(torch, path, dtype, entry.shape, read_only=read_only)
        return out

    def by_file(self, view: Mapping[str, Any]) -> dict[str, Any]:
        """``view`` (this version's tensors by name) by data file name, for :meth:`tensors` ``reuse``."""
        return {self.files[n].name: t for n, t in view.items() if n in self.files}

    def layout(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """checkpoint name -> (torch dtype, shape)."""
        import torch

        return {n: (getattr(torch, f.dtype), f.shape) for n, f in self.files.items()}

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        import torch

        total = 0
        for n in self.files if names is None else names:
            entry = self.files[n]
            numel = 1
            for d in entry.shape:
                numel *= d
            total += numel * getattr(torch, entry.dtype).itemsize
        return total


def step_id(step: int) -> str:
    """The id (and index file stem) of a step's version: zero-padded, so names sort by step."""
    return f"{step:012d}"


def map_tensor(torch: Any, path: Path | str, dtype: Any, shape: tuple[int, ...], *, read_only: bool = False) -> Any:
    """A tensor over a data file: mapped copy-on-write (``MAP_PRIVATE``: a write stays this process's),
    or with ``read_only`` mapped shared and write-protected (``PROT_READ``: a write faults instead of
    reaching the node's copy). CUDA registers a read-only shared mapping 6.8x faster than a private
    one (an H200: 89 vs 605 ms for 1.11 GiB, ``benchmarks/bench_pinned_mirror.py --map``)."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if read_only:
        return _map_read_only(torch, path, dtype, numel).view(shape)
    try:
        return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).view(shape)
    except RuntimeError:
        if not os.path.exists(path):  # collected since the version was read: the caller reads it again
            raise FileNotFoundError(path) from None
        raise


def _map_read_only(torch: Any, path: Path | str, dtype: Any, numel: int) -> Any:
    import mmap
    import warnings

    with open(path, "rb") as fh:  # FileNotFoundError: collected since the version was read
        mm = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns (once) that the buffer is not writable: on purpose, a write must not reach the node
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(mm, dtype=dtype, count=numel)  # the tensor keeps the mapping alive


_MADV_POPULATE_READ = 22  # Linux 5.14+
_populate_works = True


def populate(tensors: Iterable[Any]) -> None:
    """Fault in the page tables of mapped tensors now (``MADV_POPULATE_READ``: nothing is copied, the
    pages are the node's shared ones), so that the pause does not take a page fault per 4 KiB: on
    this project's CPU machines a copy from a fresh mapping took 1.5x one from a populated one. A
    kernel without it (before 5.14) leaves the faults to the first read."""
    global _populate_works
    if not _populate_works:
        return
    libc = _libc()
    if libc is None:
        _populate_works = False
        return
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes and libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes), _MADV_POPULATE_READ) != 0:
            _populate_works = False  # EINVAL: an older kernel
            return


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def write_tensor(path: Path | str, tensor: Any) -> None:
    """A tensor's (or a numpy array's) raw bytes, to a new file (never over an existing one)."""
    if isinstance(tensor, np.ndarray):
        raw = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
    else:
        flat = tensor.detach()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        raw = memoryview(flat.view(-1).view(torch_uint8()).numpy()) if flat.numel() else memoryview(b"")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # as open(path, "xb")
    try:
        while raw.nbytes:
            raw = raw[os.write(fd, raw) :]
    finally:
        os.close(fd)


@functools.cache
def torch_uint8() -> Any:
    """``torch.uint8`` (torch imported on first use)."""
    import torch

    return torch.uint8


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
