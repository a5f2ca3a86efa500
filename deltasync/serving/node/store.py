"""A run's versions in one node-shared folder: its layout, the index, the data files, collection.

::

    <root>/<run key>/
        versions/<id>.json    a complete version (:meth:`~deltasync.serving.node.versions.Version.to_json`):
                              written last, by rename (the commit point)
        data/<file>.pack      the tensors one build wrote (each at a page boundary), or the positions
                              of their changes; immutable once written, shared by every version that
                              names a tensor in it
        building.json         who builds which step, and how far it got (for operators)

Every folder is this user's own, mode 0700 (made or checked by
:func:`~deltasync.serving.node._safedir.private_dir`); files are made with ``O_EXCL | O_NOFOLLOW``
(new names, renamed into place) and indexes read with ``O_NOFOLLOW``. An index that does not parse,
or names a file or version id the node does not write (``/``, ``..``, a leading dot: see
:func:`~deltasync.serving.node.versions.checked_file_name`), is an error where it is asked for,
skipped (logged) where versions are listed, and deleted by the next collection: the node builds on
its last good version.

Anyone may read; writing and collecting are for the holder of the node lock
(:class:`~deltasync.serving.node.lock.NodeLock`). A version exists only once its index is in place,
after every file it names: what a writer killed half-way leaves is named by no index, and the next
collection deletes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError, ObjectNotFound, ProtocolError, UnsafePath
from deltasync.run import RunReader
from deltasync.serving.node._safedir import private_dir, read_regular, replace_file
from deltasync.serving.node.packs import PackWriter
from deltasync.serving.node.versions import INDEX_FORMAT, PositionsRef, Version, VersionFile, step_id

__all__ = ["COMPACT_BELOW", "KEEP", "VersionStore", "run_key"]

log = logging.getLogger("deltasync.node")

#: versions a collection keeps: the two published last (the one engines serve and the next)
KEEP = 2
#: a build copies the tensors a new version would still take from an older pack into its own pack
#: when they are less than this fraction of that pack's bytes: a pack stays in memory while any
#: tensor in it is named (or mapped), so the packs a version names hold at most 1/COMPACT_BELOW times its bytes
COMPACT_BELOW = 0.5


def run_key(url: str, verify: object, signing_key: bytes | None) -> str:
    """The folder name of a run's node mirror: engines share it when they read the same run the same way."""
    h = hashlib.sha256()
    h.update(url.encode())
    h.update(b"\0" + repr(verify).encode())
    h.update(b"\0" + hashlib.sha256(signing_key or b"").digest())
    if INDEX_FORMAT != 1:  # a deltasync of another index format on the node keeps its own folder
        h.update(b"\0index-format-%d" % INDEX_FORMAT)
    return h.hexdigest()[:24]


