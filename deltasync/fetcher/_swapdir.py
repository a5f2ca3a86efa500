"""Directory versions swapped in atomically, and the cleanup after a killed writer.

A version is a dir carrying the ``.deltasync.json`` marker. :func:`exchange` swaps two dirs with
Linux ``renameat2(RENAME_EXCHANGE)`` (libc, or the raw syscall where libc lacks it). A writer holds
an flock on the dir it builds, so :func:`recover` in another process never takes it for stale.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import platform
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltasync.protocol.checkpoint import INDEX_NAME

__all__ = ["MARKER", "exchange", "fsync_path", "lock_dir", "reached", "recover", "remove_version"]

log = logging.getLogger("deltasync.materialize")
MARKER = ".deltasync.json"
#: test hook: called with the name of each stage a write sequence reaches (a test kills the process there)
_hook: Callable[[str], None] | None = None


def reached(stage: str) -> None:
    """The write sequence (of a version, or of its removal) reached ``stage``: calls the test hook ``_hook``."""
    if _hook is not None:
        _hook(stage)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _renameat2(a: Path, b: Path, flags: int, *, use_syscall: bool = False) -> None:
    """``renameat2(AT_FDCWD, a, AT_FDCWD, b, flags)`` through libc, or the raw syscall where libc
    lacks it (glibc < 2.28); OSError with the errno on failure."""
    libc = _libc()
    fa, fb = os.fsencode(a), os.fsencode(b)
    fn = None if use_syscall else getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        rc = fn(_AT_FDCWD, fa, _AT_FDCWD, fb, flags)
    else:
        nr = _SYS_RENAMEAT2.get(platform.machine().lower())
        if nr is None:
            raise OSError(errno.ENOSYS, f"no renameat2 syscall number known for {platform.machine()}")
        libc.syscall.restype = ctypes.c_long
        args = (ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(fa), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(fb))
        rc = libc.syscall(ctypes.c_long(nr), *args, ctypes.c_uint(flags))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap two dirs atomically (Linux ``RENAME_EXCHANGE``); False where that is not supported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _renameat2(a, b, _RENAME_EXCHANGE)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, AttributeError) or exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False
        raise
    return True


def lock_dir(path: Path, *, wait: bool) -> int | None:
    """An fd holding an exclusive flock on dir ``path`` (released when the process dies); None when
    another process holds it (``wait=False``) or locks are unavailable."""
    if sys.platform == "win32":  # pragma: no cover
        return None
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def fsync_path(path: Path) -> None:
    """Flush a file or dir to disk (a dir: its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_version(path: Path) -> None:
    """Delete a version dir of ours, its marker last (a killed removal stays recognisable)."""
    for p in path.iterdir():
        if p.name == MARKER:
            continue
        reached("remove")
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    os.rmdir(path)


def _complete(path: Path) -> bool:
    try:
        index = json.loads((path / INDEX_NAME).read_text())
        return (path / MARKER).is_file() and all((path / f).is_file() for f in set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def recover(out: Path) -> list[str]:
    """Clean up after a killed run: remove its ``.{name}.tmp-*`` / ``.{name}.old-*`` dirs (only if
    they carry the marker or are empty, and no live writer holds them); where ``out`` is missing
    (killed between the two renames of the fallback), put the newest complete old version back."""
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-[0-9a-f]{{8}}")
    found: list[tuple[int, Path, int]] = []
    for p in out.parent.iterdir():
        if not pattern.fullmatch(p.name) or p.is_symlink() or not p.is_dir():
            continue
        if not (p / MARKER).is_file() and any(p.iterdir()):
            continue  # not recognisably ours
        fd = lock_dir(p, wait=False)
        if fd is None:
            continue  # a live writer's (or no locks here): leave it
        found.append((fd, p, _marker_step(p)))
    done: list[str] = []
    try:
        if not out.exists():
            olds = [(s, p) for _, p, s in found if ".old-" in p.name and _complete(p)]
            if olds:
                back = max(olds)[1]
                os.rename(back, out)
                log.warning("put back %s as %s (an earlier run was killed mid-swap)", back.name, out)
                done.append(f"restored {back.name}")
        for _, p, _ in found:
            if p.exists():
                remove_version(p)
                log.info("removed %s, left by an earlier run that was killed", p)
                done.append(f"removed {p.name}")
    finally:
        for fd, _, _ in found:
            os.close(fd)
    return done


def _marker_step(path: Path) -> int:
    try:
        return int(json.loads((path / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
