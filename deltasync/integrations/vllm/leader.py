"""The node's leader: one process per node mirror that builds its versions, on request of any worker.

The first worker that needs a step the node does not have connects to the leader of its node
mirror (a Unix socket in the abstract namespace, named after the mirror's folder; both ends check
that the other runs as the same user) and starts it when there is none::

    python -m deltasync.integrations.vllm.leader     (config on stdin, "ready" on stdout)

The leader lives in its own session (an engine that stops does not take it down mid-build) and
builds one version at a time under the node lock (:func:`deltasync.integrations.vllm.node.build`):
downloads, checks and decodes in its own memory (given back to the OS after each build), so engine
workers only map files. It leaves when no engine uses the mirror any more. While it builds, the
folder holds ``building.json`` (its pid and the step) for operators.

Protocol, one JSON object per line: the worker sends ``{"step": N, "pace": false}``; the leader
answers ``{"phase": ...}`` lines (``start``, ``synced``, ``wrote``, ``publish``; with ``pace`` it
waits for a newline after each, so tests can stop it at an exact point), then ``{"stats": {...}}`` or
``{"error": class name, "message": ...}``. A leader that dies mid-build answers nothing more: the
worker raises, nothing of the step was published (a version exists only once its index is in
place), and the next request starts a new leader.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltasync import errors
from deltasync.errors import DeltaSyncError

if TYPE_CHECKING:
    from deltasync.integrations.vllm.node import NodeMirror

__all__ = ["request", "socket_name"]

log = logging.getLogger("deltasync.node")

#: seconds a new leader may take to import and say it is ready
START_TIMEOUT = 300.0
#: seconds between the leader's checks that some engine still uses its mirror
CHECK_INTERVAL = 2.0
#: connections to a leader that vanishes without a word, tried before giving up
SILENT_RETRIES = 8
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def socket_name(node_dir: Path) -> bytes:
    """The abstract socket name of ``node_dir``'s leader."""
    digest = hashlib.sha256(str(node_dir.absolute()).encode()).hexdigest()[:32]
    return f"\0deltasync-leader-{os.getuid()}-{digest}".encode()


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _connect(node_dir: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_name(node_dir))
    except OSError:
        sock.close()
        return None
    _, uid = _peer(sock)
    if uid != os.getuid():
        sock.close()
        raise DeltaSyncError(
            f"the node mirror leader socket of {node_dir} belongs to user {uid}, not to this user "
            f"({os.getuid()}): another user's process holds its name; stop it or set DELTASYNC_NODE_DIR"
        )
    return sock


_children: list[subprocess.Popen[bytes]] = []  # leaders this process started (reaped by a thread each)


def _start(node: NodeMirror) -> socket.socket:
    """Connect to the node's leader, starting it first when there is none (one starter at a time)."""
    with open(node.dir / "spawn.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(node.dir)
        if sock is not None:
            return sock
        config = {
            "dir": str(node.dir),
            "store": node.fetcher.store.url,
            "verify": node.fetcher.verify,
            "signing_key": None if node.fetcher.signing_key is None else node.fetcher.signing_key.hex(),
            "max_bytes": node.max_bytes,
        }
        with open(node.dir / "leader.log", "ab") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deltasync.integrations.vllm.leader"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,  # outlives a stopping engine mid-build; leaves when unused
            )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(config).encode() + b"\n")
        proc.stdin.close()
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        _children.append(proc)
        threading.Thread(target=proc.wait, name="deltasync-leader-reaper", daemon=True).start()
        if line.strip() != b"ready":
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise DeltaSyncError(
                f"the node mirror's leader did not start (see {node.dir / 'leader.log'}): {line.decode(errors='replace')!r}"
            )
        sock = _connect(node.dir)
        if sock is None:
            raise DeltaSyncError(
                f"the node mirror's leader started but does not answer (see {node.dir / 'leader.log'})"
            )
        return sock


def request(
    node: NodeMirror,
    step: int,
    *,
    on_phase: Callable[[int, str], None] | None = None,
    pace: bool = False,
    timeout: float,
) -> dict[str, Any]:
    """Ask the node's leader to build ``step``; its build stats (``{}`` when it found the version built)."""
    wait = 0.05
    for _ in range(SILENT_RETRIES):
        pid, heard, reply = _ask(node, step, on_phase, pace, timeout)
        if reply or heard:
            break
        # connected to a leader that went away before saying a word (killed just now): a new one starts
        time.sleep(wait)
        wait = min(2 * wait, 1.0)
    if "stats" in reply:
        stats: dict[str, Any] = reply["stats"]
        return stats
    if "error" in reply:
        cls = getattr(errors, str(reply["error"]), None)
        if not (isinstance(cls, type) and issubclass(cls, DeltaSyncError)):
            cls = DeltaSyncError
        raise cls(str(reply["message"]))
    raise DeltaSyncError(
        f"the node mirror's leader (pid {pid}) died while building step {step}; nothing of that step was "
        f"published and the next update starts a new leader (see {node.dir / 'leader.log'})"
    )


