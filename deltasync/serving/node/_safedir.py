"""The node mirror's folders and files, trusted only where this process's user made them.

A node mirror lives in a folder with a predictable name (``/dev/shm/deltasync-<uid>/<run key>``: the
run key is a hash of the store's URL) in a directory every local user may write (``/dev/shm``,
``/tmp``: sticky, mode 1777). Another user can create that name first, or plant a symbolic link
under it; an engine that built into such a folder would let that user read the weights, swap a
version's data, or make it write through a link to a file of their choice. So:

- **The root** (``deltasync-<uid>``, or the folder ``DELTASYNC_NODE_DIR`` / ``node_dir`` names) is
  created with mode 0700, or, when it exists, opened with ``O_NOFOLLOW | O_DIRECTORY`` and checked
  with ``fstat``: a directory (not a symbolic link), owned by this process's effective uid, with no
  group or other permission (``mode & 0o077 == 0``). Anything else is refused with
  :class:`~deltasync.errors.UnsafePath` naming the path, what was found and the fix. The folders it
  lies in (the operator's choice: their symbolic links are resolved, ``/tmp`` -> ``/private/tmp``)
  must each be owned by root or this user and, where others may write them, sticky: otherwise
  another user could rename the root away and put theirs in its place after the check.
- **Why checking the root is enough**: a directory this user owns with mode 0700, in parents nobody
  else can rename it out of, can be entered by this user (and root) only. Nobody else can plant a
  file, a link or a folder anywhere below it, so what the node later finds there is what this user's
  processes put there, and paths below it may be used as paths.
- **Defence in depth** (a folder of an older deltasync, a bug, a same-user mistake): every folder
  below the root is made and checked the same way (:func:`private_dir`); files are created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` under names nobody can guess (:func:`write_new`, then
  ``os.replace`` within the checked folder: :func:`replace_file`); shared files (locks, the
  leader's log) are opened with ``O_NOFOLLOW`` and must be regular files this user owns
  (:func:`open_shared`); files read are opened with ``O_NOFOLLOW`` and must be regular files
  (:func:`read_regular`). File names read from an index are checked before they are joined to a
  folder (:mod:`~deltasync.serving.node.versions`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import NoReturn

from deltasync.errors import UnsafePath

__all__ = ["open_shared", "private_dir", "private_root", "read_regular", "replace_file", "write_new"]

_FIX = (
    "remove it if you did not make it, or set DELTASYNC_NODE_DIR (`node_dir` in init_info) to a folder you own "
    "with mode 0700 (`mkdir -m 700 DIR`)"
)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def private_root(path: Path | str) -> Path:
    """The node's root folder ``path``, made with mode 0700 or checked to be this user's own (see the
    module docstring); the folders it lies in are resolved and checked too. Returns the path as used
    from now on (its parents' symbolic links resolved, the root itself never one)."""
    given = Path(os.path.abspath(os.fspath(path)))
    if not given.name:  # "/"
        _refuse(given, "the file system's root", os.stat(given))
    parent = Path(os.path.realpath(given.parent))
    for folder in (parent, *parent.parents):
        _check_ancestor(folder, given)
    return private_dir(parent / given.name)


def private_dir(path: Path) -> Path:
    """``path`` as a folder of this user's only: made with mode 0700 when missing, else checked to be
    a directory (not a symbolic link) this user owns with no group or other access. Its parent is
    one checked before (:func:`private_root`)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.lstat(path)
            _refuse(path, "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory", st)
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        _refuse(path, f"owned by another user (uid {st.st_uid})", st)
    if st.st_mode & 0o077:
        _refuse(path, "open to other users (group or other permission bits)", st)
    return path


def write_new(folder: Path, prefix: str, data: bytes) -> Path:
    """A new file in ``folder`` holding ``data``, under a name nobody can guess (``.<prefix>.<random>.tmp``),
    made with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600: never an existing file or a link's target."""
    for _ in range(8):
        path = folder / f".{prefix}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return path
    raise UnsafePath(f"cannot make a new file in {folder}: eight random names were taken; {_FIX}")


def replace_file(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically: a new file (:func:`write_new`) renamed over it, in its folder."""
    tmp = write_new(path.parent, path.name, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_shared(path: Path, flags: int) -> int:
    """A descriptor of the file ``path`` that several processes share (a lock, a log), made with mode 0600
    when missing: ``flags`` (``O_RDWR``, ``O_WRONLY | O_APPEND``...) with ``O_CREAT | O_NOFOLLOW``. A
    symbolic link, or anything but a regular file of this user's, is refused (:class:`UnsafePath`)."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _refuse(path, "a symbolic link", os.lstat(path))
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _refuse(path, "not a regular file", st)
        if st.st_uid != os.geteuid():
            _refuse(path, f"owned by another user (uid {st.st_uid})", st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str) -> bytes:
    """The bytes of the regular file ``path``, opened with ``O_NOFOLLOW`` (FileNotFoundError when
    missing; a symbolic link, a FIFO or a device is refused, :class:`UnsafePath`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _refuse(Path(path), "a symbolic link", os.lstat(path))
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            _refuse(Path(path), "not a regular file", st)
        os.set_blocking(fh.fileno(), True)
        return fh.read()


def _check_ancestor(folder: Path, root: Path) -> None:
    """A folder the root lies in: owned by root or this user, and sticky where others may write it."""
    st = os.stat(folder)
    uid = os.geteuid()
    if st.st_uid not in (0, uid):
        raise UnsafePath(
            f"the node mirror folder {root} lies in {folder}, owned by another user (uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}), who could replace it: put it in a folder owned by you or root "
            "(DELTASYNC_NODE_DIR, `node_dir` in init_info)"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"the node mirror folder {root} lies in {folder} (mode {stat.S_IMODE(st.st_mode):04o}), which other "
            "users may write and which is not sticky: any of them could rename the node folder and put theirs "
            f"in its place. `chmod +t {folder}` (as /tmp and /dev/shm are) or `chmod go-w {folder}`, or set "
            "DELTASYNC_NODE_DIR (`node_dir` in init_info) to a folder in one that is not"
        )


def _refuse(path: Path, what: str, st: os.stat_result) -> NoReturn:
    raise UnsafePath(
        f"refusing the node mirror path {path}: it is {what} (owner uid {st.st_uid}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}, this process runs as uid {os.geteuid()}); another user could read or "
        f"replace the weights there. Use only a folder you own with mode 0700 (`chmod 700` one you made): {_FIX}"
    )
