"""One host mirror per node: each step of a run decoded once, in shared memory, mapped by every worker.

Every worker of every engine on a node that follows the same run (same store, same checks) shares
one directory, by default under ``/dev/shm``::

    <root>/<run key>/
        lock                  the node lock (flock): held while a version is built or collected
        versions/, data/      the versions and their files (:mod:`~deltasync.serving.node.store`)
        users/                one locked file per live user of the mirror (:mod:`~deltasync.serving.node.lock`)
        spawn.lock, leader.log  starting the node's leader, and what it logs

Who does what:

- :class:`~deltasync.serving.node.store.VersionStore`: the folder, its index and data files,
  publishing and collecting versions;
- :class:`~deltasync.serving.node.lock.NodeLock` and :class:`~deltasync.serving.node.lock.NodeUsers`:
  who may write the folder, and who uses it;
- the node's **leader** (:mod:`~deltasync.serving.node.leader`, one process per mirror, started by
  the first worker that needs it, reached with :mod:`~deltasync.serving.node._link`) builds versions
  (:mod:`~deltasync.serving.node._build`): under the lock it maps the newest version copy-on-write
  (``MAP_PRIVATE``: the shared files are never written), brings that view to the step with a
  :class:`~deltasync.DeltaFetcher` of its own (download, checksums, digests, decode), writes each
  tensor the step changed to a new data file, then the version's index;
- :class:`NodeMirror`, one per worker: seeds the mirror with the engine's own checkpoint, gets the
  version of a step (from the folder, else from the leader), maps it, and leaves.

A worker that asks for a step already built gets it at once. So the store is read once per node
and step whatever the tensor-parallel degree, and download and decode buffers live in the leader
(given back after each build): engine workers only map files.

Trust: the folder's name is predictable and ``/dev/shm`` is writable by every local user, so the
root and every folder below it must be this user's own, mode 0700, never a symbolic link (anything
else is refused, :class:`~deltasync.errors.UnsafePath`); files are created ``O_EXCL | O_NOFOLLOW``
and the index's file names are checked before use (:mod:`~deltasync.serving.node._safedir`).

Crash safety: a version exists only once its index is renamed into place, after every data file
it names. A leader killed half-way leaves files no index names; the next holder of the lock
deletes them (:meth:`VersionStore.collect`). Workers load from versions only, so no engine ever
sees half a step.

Memory: the node holds one copy of the newest version, plus, for the tensors a step changed, the
version an engine may still need (the one it serves, for an undo), dropped as soon as no
collection keeps it (the newest ``keep`` versions stay). Workers keep their served version
mapped, so its pages stay alive while it is in use even once its files are collected.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError
from deltasync.fetcher import DeltaFetcher
from deltasync.serving.node import _link
from deltasync.serving.node._build import build_locked, builder_fetcher
from deltasync.serving.node._safedir import private_dir, private_root
from deltasync.serving.node.lock import LOCK_TIMEOUT, NodeLock, NodeUsers
from deltasync.serving.node.store import KEEP, VersionStore, run_key
from deltasync.serving.node.versions import Version, step_id, trim_heap

__all__ = ["NodeMirror", "default_root"]

log = logging.getLogger("deltasync.node")


def default_root() -> Path:
    """Where node mirrors live unless told: ``/dev/shm`` (RAM, shared by the node's processes), else the
    temp dir; in a per-user folder (``deltasync-<uid>``, mode 0700: one another user made first is
    refused). (The vLLM backend reads ``$DELTASYNC_NODE_DIR`` and passes it in.)"""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"deltasync-{os.getuid()}"


class NodeMirror:
    """One worker's handle on the node's mirror of a run (see the module docstring).

    fetcher: reads the run (its ``verify`` and signing key decide what is proven; its store's URL
        names the folder); only read here, never changed.
    root: the parent folder (default :func:`default_root`): made with mode 0700, or, when it exists, a
        directory (not a symbolic link) this user owns with no group or other access, in folders no
        other user can rename it out of; anything else raises :class:`~deltasync.errors.UnsafePath`
        (see :mod:`~deltasync.serving.node._safedir`). The run's folder below it is checked the same way.
    spawn: build versions in the node's leader process (default: when the store can be opened from
        its URL in another process, i.e. not ``memory://``); False builds in the calling thread, with
        a fetcher of its own (:func:`~deltasync.serving.node._build.builder_fetcher`).
    max_bytes: the most a version allocated from the run's inventory may take.
    keep: versions a collection keeps (the ones published last).
    """

    def __init__(
        self,
        fetcher: DeltaFetcher,
        *,
        root: Path | str | None = None,
        spawn: bool | None = None,
        max_bytes: int | None = None,
        keep: int = KEEP,
        lock_timeout: float = LOCK_TIMEOUT,
    ) -> None:
        url = fetcher.store.url
        in_process = url.startswith("memory://")  # another process cannot open it
        self.spawn = spawn if spawn is not None else not in_process
        self._private: Path | None = None
        if root is None and in_process:  # a memory store's name is not a run's identity: never shared
            root = self._private = Path(tempfile.mkdtemp(prefix="deltasync-node-"))
        #: the parent folder, made or checked to be this user's only (``_safedir.private_root``)
        self.root = private_root(root if root is not None else default_root())
        self.dir = private_dir(self.root / run_key(url, fetcher.verify, fetcher.signing_key))
        #: the mirror's versions (their digests checked against the run as ``fetcher`` reads it)
        self.versions = VersionStore(self.dir, fetcher.reader, keep=keep)
        #: the mirror's users, this worker among them
        self.users = NodeUsers(self.dir / "users", register=True)
        self.lock_timeout = lock_timeout
        #: what a leader this worker starts is told
        self.leader = _link.LeaderConfig(self.dir, url, fetcher.verify, fetcher.signing_key, max_bytes)
        #: the builds' own fetcher, where they run in this process
        self._builder = None if self.spawn else builder_fetcher(fetcher, max_bytes)
        self._stop = threading.Event()
        #: versions this process built (its leaders included), for tests and metrics
        self.built: list[Version] = []
        #: sees each phase the leader reports, with its pid (see :mod:`~deltasync.serving.node.leader`)
        self.on_phase: Callable[[int, str], None] | None = None
        #: the leader waits for a go-ahead after each phase (tests)
        self.pace = False

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
        versions = self.versions

        def found() -> Version | None:
            have = versions.read(vid)
            if have is None or (step is not None and not versions.current(have)):
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
            versions.collect()
            try:
                files = versions.write_pack(state.items())
            except BaseException:
                versions.collect()  # what was written names no version
                raise
            del state
            trim_heap()
            seeded = versions.publish(vid, step, files, {"seeded": True, "seed_id": seed_id})
            self._warn_if_tight(versions.file_bytes(files))
            return seeded
        finally:
            lock.release()

    def _warn_if_tight(self, model_bytes: int) -> None:
        """Say at init, not at the first update, when the next version may not fit: a step that changes
        every tensor writes the model again (plus the positions of its changes)."""
        try:
            free = shutil.disk_usage(self.versions.data).free
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
        self,
        get: Callable[[], Version],
        *,
        reuse: Mapping[tuple[str, int], Any] | None = None,
        read_only: bool = False,
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
        have = self.versions.version(step)
        if have is not None:
            return have
        if self._builder is None:
            try:
                stats = _link.request(
                    self.leader, step, on_phase=self.on_phase, pace=self.pace, timeout=self.lock_timeout
                )
            except DeltaSyncError:
                self._tidy()  # a leader that died leaves files no version names
                raise
        else:
            stats = build_locked(self.versions, self._builder, step, timeout=self.lock_timeout, stop=self._stop)
        have = self.versions.version(step)
        if have is None:
            raise DeltaSyncError(f"the node mirror's leader answered without publishing step {step}; retry the update")
        if stats:  # built for this request (empty: another worker's request built it)
            log.info("node mirror: step %d built (%s)", step, stats)
            self.built.append(have)
        return have

    def start_leader(self) -> None:
        """Start the node's leader now when it builds in one (:func:`_link.ensure_leader`), so that the
        first step asked for does not wait for it to start and compile; a failure is logged (the first
        request starts one)."""
        if self._builder is not None:
            return
        try:
            _link.ensure_leader(self.leader)
        except (OSError, DeltaSyncError) as exc:
            log.warning("cannot start the node mirror's leader yet (%s): the first update starts it", exc)

    def _tidy(self, keep: int | None = None) -> None:
        """Collect now (keeping ``keep`` versions) if nobody holds the lock (else its holder collects)."""
        lock = NodeLock(self.dir / "lock")
        try:
            lock.acquire(timeout=0.0)
        except DeltaSyncError:
            return
        try:
            self.versions.collect(keep)
        finally:
            lock.release()

    def close(self) -> None:
        """Stop using the node mirror; the last user to close deletes its versions (nobody needs them)."""
        self._stop.set()
        if not self.users.leave():
            return
        if not self.users.others_alive():
            self._tidy(keep=0)  # unless a leader is building: then someone still uses it
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def _safe_id(seed_id: str | None) -> str:
    """A file-name-safe id of a seed's source (a random one when it has none: not shared)."""
    if seed_id is None:
        return secrets.token_hex(8)
    return hashlib.sha256(seed_id.encode()).hexdigest()[:16]
