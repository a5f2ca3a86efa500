"""One host mirror per node: each step of a run decoded once, in shared memory, mapped by every worker.

Every worker of every engine on a node that follows the same run (same store, same checks) shares
one directory, by default under ``/dev/shm``::

    <root>/deltasync-<uid>/<run key>/
        lock                  the leader lock (flock): held while a version is built or collected
        versions/<id>.json    a complete version: step and, per checkpoint name, its data file,
                              dtype and shape (written last, by rename: the commit point)
        data/<file>           one tensor's raw bytes; immutable once written, shared by every
                              version in which the tensor did not change

A version is built once per node, by the node's **leader** (:mod:`~deltasync.serving.node.leader`:
one process per mirror, started by the first worker that needs it): under the lock it maps the
newest version copy-on-write (``MAP_PRIVATE``: the shared files are never written), brings that
view to the step with :class:`~deltasync.DeltaFetcher` (download, checksums, digests, decode),
writes each tensor the step changed to a new data file, then the version's index. A worker that
asks for a step already built gets it at once. So the store is read once per node and step
whatever the tensor-parallel degree, and download and decode buffers live in the leader (given
back after each build): engine workers only map files.

Crash safety: a version exists only once its index is renamed into place, after every data file
it names. A leader killed half-way leaves files no index names; the next holder of the lock
deletes them (:meth:`NodeMirror.collect`). Workers load from versions only, so no engine ever
sees half a step.

Memory: the node holds one copy of the newest version, plus, for the tensors a step changed, the
version an engine may still need (the one it serves, for an undo), dropped as soon as no
collection keeps it (the newest ``keep`` versions stay). Workers keep their served version
mapped, so its pages stay alive while it is in use even once its files are collected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError, ObjectNotFound
from deltasync.serving.node.versions import Version, step_id, trim_heap, write_tensor

__all__ = ["NodeMirror", "Version", "default_root"]

log = logging.getLogger("deltasync.node")

#: versions kept by a collection: the two published last (the one engines serve and the next)
KEEP = 2
#: how long a worker waits for another's leader before giving up
LOCK_TIMEOUT = 1800.0
_FORMAT = 1


def default_root() -> Path:
    """Where node mirrors live: ``$DELTASYNC_NODE_DIR``, else ``/dev/shm`` (RAM, shared by the node's
    processes), else the temp dir; in a per-user folder."""
    env = os.environ.get("DELTASYNC_NODE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"deltasync-{os.getuid()}"


def run_key(url: str, verify: object, signing_key: bytes | None) -> str:
    """The folder name of a run's node mirror: engines share it when they read the same run the same way."""
    h = hashlib.sha256()
    h.update(url.encode())
    h.update(b"\0" + repr(verify).encode())
    h.update(b"\0" + hashlib.sha256(signing_key or b"").digest())
    return h.hexdigest()[:24]