def _ask(
    node: NodeMirror, step: int, on_phase: Callable[[int, str], None] | None, pace: bool, timeout: float
) -> tuple[int, bool, dict[str, Any]]:
    """One request: (the leader's pid, whether it said anything, its final answer or ``{}``)."""
    sock = _start(node)
    heard = False
    with sock:
        pid, _ = _peer(sock)
        sock.settimeout(timeout)
        try:
            sock.sendall(json.dumps({"step": step, "pace": pace}).encode() + b"\n")
            with sock.makefile("rb") as lines:
                for line in lines:
                    msg = json.loads(line)
                    heard = True
                    if "phase" not in msg:
                        return pid, heard, msg
                    if on_phase is not None:
                        on_phase(pid, str(msg["phase"]))
                    if pace:
                        sock.sendall(b"\n")
        except TimeoutError:
            raise DeltaSyncError(
                f"the node mirror's leader (pid {pid}) has not finished step {step} in {timeout:.0f} s; see "
                f"{node.dir / 'leader.log'}"
            ) from None
        except (OSError, ValueError):
            pass  # it died mid-answer
    return pid, heard, {}


# ------------------------------------------------------------------------------------ the leader


def _serve_one(node: NodeMirror, conn: socket.socket, fetcher: Callable[[], Any]) -> None:
    from deltasync.integrations.vllm.node import build, trim_heap

    _, uid = _peer(conn)
    if uid != os.getuid():
        return
    # a fresh reader per request: nothing cached from a run that was deleted and re-created at this URL
    node.fetcher = fetcher()
    with conn.makefile("rb") as lines:
        job = json.loads(lines.readline())
        step, pace = int(job["step"]), bool(job.get("pace"))

        def phase(name: str) -> None:
            conn.sendall(json.dumps({"phase": name}).encode() + b"\n")
            # after the worker was told: what an operator (or a test) reads is never ahead of it
            node.mark_building(step, name)
            if pace:
                lines.readline()

        try:
            if node.version(step) is not None:
                reply: dict[str, Any] = {"stats": {}}
            else:
                reply = {"stats": node.build_locked(step, lambda: build(node, step, phase))}
        except DeltaSyncError as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a bug must reach the worker, not kill the leader
            log.exception("building step %d failed", step)
            reply = {"error": "DeltaSyncError", "message": f"the leader failed: {type(exc).__name__}: {exc}"}
        finally:
            trim_heap()
        conn.sendall(json.dumps(reply).encode() + b"\n")


def main() -> int:
    """The leader process (see the module docstring)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads(sys.stdin.readline())
    from deltasync.fetcher._fetcher import DeltaFetcher
    from deltasync.integrations.vllm.node import NodeMirror
    from deltasync.storage import open_store

    key = bytes.fromhex(config["signing_key"]) if config["signing_key"] else None
    store = open_store(config["store"])

    def fetcher() -> DeltaFetcher:
        return DeltaFetcher(store, verify=config["verify"], signing_key=key)

    directory = Path(config["dir"])
    node = NodeMirror(fetcher(), root=directory.parent, spawn=False, max_bytes=config["max_bytes"], register=False)
    if node.dir != directory:
        print(f"this leader would build into {node.dir}, not {directory}", flush=True)
        return 2
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(socket_name(directory))
    except OSError:
        print("another leader serves this mirror", flush=True)
        return 0
    server.listen(64)
    server.settimeout(CHECK_INTERVAL)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the starter stops reading: nothing else may go to that pipe
    os.close(devnull)
    idle_checks = 0
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            idle_checks = 0 if node.users_alive() else idle_checks + 1
            if idle_checks >= 2:
                return 0  # no engine uses this mirror any more
            continue
        with conn:
            try:
                _serve_one(node, conn, fetcher)
            except (OSError, ValueError) as exc:  # the worker went away or sent garbage
                log.warning("a request failed: %s", exc)


if __name__ == "__main__":
    sys.exit(main())
