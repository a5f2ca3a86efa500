"""The node's leader: one process per node mirror that builds its versions, on request of any worker.

The first worker that needs a step the node does not have connects to the leader of its node
mirror (a Unix socket in the abstract namespace, named after the mirror's folder; both ends check
that the other runs as the same user) and starts it when there is none::

    python -m deltasync.serving.node.leader     (config on stdin, "ready" on stdout)

The leader lives in its own session (an engine that stops does not take it down mid-build) and
builds one version at a time under the node lock (:func:`deltasync.serving.node._build.build_locked`),
each with a fetcher of its own (a fresh reader per request, with the ``max_bytes`` it was started with):
downloads, checks and decodes in its own memory (given back to the OS after each build), so engine
workers only map files. It leaves when no engine uses the mirror any more, and then deletes the
versions engines that were killed (and never closed the mirror) left behind. While it builds, the
folder holds ``building.json`` (its pid and the step) for operators.

Protocol, one JSON object per line: the worker sends ``{"step": N, "pace": false}`` (at most
:data:`MAX_REQUEST` bytes, within :data:`REQUEST_TIMEOUT` seconds of connecting; anything else, a
line that is not a JSON object of those types included, is answered with a
:class:`~deltasync.errors.ProtocolError` and the leader serves the next worker); the leader
answers ``{"phase": ...}`` lines (``start``, ``synced``, ``wrote``, ``publish``; with ``pace`` it
waits for a newline after each, so tests can stop it at an exact point), then ``{"stats": {...}}`` or
``{"error": code, "message": ...}`` (the error's stable code, :func:`deltasync.errors.error_code`). A leader that dies mid-build answers nothing more: the
worker raises, nothing of the step was published (a version exists only once its index is in
place), and the next request starts a new leader.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from typing import Any

from deltasync._util.worker import run_in_background
from deltasync.errors import DeltaSyncError, ProtocolError, error_code
from deltasync.fetcher import DeltaFetcher
from deltasync.serving.node._build import build_locked, builder_fetcher
from deltasync.serving.node._link import LeaderConfig, peer, socket_name
from deltasync.serving.node.lock import LOCK_TIMEOUT, NodeLock, NodeUsers
from deltasync.serving.node.store import VersionStore, run_key
from deltasync.serving.node.versions import trim_heap
from deltasync.storage import Store

__all__ = ["main"]

log = logging.getLogger("deltasync.node")

#: seconds between the leader's checks that some engine still uses its mirror
CHECK_INTERVAL = 2.0
#: the longest request line a leader reads (a worker's is ~30 bytes)
MAX_REQUEST = 4096
#: seconds a worker has to send its request once connected (a silent one must not hold the others)
REQUEST_TIMEOUT = 30.0


def parse_request(line: bytes) -> tuple[int, bool]:
    """The (step, pace) of a worker's request line; :class:`ProtocolError` for anything else."""
    if len(line) > MAX_REQUEST or not line.endswith(b"\n"):
        raise ProtocolError(f"a node leader request is one JSON line of at most {MAX_REQUEST} bytes")
    try:
        job = json.loads(line)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ProtocolError(f"a node leader request is not JSON: {exc}") from None
    if not isinstance(job, dict):
        raise ProtocolError(f'a node leader request is a JSON object {{"step": N, "pace": false}}, not {line[:80]!r}')
    step, pace = job.get("step"), job.get("pace", False)
    if type(step) is not int or step < 0:
        raise ProtocolError(f"a node leader request's step is a non-negative integer, not {step!r}"[:200])
    if not isinstance(pace, bool):
        raise ProtocolError(f"a node leader request's pace is true or false, not {pace!r}"[:200])
    return step, pace


# ------------------------------------------------------------------------------------ the leader


