"""Talking to the node's leader (see :mod:`deltasync.serving.node.leader`): find it, start it when
there is none (with its :class:`LeaderConfig`), ask it for a step. Used by
:class:`~deltasync.serving.node.mirror.NodeMirror`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from deltasync._util.worker import run_in_background
from deltasync.errors import DeltaSyncError, from_code
from deltasync.fetcher import Verify
from deltasync.serving.node._safedir import open_shared

__all__ = ["LeaderConfig", "ensure_leader", "peer", "request", "socket_name"]

#: seconds a new leader may take to import and say it is ready
START_TIMEOUT = 300.0
#: connections to a leader that vanishes without a word, tried before giving up
SILENT_RETRIES = 8
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
#: thread-binding settings of the worker that starts the leader (vLLM's CPU workers pin OpenMP to their
#: own cores with them): the leader, which serves every worker of the node, must not inherit them
_BINDING = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    """What a node's leader needs: the mirror's folder, how to read the run (its store's URL, the
    checks, the signing key) and the most a version built from the run's inventory may take. Sent to
    a leader it starts as one JSON line on its stdin."""

    dir: Path
    store: str
    verify: Verify
    signing_key: bytes | None
    max_bytes: int | None

    def to_json(self) -> str:
        """The line a leader reads (the signing key in hex)."""
        key = None if self.signing_key is None else self.signing_key.hex()
        return json.dumps(
            {
                "dir": str(self.dir),
                "store": self.store,
                "verify": self.verify,
                "signing_key": key,
                "max_bytes": self.max_bytes,
            }
        )

    @classmethod
    def from_json(cls, line: str | bytes) -> LeaderConfig:
        """The config a leader was started with (see :meth:`to_json`)."""
        doc = json.loads(line)
        key = bytes.fromhex(doc["signing_key"]) if doc["signing_key"] else None
        return cls(Path(doc["dir"]), doc["store"], doc["verify"], key, doc["max_bytes"])


def socket_name(node_dir: Path) -> bytes:
    """The abstract socket name of ``node_dir``'s leader."""
    digest = hashlib.sha256(str(node_dir.absolute()).encode()).hexdigest()[:32]
    return f"\0deltasync-leader-{os.getuid()}-{digest}".encode()


def peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _connect(node_dir: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_name(node_dir))
    except OSError:
        sock.close()
        return None
    _, uid = peer(sock)
    if uid != os.getuid():
        sock.close()
        raise DeltaSyncError(
            f"the node mirror leader socket of {node_dir} belongs to user {uid}, not to this user "
            f"({os.getuid()}): another user's process holds its name; stop it or set DELTASYNC_NODE_DIR"
        )
    return sock


_children: list[subprocess.Popen[bytes]] = []  # leaders this process started (reaped by a thread each)


def _start(config: LeaderConfig) -> socket.socket:
    """Connect to the leader of ``config.dir``, starting it first when there is none (one starter at a time)."""
    node_dir = config.dir
    # both files are opened with O_NOFOLLOW and must be this user's regular files (``_safedir``): a
    # link planted there never makes this process create or append to a file elsewhere
    with os.fdopen(open_shared(node_dir / "spawn.lock", os.O_WRONLY | os.O_APPEND), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(node_dir)
        if sock is not None:
            return sock
        with os.fdopen(open_shared(node_dir / "leader.log", os.O_WRONLY | os.O_APPEND), "ab") as log_file:
            env = {k: v for k, v in os.environ.items() if k not in _BINDING}
            proc = subprocess.Popen(
                [sys.executable, "-m", "deltasync.serving.node.leader"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,  # outlives a stopping engine mid-build; leaves when unused
            )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(config.to_json().encode() + b"\n")
        proc.stdin.close()
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        _children.append(proc)
        run_in_background(proc.wait, "deltasync-leader-reaper")
        if line.strip() != b"ready":
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise DeltaSyncError(
                f"the node mirror's leader did not start (see {node_dir / 'leader.log'}): {line.decode(errors='replace')!r}"
            )
        sock = _connect(node_dir)
        if sock is None:
            raise DeltaSyncError(
                f"the node mirror's leader started but does not answer (see {node_dir / 'leader.log'})"
            )
        return sock


def ensure_leader(config: LeaderConfig) -> None:
    """Start the leader of ``config.dir`` now when there is none (it then warms up: imports and compiles
    what a build needs), so that the first step a worker asks for pays only its build."""
    _start(config).close()


def request(
    config: LeaderConfig,
    step: int,
    *,
    on_phase: Callable[[int, str], None] | None = None,
    pace: bool = False,
    timeout: float,
) -> Mapping[str, object]:
    """Ask the leader of ``config.dir`` to build ``step`` (starting it when there is none); its build
    stats (``{}`` when it found the version built). ``on_phase`` hears of each phase the leader
    reports, with its pid; with ``pace`` the leader waits for a go-ahead after each (tests)."""
    node_dir = config.dir
    wait = 0.05
    for _ in range(SILENT_RETRIES):
        pid, heard, reply = _ask(config, step, on_phase, pace, timeout)
        if reply or heard:
            break
        # connected to a leader that went away before saying a word (killed just now): a new one starts
        time.sleep(wait)
        wait = min(2 * wait, 1.0)
    stats = reply.get("stats")
    if isinstance(stats, dict):
        return stats
    if "error" in reply:
        raise from_code(str(reply["error"]), str(reply.get("message")))
    raise DeltaSyncError(
        f"the node mirror's leader (pid {pid}) died while building step {step}; nothing of that step was "
        f"published and the next update starts a new leader (see {node_dir / 'leader.log'})"
    )


def _ask(
    config: LeaderConfig,
    step: int,
    on_phase: Callable[[int, str], None] | None,
    pace: bool,
    timeout: float,
) -> tuple[int, bool, Mapping[str, object]]:
    """One request: (the leader's pid, whether it said anything, its final answer or ``{}``)."""
    node_dir = config.dir
    sock = _start(config)
    heard = False
    with sock:
        pid, _ = peer(sock)
        sock.settimeout(timeout)
        try:
            sock.sendall(json.dumps({"step": step, "pace": pace}).encode() + b"\n")
            with sock.makefile("rb") as lines:
                for line in lines:
                    msg = json.loads(line)
                    heard = True
                    if not isinstance(msg, dict):
                        break  # not an answer of ours: as a leader that died mid-answer
                    if "phase" not in msg:
                        return pid, heard, msg
                    if on_phase is not None:
                        on_phase(pid, str(msg["phase"]))
                    if pace:
                        sock.sendall(b"\n")
        except TimeoutError:
            raise DeltaSyncError(
                f"the node mirror's leader (pid {pid}) has not finished step {step} in {timeout:.0f} s; see "
                f"{node_dir / 'leader.log'}"
            ) from None
        except (OSError, ValueError):
            pass  # it died mid-answer
    return pid, heard, {}
