"""A node mirror's data files, read and written: a version's tensors mapped from them (copy-on-write,
read-only shared, or shared and writable for the build that applies a step into a new pack), their
page tables filled ahead of a pause, and raw bytes written as a few system calls.

See :mod:`deltasync.serving.node.versions` for what a version names in them.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Carver",
    "Placed",
    "map_file",
    "map_writable",
    "populate",
    "raw_bytes",
    "torch_uint8",
    "write_buffers",
]


class Placed(Protocol):
    """Where a tensor lies in a data file (a :class:`~deltasync.serving.node.versions.VersionFile`)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def offset(self) -> int: ...


def map_file(torch: Any, path: str, nbytes: int, read_only: bool) -> Any:
    """The first ``nbytes`` of a data file as one uint8 tensor: mapped copy-on-write (``MAP_PRIVATE``:
    a write stays this process's), or with ``read_only`` shared and write-protected (``PROT_READ``: a
    write faults instead of reaching the node's copy). CUDA registers a read-only shared mapping 6.8x
    faster than a private one (an H200: 89 vs 605 ms for 1.11 GiB, ``benchmarks/bench_pinned_mirror.py --map``)."""
    if read_only:
        return _map_read_only(torch, path, torch.uint8, nbytes)
    try:
        return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    except RuntimeError:
        if not os.path.exists(path):  # collected since the version was read: the caller reads it again
            raise FileNotFoundError(path) from None
        raise


class Carver:
    """The tensors of one mapped data file (a uint8 tensor over its bytes), each a strided view of it:
    one torch call per tensor (a slice and two views take three)."""

    def __init__(self, whole: Any) -> None:
        self.whole = whole
        self._typed: dict[str, tuple[Any, int]] = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __call__(self, entry: Placed) -> Any:
        typed = self._typed.get(entry.dtype)
        if typed is None:
            import torch

            dtype = getattr(torch, entry.dtype)
            size = dtype.itemsize
            n = self.whole.numel()
            typed = self._typed[entry.dtype] = (self.whole[: n - n % size].view(dtype), size)
        shape = entry.shape
        strides = self._strides.get(shape)
        if strides is None:
            acc, out = 1, []
            for d in reversed(shape):
                out.append(acc)
                acc *= max(d, 1)
            strides = self._strides[shape] = tuple(reversed(out))
        if entry.offset % typed[1]:
            raise ValueError(f"{entry.name}: offset {entry.offset} is not a multiple of {entry.dtype}'s size")
        return typed[0].as_strided(shape, strides, entry.offset // typed[1])


def map_writable(path: str, nbytes: int) -> Any:
    """A data file's first ``nbytes`` as one uint8 tensor mapped shared and writable (a write reaches the
    file: a build applies a step in place into the pack it just wrote), its page tables filled now."""
    import torch

    whole = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    _populate_range(whole.data_ptr(), nbytes, _MADV_POPULATE_WRITE)
    return whole


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
_MADV_POPULATE_WRITE = 23
_populate_works = True


def _populate_range(ptr: int, nbytes: int, advice: int) -> None:
    """``madvise(advice)`` over a range; an older kernel (EINVAL) leaves the faults to the first touch."""
    global _populate_works
    libc = _libc() if _populate_works else None
    if libc is None or not nbytes:
        return
    if libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), advice) != 0:
        _populate_works = False


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


def raw_bytes(tensor: Any) -> memoryview:
    """A host tensor's (or numpy array's) bytes, without a copy where it is contiguous."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(-1).view(torch_uint8()).numpy()) if flat.numel() else memoryview(b"")


#: buffers per ``writev`` (Linux's IOV_MAX is 1024), and bytes at most held for one (a device tensor's
#: bytes are a host copy made as they are asked for)
_IOV = 1024
_BATCH_BYTES = 256 << 20
_SLICE = 64 << 20


def write_buffers(path: Path | str, buffers: Iterable[memoryview]) -> None:
    """``buffers`` one after the other, to a new file (never over an existing one, never through a
    symbolic link: ``O_EXCL | O_NOFOLLOW``; mode 0600, this user's only), a batch of them per system call."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        batch: list[memoryview] = []
        held = 0
        for whole in buffers:
            # a run of a whole pack is one buffer: written in slices (one 1.6 GB writev took 1.3x
            # the time of 64 MiB ones from a mapped file here)
            for at in range(0, whole.nbytes, _SLICE):
                b = whole[at : at + _SLICE] if whole.nbytes > _SLICE else whole
                batch.append(b)
                held += b.nbytes
                if len(batch) == _IOV or held >= _BATCH_BYTES:
                    _writev_all(fd, batch)
                    batch, held = [], 0
        _writev_all(fd, batch)
    finally:
        os.close(fd)


def _writev_all(fd: int, todo: list[memoryview]) -> None:
    i = 0
    while i < len(todo):
        n = os.writev(fd, todo[i : i + _IOV])
        while n and i < len(todo):  # a short write: go on from where it stopped
            if n >= todo[i].nbytes:
                n -= todo[i].nbytes
                i += 1
            else:
                todo[i] = todo[i][n:]
                n = 0


@functools.cache
def torch_uint8() -> Any:
    """``torch.uint8`` (torch imported on first use)."""
    import torch

    return torch.uint8
