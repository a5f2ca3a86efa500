"""Local-directory store: the embedded default. Atomic writes via temp file + fsync + rename."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from deltasync.errors import AlreadyExists, InvalidKey, ObjectNotFound, StorageError
from deltasync.storage.base import (
    Data,
    ObjectInfo,
    PutMode,
    Store,
    check_limit,
    map_os_errors,
    too_large,
    validate_key,
)

__all__ = ["LocalStore"]

TMP_DIR = ".deltasync-tmp"
#: how an object's file is opened: never through a symlink (the last component), never waiting on
#: a FIFO's writer (O_NONBLOCK: the open returns at once and fstat refuses it)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _raise_unless_gone(exc: OSError) -> None:
    """``os.walk`` error hook: a directory deleted while listing is fine, anything else fails the listing."""
    if not isinstance(exc, FileNotFoundError):
        raise exc


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """Objects as files under ``root``.

    Every write goes to a temp file in ``root/.deltasync-tmp``, is fsynced,
    then renamed into place (``os.replace``) or, for create-only writes,
    hard-linked (``os.link`` fails if the key exists: atomic create-if-absent).

    Opening a store creates nothing: ``root`` and its temp dir are made by the
    first write, so reading a mistyped path leaves no directory behind (a missing
    root reads as an empty store).
    """

    supports_conditional_put = True

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()
        self._fsync = fsync
        # fail early on a root that can never be a directory (it, or an ancestor, is a file)
        for p in (self.root, *self.root.parents):
            if p.exists():
                if not p.is_dir():
                    raise StorageError(f"cannot create store directory {self.root}: {p} is not a directory")
                break

    def _make_dirs(self) -> None:
        """Create the root and its temp dir (the first write does; idempotent)."""
        with map_os_errors(f"cannot create store directory {self.root}"):
            (self.root / TMP_DIR).mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        parts = validate_key(key).split("/")
        if parts[0] == TMP_DIR:
            raise InvalidKey(f"invalid key {key!r}: keys under {TMP_DIR}/ are reserved for the store's temp files")
        return self.root.joinpath(*parts)

    def _write_tmp(self, data: Data) -> Path:
        tmp = self.root / TMP_DIR / uuid.uuid4().hex
        try:
            if isinstance(data, Path):
                shutil.copyfile(data, tmp)
                if self._fsync:
                    with open(tmp, "rb+") as f:
                        os.fsync(f.fileno())
                return tmp
            with open(tmp, "wb") as f:
                f.write(data)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            return tmp
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write leaves no partial temp file behind
            raise

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        finals = {key: self._path(key) for key in items}  # every key is valid before anything is created
        if finals:
            self._make_dirs()
        for key, data in items.items():
            final = finals[key]
            with map_os_errors(f"{self.url}: cannot write {key}"):
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._write_tmp(data)
                try:
                    if mode == "create":
                        try:
                            os.link(tmp, final)
                        except FileExistsError:
                            if final.is_dir():  # a prefix of other keys, not an object
                                raise StorageError(
                                    f"{self.url}: cannot write {key}: a directory is in the way"
                                ) from None
                            raise AlreadyExists(f"{self.url}: {key} already exists (create-only write)") from None
                    else:
                        os.replace(tmp, final)
                finally:
                    tmp.unlink(missing_ok=True)
                if self._fsync:
                    _fsync_dir(final.parent)

    def _open(self, key: str) -> tuple[int, os.stat_result]:
        """An fd of ``key``'s file and its ``fstat``: a regular file, or a typed error before any read.

        Objects are files this store wrote (temp file, then rename or link): a symlink (even one to
        a regular file), a FIFO, a device or a socket under a key is refused. The store's root and
        the directories above an object may be symlinks (only the last component is not followed).
        """
        path = self._path(key)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"{self.url}: no object {key}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and os.path.islink(path)):
                raise StorageError(
                    f"{self.url}: cannot read {key}: it is a symbolic link; a local store's objects are regular "
                    "files written by the store (remove the link)"
                ) from None
            raise StorageError(f"{self.url}: cannot read {key}: {exc.strerror or exc}") from exc
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):  # a prefix of other keys, not an object
                raise ObjectNotFound(f"{self.url}: no object {key}")
            if not stat.S_ISREG(st.st_mode):
                kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
                raise StorageError(
                    f"{self.url}: cannot read {key}: it is {kind}, not a regular file; a local store's objects "
                    "are regular files written by the store (remove it)"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _read(self, key: str, limit: int | None = None) -> bytes:
        """The whole object ``key``; with ``limit``, ObjectTooLarge unless it holds at most ``limit`` bytes
        (known from ``fstat`` before reading; at most ``limit + 1`` bytes are read, should it grow)."""
        fd, st = self._open(key)
        with open(fd, "rb", closefd=True) as f:
            try:
                if limit is None:
                    return f.read()
                if st.st_size > limit:
                    raise too_large(self.url, key, st.st_size, limit)
                data = f.read(st.st_size + 1)  # +1: sees the end of file, or growth since the fstat
                while len(data) <= limit:
                    more = f.read(min(1 << 20, limit + 1 - len(data)))
                    if not more:
                        return data
                    data += more
                raise too_large(self.url, key, None, limit)
            except OSError as exc:
                raise StorageError(f"{self.url}: cannot read {key}: {exc.strerror or exc}") from exc

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        return {key: self._read(key) for key in keys}

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        # docstring inherited
        return {key: self._read(key, check_limit(limit)) for key, limit in limits.items()}

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        fd, _ = self._open(key)
        with open(fd, "rb", closefd=True) as f:
            try:
                f.seek(start)
                return f.read(max(0, end - start))
            except OSError as exc:
                raise StorageError(f"{self.url}: cannot read {key}: {exc.strerror or exc}") from exc

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        out: list[ObjectInfo] = []
        if prefix.split("/")[0] == TMP_DIR and "/" in prefix:
            return out  # only temp files live there
        # walk only the deepest directory that the prefix names in full
        base_parts = prefix.split("/")[:-1]
        base = (
            self.root.joinpath(*base_parts)
            if base_parts and all(p not in ("", ".", "..") for p in base_parts)
            else self.root
        )
        with map_os_errors(f"{self.url}: cannot list {prefix!r}"):
            if not base.is_dir():
                return []
            for dirpath, dirnames, filenames in os.walk(base, onerror=_raise_unless_gone):
                if Path(dirpath) == self.root:
                    dirnames[:] = [d for d in dirnames if d != TMP_DIR]
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        try:
                            st = os.stat(os.path.join(dirpath, name))
                            out.append(ObjectInfo(key, st.st_size, st.st_mtime))
                        except FileNotFoundError:  # deleted while listing
                            continue
        out.sort(key=lambda o: o.key)
        return out

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        for key in keys:
            path = self._path(key)
            with map_os_errors(f"{self.url}: cannot delete {key}"):
                try:
                    path.unlink()
                except (FileNotFoundError, NotADirectoryError):
                    continue  # no such object
                except OSError:
                    if path.is_dir():  # a prefix of other keys (EISDIR, or EPERM on macOS), not an object
                        continue
                    raise

    def exists(self, key: str) -> bool:
        # docstring inherited
        return self._path(key).is_file()