class Leader:
    """One node mirror's leader: its folder, the mirror's users (it is not one of them), the run."""

    def __init__(self, config: LeaderConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.users = NodeUsers(config.dir / "users", register=False)

    def versions(self) -> tuple[VersionStore, DeltaFetcher]:
        """The mirror's versions and a fetcher of the build's own, both over a fresh reader: nothing
        cached from a run that was deleted and re-created at this URL."""
        c = self.config
        fetcher = builder_fetcher(DeltaFetcher(self.store, verify=c.verify, signing_key=c.signing_key), c.max_bytes)
        return VersionStore(c.dir, fetcher.reader), fetcher

    def serve_one(self, conn: socket.socket) -> None:
        """Answer one worker's request (see the module docstring)."""
        _, uid = peer(conn)
        if uid != os.getuid():
            return
        conn.settimeout(REQUEST_TIMEOUT)  # TimeoutError (an OSError): the next worker's turn
        with conn.makefile("rb") as lines:
            first = lines.readline(MAX_REQUEST + 1)
            if not first.strip():
                return  # a worker that only made sure the leader runs (``_link.ensure_leader``)
            try:
                step, pace = parse_request(first)
                conn.settimeout(None)  # a build takes what it takes (a worker that leaves is seen on send)
                versions, fetcher = self.versions()  # UnsafePath: the folder is no longer this user's only
            except DeltaSyncError as exc:
                log.warning("refused a request: %s", exc)
                conn.sendall(json.dumps({"error": error_code(exc), "message": str(exc)}).encode() + b"\n")
                return

            asker = [True]  # the worker that asked is still there

            def phase(name: str) -> None:
                if asker[0]:
                    try:
                        conn.sendall(json.dumps({"phase": name}).encode() + b"\n")
                    except OSError:
                        asker[0] = False  # it went away (its engine died): finish the build for the others
                # after the worker was told: what an operator (or a test) reads is never ahead of it
                versions.mark_building(step, name)
                if pace and asker[0] and not lines.readline():
                    asker[0] = False

            try:
                if versions.version(step) is not None:
                    reply: dict[str, Any] = {"stats": {}}
                else:
                    reply = {"stats": build_locked(versions, fetcher, step, phase=phase, timeout=LOCK_TIMEOUT)}
            except DeltaSyncError as exc:
                reply = {"error": error_code(exc), "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - a bug must reach the worker, not kill the leader
                log.exception("building step %d failed", step)
                reply = {"error": DeltaSyncError.code, "message": f"the leader failed: {type(exc).__name__}: {exc}"}
            finally:
                trim_heap()
            if asker[0]:
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def leave(self, server: socket.socket) -> bool:
        """Whether the leader may exit now: no engine uses the mirror. Then it stops listening and deletes
        the versions engines that were killed (and so never closed the mirror) left in shared memory."""
        lock = NodeLock(self.config.dir / "lock")
        try:
            lock.acquire(timeout=0.0)
        except DeltaSyncError:
            return False  # a new leader or a seeding engine holds it: someone uses the mirror
        try:
            if self.users.others_alive():
                return False  # one registered since the last check
            server.close()  # from here a worker that asks starts a new leader
            versions, _ = self.versions()
            versions.collect(keep=0)
            return True
        finally:
            lock.release()


def _unpin() -> None:
    """Run on every CPU this process may use: vLLM pins each worker to its own cores, and the leader,
    started by one of them, would otherwise share that worker's cores with its busy threads (the
    starter also drops the OpenMP binding it would inherit: ``_link._BINDING``)."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            log.debug("cannot widen the leader's CPU affinity", exc_info=True)


def warm_up() -> None:
    """Compile what a build runs (the codec's kernels are compiled at their first use in a process, a few
    seconds on a busy machine, tens on a starved one) by coding and decoding a few made-up changes at
    the densities patches have: the leader does it as soon as it starts, so that the first step it
    builds pays only its own work."""
    import numpy as np

    from deltasync.protocol import kernels
    from deltasync.protocol.encoding import encode_changes
    from deltasync.protocol.positions import decode_positions
    from deltasync.protocol.values import decode_values

    rng = np.random.default_rng(0)
    numel = 1 << 18
    base = rng.integers(-(1 << 15), 1 << 15, numel, dtype=np.int16)
    for density in (0.001, 0.05, 0.3, 0.7):
        idx = np.sort(rng.choice(numel, int(numel * density), replace=False)).astype(np.int64)
        old = base[idx]
        new = (old ^ rng.integers(1, 1 << 7, idx.size, dtype=np.int16)).astype(np.int16)
        e = encode_changes(numel, idx, old, new)
        got = decode_positions(e.pos_blob, e.positions, e.rice_k, e.count, numel, "warm-up")
        vals = decode_values(e.val_blob, e.values, e.count, np.dtype(np.int16), "warm-up")
        kern = kernels.impl()
        if kern is not None and e.positions != "dense":
            arr, keep = base.copy(), np.empty(got.size, dtype=np.int16)
            (kern.xor_apply if e.values == "xor-rank" else kern.set_apply)(arr, got, vals, keep)


def _warm_in_background() -> None:
    def run() -> None:
        try:
            warm_up()
        except Exception:  # noqa: BLE001 - only a head start: a build compiles what it needs anyway
            log.warning("the leader's warm-up failed", exc_info=True)

    run_in_background(run, "deltasync-leader-warm-up")


def main() -> int:
    """The leader process (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = LeaderConfig.from_json(sys.stdin.readline())
    _unpin()
    from deltasync.storage import open_store

    store = open_store(config.store)
    directory = config.dir.parent / run_key(store.url, config.verify, config.signing_key)
    if directory != config.dir:
        print(f"this leader would build into {directory}, not {config.dir}", flush=True)
        return 2
    leader = Leader(config, store)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(socket_name(config.dir))
    except OSError:
        print("another leader serves this mirror", flush=True)
        return 0
    server.listen(64)
    server.settimeout(CHECK_INTERVAL)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the starter stops reading: nothing else may go to that pipe
    os.close(devnull)
    _warm_in_background()  # the first build, often requested within seconds, need not compile
    idle_checks = 0
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            idle_checks = 0 if leader.users.others_alive() else idle_checks + 1
            if idle_checks >= 2 and leader.leave(server):
                return 0  # no engine uses this mirror any more
            continue
        with conn:
            try:
                leader.serve_one(conn)
            except (OSError, ValueError) as exc:  # the worker went away, or was too slow to ask
                log.warning("a request failed: %s", exc)
            except Exception:  # noqa: BLE001 - one request's failure never stops the node's leader
                log.exception("a request failed")


if __name__ == "__main__":
    sys.exit(main())