class VersionStore:
    """A run's versions in ``directory`` (see the module docstring), created when missing.

    reader: the run as committed now: a version is current while its step's manifest digest is
        still the one it was built from (a run deleted and re-created at the same URL is not).
    keep: versions a collection keeps, the ones published last.
    """

    def __init__(self, directory: Path, reader: RunReader, *, keep: int = KEEP) -> None:
        self.dir = directory
        self.data = directory / "data"
        self.index = directory / "versions"
        for d in (self.dir, self.data, self.index):
            private_dir(d)  # mode 0700, this user's, not a link: or UnsafePath
        self.reader = reader
        self.keep = keep
        self._data_dir = str(self.data)
        #: writes the new data files of a build (under the lock)
        self.packs = PackWriter(self.data, directory, keep)
        #: index file name -> ((inode, mtime, size), the version parsed from it): an index is renamed
        #: into place once and never rewritten, and a build reads every index several times (18k
        #: entries each at a MoE's tensor count)
        self._parsed: dict[str, tuple[tuple[int, int, int], Version]] = {}

    # ------------------------------------------------------------------ reading

    def read(self, vid: str) -> Version | None:
        """The complete version ``vid`` as indexed (current or not), or None."""
        return self._read(self.index / f"{vid}.json")

    def _read(self, path: Path) -> Version | None:
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            hit = self._parsed.get(path.name)
            if hit is not None and hit[0] == key:
                return hit[1]
            doc = json.loads(read_regular(path))  # O_NOFOLLOW, a regular file only
            if not isinstance(doc, dict):
                raise TypeError(f"a JSON {type(doc).__name__}, not an object")
            if int(doc.get("format", 1)) > INDEX_FORMAT:
                raise ValueError(f"index format {doc['format']}, this deltasync reads up to {INDEX_FORMAT}")
            version = Version.from_json(doc, self.data)
            if f"{version.id}.json" != path.name:
                raise UnsafePath(f"it names version {version.id!r}")
        except FileNotFoundError:
            return None
        except UnsafePath as exc:
            raise UnsafePath(
                f"the node mirror's index {path} is refused: {exc}. Delete it (the node rebuilds that step; the "
                "next collection deletes it too)"
            ) from exc
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ProtocolError(
                f"the node mirror's index {path} is unreadable ({exc}); delete it (the node rebuilds that step; "
                "the next collection deletes it too)"
            ) from exc
        except OSError as exc:
            raise DeltaSyncError(f"the node mirror's index {path} is unreadable ({exc}); delete {self.dir}") from exc
        self._remember(path, version, key)
        return version

    def _remember(self, path: Path, version: Version, key: tuple[int, int, int] | None = None) -> None:
        if key is None:
            try:
                st = os.stat(path)
            except OSError:
                return
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if len(self._parsed) >= 4 * max(self.keep, 4):
            self._parsed.clear()  # bounded: versions come and go
        self._parsed[path.name] = (key, version)

    def _listed(self, path: Path) -> Version | None:
        """The version indexed at ``path``, None when it is gone or refused (a bad index is logged and
        left to the next collection: the node goes on from its good versions)."""
        try:
            return self._read(path)
        except (ProtocolError, UnsafePath) as exc:
            log.warning("node mirror: skipping a bad index: %s", exc)
            return None

    def all_versions(self) -> list[Version]:
        """Every complete version, oldest first (unknown steps first); bad indexes left out (logged)."""
        out = [v for p in self.index.glob("*.json") if (v := self._listed(p)) is not None]
        return sorted(out, key=lambda v: (-1 if v.step is None else v.step, v.id))

    def digest(self, step: int) -> str | None:
        """The manifest digest of ``step`` as committed now (None: not committed, e.g. an engine
        checkpoint marked with a step of another run)."""
        try:
            return str(self.reader.committed(step).digest)
        except ObjectNotFound:
            return None

    def current(self, version: Version | None) -> bool:
        """Whether ``version`` is the run's step as committed now (not a step of an older run that was
        deleted and re-created at the same URL); versions of an unknown step are not."""
        return (
            version is not None
            and version.step is not None
            and version.digest is not None
            and version.digest == self.digest(version.step)
        )

    def version(self, step: int) -> Version | None:
        """The complete version of ``step``, if the node has it (for the run as committed now)."""
        have = self.read(step_id(step))
        return have if self.current(have) else None

    def file_bytes(self, files: Mapping[str, VersionFile]) -> int:
        """Bytes of the tensors of ``files`` in the node's data files."""
        return sum(f.nbytes for f in files.values())

    def file_size(self, name: str) -> int:
        """Bytes of the data file ``name`` (FileNotFoundError: collected)."""
        return os.stat(os.path.join(self._data_dir, name)).st_size

    def nbytes_on_disk(self) -> int:
        """Bytes of the node's data files (what the mirror holds in shared memory)."""
        total = 0
        for p in self.data.iterdir():
            with contextlib.suppress(FileNotFoundError):  # collected meanwhile
                total += p.stat().st_size
        return total

    # ------------------------------------------------------------------ writing (under the lock)

    def write_pack(self, tensors: Iterable[tuple[str, Any]]) -> dict[str, VersionFile]:
        """A new pack of ``tensors`` (see :meth:`.packs.PackWriter.write_pack`)."""
        return self.packs.write_pack(tensors)

    def copy_pack(self, version: Version, names: Iterable[str]) -> dict[str, VersionFile]:
        """A new pack of ``version``'s bytes for ``names`` (see :meth:`.packs.PackWriter.copy_pack`)."""
        return self.packs.copy_pack(version, names)

    def write_positions(self, positions: Iterable[tuple[str, Any, int]]) -> dict[str, PositionsRef]:
        """A new positions file (see :meth:`.packs.PackWriter.write_positions`)."""
        return self.packs.write_positions(positions)

    def publish(
        self,
        vid: str,
        step: int | None,
        files: Mapping[str, VersionFile],
        stats: Mapping[str, Any],
        base: str | None = None,
        positions: Mapping[str, PositionsRef] | None = None,
        moved: Mapping[str, VersionFile] | None = None,
    ) -> Version:
        """Make the version ``vid`` exist: its index, renamed into place after every file it names was
        written. ``base``: the version it was built from; ``positions``: for the tensors that changed
        sparsely since, their positions files; ``moved``: the tensors that hold the bits of the base's
        entry given, moved into this build's pack."""
        digest = None if step is None else self.digest(step)
        version = Version(
            vid, step, dict(files), self.data, dict(stats), digest, base, dict(positions or {}), dict(moved or {})
        )
        path = self.index / f"{vid}.json"
        replace_file(path, json.dumps(version.to_json()).encode())  # a new O_EXCL file renamed over it
        self._remember(path, version)  # the collection right after reads it: 18k entries at a MoE's count
        return version

    def mark_building(self, step: int, phase: str) -> None:
        """Say who builds which step, and how far it got, in ``building.json`` (for operators)."""
        replace_file(
            self.dir / "building.json", json.dumps({"pid": os.getpid(), "step": step, "phase": phase}).encode()
        )

    def done_building(self) -> None:
        """The build said by ``building.json`` is over."""
        (self.dir / "building.json").unlink(missing_ok=True)

    # --------------------------------------------------------------- collection

    def _by_publication(self) -> list[Version]:
        """Every complete version, in the order they were published (the newest last)."""
        found = []
        for p in self.index.glob("*.json"):
            try:
                published = p.stat().st_mtime_ns  # the index is renamed into place once, when published
                v = self._listed(p)
            except FileNotFoundError:
                continue
            if v is not None:
                found.append((published, v.id, v))
        return [v for _, _, v in sorted(found, key=lambda x: (x[0], x[1]))]

    def collect(self, keep: int | None = None) -> None:
        """Under the lock: drop versions beyond the ``keep`` published last (default: the store's) and the
        data files no version names (a dead leader's leftovers included). Last published, not highest
        step: the node may hold newer steps than the one just built (an engine ahead of this one, or
        engines killed before they could clean up), and the version just built must outlive its build."""
        keep = self.keep if keep is None else keep
        versions = self._by_publication()
        kept = versions[-keep:] if keep else []
        for v in versions:
            if v not in kept:
                (self.index / f"{v.id}.json").unlink(missing_ok=True)
        good = {f"{v.id}.json" for v in versions}
        for p in self.index.glob("*.json"):
            if p.name not in good:  # refused when listed (the holder of the lock is the only writer)
                p.unlink(missing_ok=True)
        live = {f.name for v in kept for f in v.files.values()} | {p.file for v in kept for p in v.positions.values()}
        for name in os.listdir(self._data_dir):  # names, not Paths: 18k+ files at a MoE's tensor count
            if name not in live:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._data_dir, name))
        for p in [*self.index.glob(".*.tmp"), *self.dir.glob(".building.*.tmp")]:
            p.unlink(missing_ok=True)
