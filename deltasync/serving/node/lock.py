"""Who may write a node mirror, and who uses it: the node lock and the user registry.

Both rest on ``flock``, so the kernel releases them when their holder dies, even by ``SIGKILL``:
a lock a killed leader held is free again at once, and a killed engine stops counting as a user.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import threading
import time
from pathlib import Path

from deltasync.errors import DeltaSyncError
from deltasync.serving.node._safedir import open_shared, private_dir

__all__ = ["LOCK_TIMEOUT", "NodeLock", "NodeUsers"]

#: how long a worker waits for another's leader before giving up
LOCK_TIMEOUT = 1800.0


class NodeLock:
    """The node mirror's lock (``flock`` on its ``lock`` file): whoever holds it may write versions and
    collect them. One object per acquisition."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, timeout: float = LOCK_TIMEOUT, stop: threading.Event | None = None) -> None:
        """Wait for the lock up to ``timeout`` seconds (0: try once), or until ``stop`` is set; raises
        :class:`DeltaSyncError` when it stays held."""
        fd = open_shared(self.path, os.O_RDWR)  # never through a link, only a regular file of ours
        deadline = time.monotonic() + timeout
        wait = 0.01
        waiter = stop or threading.Event()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if time.monotonic() >= deadline or waiter.wait(wait):
                    raise DeltaSyncError(
                        f"another process has held the node mirror's lock {self.path} for over {timeout:.0f} s "
                        "(a leader that hangs?); find it with `fuser` and stop it, then retry the update"
                    )
                wait = min(wait * 2, 0.2)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the lock
            self.fd = None


class NodeUsers:
    """The users of a node mirror (its ``users/`` folder): each live user holds a file there locked.

    register: count this process among them (an engine's worker does; the leader does not). Its
    file is ``path`` and its descriptor ``fd`` (-1 once it left).
    """

    def __init__(self, directory: Path, *, register: bool) -> None:
        self.dir = directory
        private_dir(directory)  # mode 0700, this user's, not a link (see ``_safedir``)
        self.fd = -1
        self.path: Path | None = None
        if register:
            tmp = directory / f".{os.getpid()}-{secrets.token_hex(6)}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = tmp.with_name(tmp.name[1:].removesuffix(".tmp") + ".lock")
            os.replace(tmp, path)
            self.fd, self.path = fd, path

    def others_alive(self) -> bool:
        """Whether another live process uses the mirror (the files of dead ones are removed)."""
        for p in self.dir.glob("*.lock"):
            if p == self.path:
                continue
            try:
                fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                p.unlink(missing_ok=True)  # a link is no user's file (only this user could have put it here)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True  # held: a live user
            else:
                p.unlink(missing_ok=True)  # its user died without closing
            finally:
                os.close(fd)
        return False

    def leave(self) -> bool:
        """Stop counting this process among the users; False when it was not registered (or left)."""
        if self.fd < 0:
            return False
        fd, self.fd = self.fd, -1
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        os.close(fd)
        return True
