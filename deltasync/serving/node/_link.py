"""Talking to the node's leader (see :mod:`deltasync.serving.node.leader`): find it, start it when
there is none, ask it for a step. Used by :class:`~deltasync.serving.node.mirror.NodeMirror`."""

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
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deltasync.errors import DeltaSyncError, from_code

__all__ = ["peer", "request", "socket_name"]

#: seconds a new leader may take to import and say it is ready
START_TIMEOUT = 300.0
#: connections to a leader that vanishes without a word, tried before giving up
SILENT_RETRIES = 8
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
#: thread-binding settings of the worker that starts the leader (vLLM's CPU workers pin OpenMP to their
#: own cores with them): the leader, which serves every worker of the node, must not inherit them
_BINDING = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")


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


def _start(node_dir: Path, config: Mapping[str, Any]) -> socket.socket:
    """Connect to the node's leader, starting it first when there is none (one starter at a time).
    ``config``: what the leader needs to read the run (``dir``, ``store``, ``verify``, ``signing_key``
    in hex, ``max_bytes``)."""
    with open(node_dir / "spawn.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(node_dir)
        if sock is not None:
            return sock
        with open(node_dir / "leader.log", "ab") as log_file:
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
                f"the node mirror's leader did not start (see {node_dir / 'leader.log'}): {line.decode(errors='replace')!r}"
            )
        sock = _connect(node_dir)
        if sock is None:
            raise DeltaSyncError(
                f"the node mirror's leader started but does not answer (see {node_dir / 'leader.log'})"
            )
        return sock


def request(
    node_dir: Path,
    config: Mapping[str, Any],
    step: int,
    *,
    on_phase: Callable[[int, str], None] | None = None,
    pace: bool = False,
    timeout: float,
) -> dict[str, Any]:
    """Ask the node's leader to build ``step``; its build stats (``{}`` when it found the version built)."""
    wait = 0.05
    for _ in range(SILENT_RETRIES):
        pid, heard, reply = _ask(node_dir, config, step, on_phase, pace, timeout)
        if reply or heard:
            break
        # connected to a leader that went away before saying a word (killed just now): a new one starts
        time.sleep(wait)
        wait = min(2 * wait, 1.0)
    if "stats" in reply:
        stats: dict[str, Any] = reply["stats"]
        return stats
    if "error" in reply:
        raise from_code(reply["error"], str(reply["message"]))
    raise DeltaSyncError(
        f"the node mirror's leader (pid {pid}) died while building step {step}; nothing of that step was "
        f"published and the next update starts a new leader (see {node_dir / 'leader.log'})"
    )


def _ask(
    node_dir: Path,
    config: Mapping[str, Any],
    step: int,
    on_phase: Callable[[int, str], None] | None,
    pace: bool,
    timeout: float,
) -> tuple[int, bool, dict[str, Any]]:
    """One request: (the leader's pid, whether it said anything, its final answer or ``{}``)."""
    sock = _start(node_dir, config)
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