class NodeLock:
    """The node mirror's leader lock (``flock``): released by the kernel when its holder dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, timeout: float = LOCK_TIMEOUT, stop: threading.Event | None = None) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
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


class NodeMirror:
    """A run's versions in one node-shared folder (see the module docstring).

    fetcher: reads the run (its ``verify`` and signing key decide what is proven); its store's URL
        names the folder. root: the parent folder (default :func:`default_root`).
    spawn: build versions in the node's leader process (default: when the store can be opened from
        its URL in another process, i.e. not ``memory://``); False builds in the calling thread.
    register: count this object among the mirror's users (the leader itself does not).
    max_bytes: the most a version allocated from the run's inventory may take.
    keep: versions a collection keeps (newest first).
    """

    def __init__(
        self,
        fetcher: Any,
        *,
        root: Path | str | None = None,
        spawn: bool | None = None,
        max_bytes: int | None = None,
        keep: int = KEEP,
        lock_timeout: float = LOCK_TIMEOUT,
        register: bool = True,
    ) -> None:
        self.fetcher = fetcher
        url = fetcher.store.url
        in_process = url.startswith("memory://")  # another process cannot open it
        self.spawn = spawn if spawn is not None else not in_process
        self._private: Path | None = None
        if root is None and in_process:  # a memory store's name is not a run's identity: never shared
            root = self._private = Path(tempfile.mkdtemp(prefix="deltasync-node-"))
        self.root = Path(root) if root is not None else default_root()
        self.dir = self.root / run_key(url, fetcher.verify, fetcher.signing_key)
        self.data = self.dir / "data"
        self.versions = self.dir / "versions"
        self.users = self.dir / "users"
        for d in (self.root, self.dir, self.data, self.versions, self.users):
            d.mkdir(mode=0o700, exist_ok=True)
        self._user = self._register() if register else (-1, self.users / "-")
        self.max_bytes = max_bytes
        self.keep = keep
        self.lock_timeout = lock_timeout
        self._stop = threading.Event()
        #: versions this process built (its leaders included), for tests and metrics
        self.built: list[Version] = []
        #: sees each phase the leader reports, with its pid (see :mod:`~deltasync.serving.node.leader`)
        self.on_phase: Callable[[int, str], None] | None = None
        #: the leader waits for a go-ahead after each phase (tests)
        self.pace = False

    # ------------------------------------------------------------------ reading

    def _read(self, path: Path) -> Version | None:
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise DeltaSyncError(f"the node mirror's index {path} is unreadable ({exc}); delete {self.dir}") from exc
        files = {n: (str(f), str(d), tuple(int(x) for x in s)) for n, (f, d, s) in doc["files"].items()}
        return Version(
            doc["id"],
            doc["step"],
            files,
            self.data,
            doc.get("stats", {}),
            doc.get("digest"),
            doc.get("base"),
            doc.get("positions", {}),
        )

    def all_versions(self) -> list[Version]:
        """Every complete version, oldest first (unknown steps first)."""
        out = [v for p in self.versions.glob("*.json") if (v := self._read(p)) is not None]
        return sorted(out, key=lambda v: (-1 if v.step is None else v.step, v.id))

    def _digest(self, step: int) -> str | None:
        try:
            return str(self.fetcher.reader.committed(step).digest)
        except ObjectNotFound:
            return None  # not committed (an engine checkpoint marked with a step of another run)

    def current(self, version: Version | None) -> bool:
        """Whether ``version`` is the run's step as committed now (not a step of an older run that was
        deleted and re-created at the same URL); versions of an unknown step are not."""
        return (
            version is not None
            and version.step is not None
            and version.digest is not None
            and version.digest == self._digest(version.step)
        )

    def version(self, step: int) -> Version | None:
        """The complete version of ``step``, if the node has it (for the run as committed now)."""
        have = self._read(self.versions / f"{step_id(step)}.json")
        return have if self.current(have) else None

    # ------------------------------------------------------------------ writing

    def _publish(
        self,
        vid: str,
        step: int | None,
        files: Mapping[str, tuple[str, str, tuple[int, ...]]],
        stats: Mapping[str, Any],
        base: str | None = None,
        positions: Mapping[str, str] | None = None,
    ) -> Version:
        digest = None if step is None else self._digest(step)
        positions = dict(positions or {})
        doc = {
            "format": _FORMAT,
            "id": vid,
            "step": step,
            "digest": digest,
            "files": {n: list(f) for n, f in files.items()},
            "stats": dict(stats),
            "base": base,
            "positions": positions,
        }
        tmp = self.versions / f".{vid}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.versions / f"{vid}.json")
        return Version(vid, step, dict(files), self.data, dict(stats), digest, base, positions)

    def _new_file(self, tensor: Any) -> tuple[str, str, tuple[int, ...]]:
        name = secrets.token_hex(12) + ".bin"
        self._write(name, tensor)
        return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)

    def _new_positions(self, positions: Any, numel: int) -> str:
        import torch

        small = numel < 2**31
        name = secrets.token_hex(12) + (".i32" if small else ".i64")
        self._write(name, positions.to(torch.int32) if small else positions)
        return name

    def _write(self, name: str, tensor: Any) -> None:
        """A new data file; a full filesystem is one clear error (the caller's collection removes what
        the unfinished version wrote: no version names it)."""
        path = self.data / name
        try:
            write_tensor(path, tensor)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            path.unlink(missing_ok=True)
            raise DeltaSyncError(_no_room(self.root, self.keep)) from exc

    def seed(
        self,
        tensors: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        step: int | None,
        *,
        seed_id: str | None = None,
        check: Callable[[Mapping[str, tuple[Any, tuple[int, ...]]]], None] | None = None,
    ) -> Version:
        """The version of an engine's own checkpoint: the node's version of ``step`` when it has one of
        the same layout, else the one seeded from the same source (``seed_id``), else a new version
        written from ``tensors`` (a callable is called only then). ``check`` sees the layout first."""
        vid = step_id(step) if step is not None else f"seed-{_safe_id(seed_id)}"

        def found() -> Version | None:
            have = self._read(self.versions / f"{vid}.json")
            if have is None or (step is not None and not self.current(have)):
                return None
            return have

        if (have := found()) is not None:
            if check is not None:
                check(have.layout())
            return have
        lock = NodeLock(self.dir / "lock")
        lock.acquire(self.lock_timeout, self._stop)
        try:
            if (have := found()) is not None:
                if check is not None:
                    check(have.layout())
                return have
            state = tensors() if callable(tensors) else tensors
            if check is not None:
                check({n: (t.dtype, tuple(t.shape)) for n, t in state.items()})
            self.collect()
            try:
                files = {n: self._new_file(t) for n, t in state.items()}
            except BaseException:
                self.collect()  # what was written names no version
                raise
            del state
            trim_heap()
            seeded = self._publish(vid, step, files, {"seeded": True, "seed_id": seed_id})
            self._warn_if_tight(sum((self.data / f).stat().st_size for f, _, _ in files.values()))
            return seeded
        finally:
            lock.release()

    def _warn_if_tight(self, model_bytes: int) -> None:
        """Say at init, not at the first update, when the next version may not fit: a step that changes
        every tensor writes the model again (plus the positions of its changes)."""
        try:
            free = shutil.disk_usage(self.data).free
        except OSError:
            return
        if free < model_bytes:
            log.warning(
                "the node mirror in %s has %.1f MiB free after seeding %.1f MiB: an update that changes most "
                "tensors needs up to that much again and will fail (%s)",
                self.root,
                free / 2**20,
                model_bytes / 2**20,
                "give it more room: `--shm-size`/`--ipc=host` in a container, or `node_dir`/DELTASYNC_NODE_DIR",
            )

    def mapped(
        self, get: Callable[[], Version], *, reuse: Mapping[str, Any] | None = None, read_only: bool = False
    ) -> tuple[Version, dict[str, Any]]:
        """``get()``'s version and its tensors, mapped: once mapped, a version's data outlives its
        collection. A version collected between the two is asked for again. ``reuse`` and
        ``read_only``: see :meth:`Version.tensors`."""
        for _ in range(3):
            version = get()
            try:
                return version, version.tensors(reuse=reuse, read_only=read_only)
            except FileNotFoundError:
                log.info("node mirror: version %s was collected before it was mapped; asking again", version.id)
        raise DeltaSyncError(f"the node mirror {self.dir} keeps collecting the version asked for; retry the update")

    def ensure(self, step: int) -> Version:
        """The node's version of ``step``, built now (once per node) when it has none."""
        have = self.version(step)
        if have is not None:
            return have
        if self.spawn:
            from deltasync.serving.node import _link

            config = {
                "dir": str(self.dir),
                "store": self.fetcher.store.url,
                "verify": self.fetcher.verify,
                "signing_key": None if self.fetcher.signing_key is None else self.fetcher.signing_key.hex(),
                "max_bytes": self.max_bytes,
            }
            try:
                stats = _link.request(
                    self.dir, config, step, on_phase=self.on_phase, pace=self.pace, timeout=self.lock_timeout
                )
            except DeltaSyncError:
                self._tidy()  # a leader that died leaves files no version names
                raise
        else:
            from deltasync.serving.node._build import build

            stats = self.build_locked(step, lambda: build(self, step))
        have = self.version(step)
        if have is None:
            raise DeltaSyncError(f"the node mirror's leader answered without publishing step {step}; retry the update")
        if stats:  # built for this request (empty: another worker's request built it)
            log.info("node mirror: step %d built (%s)", step, stats)
            self.built.append(have)
        return have

    def _tidy(self) -> None:
        """Collect now if nobody holds the lock (else its holder collects)."""
        lock = NodeLock(self.dir / "lock")
        try:
            lock.acquire(timeout=0.0)
        except DeltaSyncError:
            return
        try:
            self.collect()
        finally:
            lock.release()

    def mark_building(self, step: int, phase: str) -> None:
        """Say who builds which step, and how far it got, in ``building.json`` (for operators)."""
        tmp = self.dir / f".building.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "phase": phase}))
        os.replace(tmp, self.dir / "building.json")

    def build_locked(self, step: int, build_it: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Under the node lock: ``build_it()`` unless the version of ``step`` exists by then (``{}``);
        collects before and after, and says who builds in ``building.json`` meanwhile."""
        lock = NodeLock(self.dir / "lock")
        lock.acquire(self.lock_timeout, self._stop)
        try:
            if self.version(step) is not None:  # built while this one waited for the lock
                return {}
            self.collect()
            self.mark_building(step, "waiting")
            try:
                return build_it()
            finally:
                (self.dir / "building.json").unlink(missing_ok=True)
        finally:
            try:
                self.collect()
            finally:
                lock.release()

    # --------------------------------------------------------------- collection

    def _by_publication(self) -> list[Version]:
        """Every complete version, in the order they were published (the newest last)."""
        found = []
        for p in self.versions.glob("*.json"):
            try:
                published = p.stat().st_mtime_ns  # the index is renamed into place once, when published
                v = self._read(p)
            except FileNotFoundError:
                continue
            if v is not None:
                found.append((published, v.id, v))
        return [v for _, _, v in sorted(found, key=lambda x: (x[0], x[1]))]

    def collect(self) -> None:
        """Under the lock: drop versions beyond the ``keep`` published last and the data files no version
        names (a dead leader's leftovers included). Last published, not highest step: the node may hold
        newer steps than the one just built (an engine ahead of this one, or engines killed before they
        could clean up), and the version just built must outlive its build."""
        versions = self._by_publication()
        keep = versions[-self.keep :] if self.keep else []
        for v in versions:
            if v not in keep:
                (self.versions / f"{v.id}.json").unlink(missing_ok=True)
        live = {f for v in keep for f, _, _ in v.files.values()} | {f for v in keep for f in v.positions.values()}
        for p in self.data.iterdir():
            if p.name not in live:
                p.unlink(missing_ok=True)
        for p in [*self.versions.glob(".*.tmp"), *self.dir.glob(".building.*.tmp")]:
            p.unlink(missing_ok=True)

    def nbytes_on_disk(self) -> int:
        """Bytes of the node's data files (what the mirror holds in shared memory)."""
        total = 0
        for p in self.data.iterdir():
            with contextlib.suppress(FileNotFoundError):  # collected meanwhile
                total += p.stat().st_size
        return total

    def _register(self) -> tuple[int, Path]:
        """Announce this user of the node mirror: a file it holds locked while it lives."""
        tmp = self.users / f".{os.getpid()}-{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = tmp.with_name(tmp.name[1:].removesuffix(".tmp") + ".lock")
        os.replace(tmp, path)
        return fd, path

    def users_alive(self) -> bool:
        """Whether another live process uses this mirror (the files of dead ones are removed)."""
        for p in self.users.glob("*.lock"):
            if p == self._user[1]:
                continue
            try:
                fd = os.open(p, os.O_RDWR)
            except FileNotFoundError:
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

    def close(self) -> None:
        """Stop using the node mirror; the last user to close deletes its versions (nobody needs them)."""
        self._stop.set()
        fd, path = self._user
        if fd < 0:
            return
        self._user = (-1, path)
        path.unlink(missing_ok=True)
        os.close(fd)
        if not self.users_alive():
            self.keep = 0
            self._tidy()  # unless a leader is building: then someone still uses it
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def _no_room(root: Path, keep: int) -> str:
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


def _safe_id(seed_id: str | None) -> str:
    """A file-name-safe id of a seed's source (a random one when it has none: not shared)."""
    if seed_id is None:
        return secrets.token_hex(8)
    return hashlib.sha256(seed_id.encode()).hexdigest()[:16]
