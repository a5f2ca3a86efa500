"""Local-directory store: the embedded default. Atomic writes via temp file + fsync + rename."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from deltasync.errors import AlreadyExists, InvalidKey, ObjectNotFound, StorageError
from deltasync.storage.base import Data, ObjectInfo, PutMode, Store, map_os_errors, validate_key

__all__ = ["LocalStore"]

TMP_DIR = ".deltasync-tmp"


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

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        out: dict[str, bytes] = {}
        for key in keys:
            path = self._path(key)
            try:
                out[key] = path.read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ObjectNotFound(f"{self.url}: no object {key}") from None
            except OSError as exc:
                raise StorageError(f"{self.url}: cannot read {key}: {exc.strerror or exc}") from exc
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"{self.url}: no object {key}") from None
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
