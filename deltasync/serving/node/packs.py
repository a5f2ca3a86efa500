"""New data files of a node's versions: packs of tensors (each at a page boundary) and positions files.

A build writes the tensors a step changed into one new pack (:meth:`PackWriter.write_pack`), or copies
the ones it is about to change from its base version's packs first (:meth:`PackWriter.copy_pack`: runs
of tensors that lie one after the other are one buffer), and the positions of sparse changes into a
positions file (:meth:`PackWriter.write_positions`). Every file is new (``O_EXCL | O_NOFOLLOW``,
:func:`~deltasync.serving.node.datafiles.write_buffers`) and immutable once written; a full filesystem
is one clear :class:`DeltaSyncError` saying how to give the mirror room (:func:`no_room`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError
from deltasync.serving.node.datafiles import raw_bytes, write_buffers
from deltasync.serving.node.versions import PACK_ALIGN, POSITIONS_ALIGN, PositionsRef, Version, VersionFile

__all__ = ["PackWriter", "no_room"]

_ZEROS = memoryview(bytes(PACK_ALIGN))


class PackWriter:
    """Writes new data files into ``data_dir``, the data folder of the run's node folder ``root``
    (which holds up to ``keep`` versions: said when the filesystem is full). Under the node lock."""

    def __init__(self, data_dir: Path, root: Path, keep: int) -> None:
        self.data_dir = str(data_dir)
        self.root = root
        self.keep = keep

    def write_pack(self, tensors: Iterable[tuple[str, Any]]) -> dict[str, VersionFile]:
        """A new pack file holding the bytes of ``tensors`` ((name, tensor) pairs; a device tensor is
        copied to the host as it is written), each from a page boundary; their entries, for a version
        to name. One file and a few system calls for any number of tensors."""
        file = secrets.token_hex(12) + ".pack"
        entries: dict[str, VersionFile] = {}

        def buffers() -> Iterator[memoryview]:
            at = 0
            for name, tensor in tensors:
                pad = -at % PACK_ALIGN
                if pad:
                    yield _ZEROS[:pad]
                    at += pad
                raw = raw_bytes(tensor)
                entries[name] = VersionFile.of(file, tensor, at)
                yield raw
                at += raw.nbytes

        self._write(file, buffers())
        return entries

    def copy_pack(self, version: Version, names: Iterable[str]) -> dict[str, VersionFile]:
        """A new pack file holding the bytes ``version`` has for ``names``, copied from its data files
        as runs: tensors that lie one after the other in a pack (the usual case: a step changes every
        tensor of the previous pack) are one buffer, at the same distances in the new pack. Their
        entries, as :meth:`write_pack`."""
        import mmap

        file = secrets.token_hex(12) + ".pack"
        files = version.files
        picked = sorted((files[n].name, files[n].offset, n) for n in names)
        entries: dict[str, VersionFile] = {}
        maps: dict[str, mmap.mmap] = {}

        def source(name: str) -> memoryview:
            mm = maps.get(name)
            if mm is None:
                with open(os.path.join(self.data_dir, name), "rb") as fh:  # FileNotFoundError: collected
                    mm = maps[name] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            return memoryview(mm)

        def buffers() -> Iterator[memoryview]:
            at = 0
            i = 0
            while i < len(picked):
                src, start, _ = picked[i]
                end = start
                j = i
                while j < len(picked):  # the run: each next tensor where the pack put the one after
                    f, off, n = picked[j]
                    if f != src or (j > i and off != end + (-end % PACK_ALIGN)):
                        break
                    end = off + files[n].nbytes
                    j += 1
                pad = -at % PACK_ALIGN
                if pad:
                    yield _ZEROS[:pad]
                    at += pad
                for _, off, n in picked[i:j]:
                    e = files[n]
                    entries[n] = VersionFile(file, e.dtype, e.shape, at + off - start)
                if end > start:
                    run = source(src)[start:end]
                    if run.nbytes != end - start:
                        raise DeltaSyncError(
                            f"the node mirror's data file {src} holds {start + run.nbytes:,} bytes, its version "
                            f"names {end:,}: it was cut short; delete {self.root}"
                        )
                    yield run
                at += end - start
                i = j

        try:
            self._write(file, buffers())
        finally:
            for mm in maps.values():
                with contextlib.suppress(BufferError):  # a view still exported: closed when collected
                    mm.close()
        return entries

    def write_positions(self, positions: Iterable[tuple[str, Any, int]]) -> dict[str, PositionsRef]:
        """A new file holding, for each (name, flat positions (sorted; numpy or torch, as a
        :class:`~deltasync.protocol.TensorChange` carries them), numel of the tensor), the positions
        (int32 where they fit); where each lies, for a version's ``positions``."""
        import numpy as np

        file = secrets.token_hex(12) + ".pos"
        refs: dict[str, PositionsRef] = {}
        buffers: list[memoryview] = []
        at = 0
        for name, pos, numel in positions:
            if not isinstance(pos, np.ndarray):
                pos = pos.detach().cpu().numpy()
            width = 4 if numel < 2**31 else 8
            arr = np.ascontiguousarray(pos, dtype=np.int32 if width == 4 else np.int64)
            pad = -at % POSITIONS_ALIGN
            if pad:
                buffers.append(_ZEROS[:pad])
                at += pad
            refs[name] = PositionsRef(file, at, int(arr.size), width)
            buffers.append(raw_bytes(arr))
            at += arr.nbytes
        self._write(file, buffers)
        return refs

    def _write(self, name: str, buffers: Iterable[memoryview]) -> None:
        """A new data file; a full filesystem is one clear error (the caller's collection removes what
        the unfinished version wrote: no version names it)."""
        path = os.path.join(self.data_dir, name)
        try:
            write_buffers(path, buffers)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise DeltaSyncError(no_room(self.root.parent, self.keep)) from exc


def no_room(root: Path, keep: int) -> str:
    """What to do when the node mirror's filesystem under ``root`` is full (it holds up to ``keep`` versions)."""
    try:
        usage = shutil.disk_usage(root)
        room = f"{usage.free / 2**20:,.1f} MiB free of {usage.total / 2**20:,.1f} MiB"
    except OSError:
        room = "its filesystem is full"
    return (
        f"no room for the node mirror in {root} ({room}): it holds up to {keep} versions of the model's "
        "tensors (files of tensors a step did not change are shared). Give that filesystem more room (in a container: "
        "`docker run --shm-size=<2x the checkpoint>` or `--ipc=host`), or put the mirror on a larger one: "
        '`"node_dir"` in init_info or DELTASYNC_NODE_DIR (a local disk works: versions are mapped, not copied)'
    )
