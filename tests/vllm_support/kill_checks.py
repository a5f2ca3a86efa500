"""A worker killed mid-update, two real engines on one node mirror (test support, not deltasync).

``check(p)`` (run by tests/integrations/test_vllm_node_kill.py inside the vLLM venv) drives two
engines of one run that share one node mirror (same ``node_dir``, same store):

* engine B, TP=1, in this process;
* engine A, TP=2 (multiprocess: its two workers are processes), in a child process (``host``: it needs
  its own vLLM environment), driven over a ``multiprocessing.connection`` pipe.

Both update to step 1. Then every worker of A is armed (``check_arm_kill``): the first worker whose
request to the node's leader gets a phase report ``wrote`` (the leader has written a data file of the
step, and waits, in its test-only paced mode, for that worker's go-ahead) writes a marker with its
pid and stops there. A is asked to update to step 2; once the marker exists, B is read (it serves
step 1 while A's worker sits inside its update RPC with the leader holding the node lock), then
that worker is SIGKILLed. What A, B and the node mirror do next is recorded for the test; then a
fresh engine A is started on the same node and brought to the newest step. A's process may hang in
vLLM's client after the engine died (seen with vLLM 0.32): it is killed then.

Waits are on events (the marker, pipe replies), each bounded.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import engine_checks as ec
import node_checks

REPLY_TIMEOUT = 600.0
PROBE_TIMEOUT = 120.0


# ------------------------------------------------------------------------------- worker side


class KillWorkerExtension(ec.CheckWorkerExtension):
    """``CheckWorkerExtension`` plus the hook that stops one worker inside its update."""

    def check_arm_kill(self, marker: str) -> int:
        """Hold the first worker whose leader reports ``wrote`` there (marker: its pid); returns this pid."""
        from deltasync.integrations.vllm.backend import _state_of

        node = _state_of(self).mirror.node  # type: ignore[union-attr]
        rank = _state_of(self).rank

        def on_phase(leader_pid: int, phase: str) -> None:
            if phase != "wrote":
                return
            try:
                fd = os.open(marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # another worker was stopped already
            os.close(fd)
            tmp = marker + ".tmp"
            Path(tmp).write_text(json.dumps({"worker": os.getpid(), "leader": leader_pid, "rank": rank}))
            os.replace(tmp, marker)
            threading.Event().wait(REPLY_TIMEOUT)  # until the test kills this process

        node.pace = True  # the leader waits for this worker's go-ahead after each phase
        node.on_phase = on_phase
        return os.getpid()


# ------------------------------------------------------------------------- engine A's process


def _update(llm: Any, url: str, step: int) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"store": url, "step": step}})
    llm.finish_weight_update(weight_version=str(step))


def _processes() -> list[dict[str, Any]]:
    import psutil

    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out.append({"pid": proc.pid, "name": proc.name(), "status": proc.status()})
    return out


def host() -> None:
    """Engine A's process: ``python -c 'import kill_checks; kill_checks.host()' ADDRESS KEY``."""
    conn = Client(sys.argv[1], authkey=bytes.fromhex(sys.argv[2]))
    llm: Any = None
    while True:
        cmd = conn.recv()
        name = cmd.pop("cmd")
        try:
            if name == "start":
                llm = ec.make_llm(
                    cmd["model"],
                    tp=2,
                    weight_transfer_config={"backend": "deltasync"},
                    worker_extension_cls="kill_checks.KillWorkerExtension",
                )
                result: Any = None
            elif name == "init":
                llm.init_weight_transfer_engine({"init_info": cmd})
                result = llm.collective_rpc("deltasync_status")
            elif name == "update":
                _update(llm, cmd["store"], cmd["step"])
                result = llm.collective_rpc("deltasync_status")
            elif name == "rpc":
                result = llm.collective_rpc(cmd["method"], args=tuple(cmd.get("args", ())))
            elif name == "checksums":
                result = ec.checksums(llm)
            elif name == "generate":
                result = ec.fingerprint(llm)
            elif name == "processes":
                result = _processes()
            elif name == "exit":
                conn.send({"ok": None})
                os._exit(0)
            else:
                raise ValueError(name)
            reply: dict[str, Any] = {"ok": result}
        except BaseException as exc:  # noqa: BLE001 - reported to the driver
            reply = {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
        conn.send(reply)


class EngineA:
    """Engine A's process, seen from the test script."""

    def __init__(self, p: dict[str, Any], log: Path) -> None:
        key = secrets.token_bytes(16)
        self.listener = Listener(family="AF_UNIX", authkey=key)
        self.log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import kill_checks; kill_checks.host()", str(self.listener.address), key.hex()],
            env=p["a_env"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.conn: Connection = self.listener.accept()  # bounded by the script's own timeout

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send({"cmd": cmd, **kw})

    def reply(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine A's process did not answer in {timeout:.0f} s")
        out: dict[str, Any] = self.conn.recv()
        return out

    def call(self, cmd: str, **kw: Any) -> Any:
        self.send(cmd, **kw)
        out = self.reply()
        if "error" in out:
            raise RuntimeError(f"engine A: {cmd}: {out['error']}")
        return out["ok"]

    def close(self, stuck: bool = False) -> None:
        """Ask the process to exit; kill it when it cannot (``stuck`` in a call to a dead engine)."""
        if stuck:
            self.proc.kill()
        else:
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.send("exit")
                self.reply(timeout=60)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.listener.close()
        self.log.close()


# ---------------------------------------------------------------------------------- the check


def _wait_for(path: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            return dict(json.loads(Path(path).read_text()))
        time.sleep(0.005)
    return None


def incomplete(node_dir: str) -> list[str]:
    """Data files that a version names but that are missing."""
    out = []
    for run in glob.glob(os.path.join(node_dir, "*")):
        for v in glob.glob(os.path.join(run, "versions", "*.json")):
            doc = json.loads(Path(v).read_text())
            # a tensor is [file, dtype, shape(, offset)]; positions [file, offset, count, width] (format 1: file)
            names = [f[0] for f in doc["files"].values()]
            names += [p if isinstance(p, str) else p[0] for p in doc.get("positions", {}).values()]
            out += [f"{v}: {f}" for f in names if not os.path.exists(os.path.join(run, "data", f))]
    return out


def _outliving(procs: list[dict[str, Any]], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Those of ``procs`` still running ``timeout`` s after their engine's process exited (waited for)."""
    import psutil

    watched = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            watched.append(psutil.Process(p["pid"]))
    _, alive = psutil.wait_procs(watched, timeout=timeout)
    out = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append({"pid": proc.pid, "name": proc.name()})
    return out


def node_steps(node_dir: str) -> list[Any]:
    return sorted(
        (json.loads(Path(v).read_text())["step"] for v in glob.glob(os.path.join(node_dir, "*", "versions", "*.json"))),
        key=lambda s: -1 if s is None else s,
    )


def _metric(texts: list[str], name: str) -> list[int]:
    import re

    return [int(float(m)) for t in texts for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", t, re.M)]


def check(p: dict[str, Any]) -> dict[str, Any]:
    url, node_dir, model, last = p["store"], p["node_dir"], p["model"], p["last"]
    expected = {tp: {s: ec.expected_checksums(p["expected"][str(s)], tp) for s in range(1, last + 1)} for tp in (1, 2)}
    init = {"store": url, "node_dir": node_dir}
    work = Path(p["work"])
    out: dict[str, Any] = {}

    a = EngineA(p, work / "engine-a1.log")
    a.send("start", model=model)  # A starts (tens of seconds) while B starts here
    b = ec.make_llm(model, tp=1, weight_transfer_config={"backend": "deltasync"})
    b.init_weight_transfer_engine({"init_info": init})
    started = a.reply()
    assert "error" not in started, started
    a.call("init", **init)

    a.call("update", store=url, step=1)
    _update(b, url, 1)
    out["a_step1_ok"] = a.call("checksums") == expected[2][1]
    out["b_step1_ok"] = ec.checksums(b) == expected[1][1]

    marker = str(work / "killed-worker.json")
    armed = a.call("rpc", method="check_arm_kill", args=[marker])
    out["a_workers"] = armed
    a.send("update", store=url, step=2)
    hit = _wait_for(marker, REPLY_TIMEOUT)
    out["hit"] = hit
    assert hit is not None, "no worker of engine A reached the leader's 'wrote' phase"
    # A's worker is inside its update RPC; the leader has written part of step 2 and holds the node lock
    out["b_during_ok"] = ec.checksums(b) == expected[1][1]
    out["b_during_generates"] = bool(ec.fingerprint(b)[0]["token_ids"])
    os.kill(hit["worker"], signal.SIGKILL)
    t0 = time.monotonic()
    out["a_update_reply"] = a.reply()
    out["a_update_failed_after_s"] = round(time.monotonic() - t0, 2)  # a figure for the report, not asserted
    a.send("processes")
    out["a_processes_after"] = a.reply().get("ok")
    # vLLM 0.32 either raises EngineDeadError here or never answers (its client can miss that the engine
    # core process died: both seen); a healthy engine answers checksums in well under a second
    a.send("checksums")
    try:
        got = a.reply(PROBE_TIMEOUT)
        out["a_after_checksums"] = got.get("error") or "answered"
        a.close()
    except TimeoutError:
        out["a_after_checksums"] = f"no answer in {PROBE_TIMEOUT:.0f} s"
        a.close(stuck=True)
    out["a_exit"] = a.proc.returncode
    out["a_left_after_exit"] = _outliving(out["a_processes_after"])

    out["b_after_kill_ok"] = ec.checksums(b) == expected[1][1]
    out["b_after_kill_status"] = b.collective_rpc("deltasync_status")
    out["b_steps_ok"], out["orphans"], out["incomplete"], out["node_steps"] = {}, {}, {}, {}
    for step in range(2, last + 1):
        _update(b, url, step)
        out["b_steps_ok"][step] = ec.checksums(b) == expected[1][step]
        out["orphans"][step] = node_checks._orphans(node_dir)
        out["incomplete"][step] = incomplete(node_dir)
        out["node_steps"][step] = node_steps(node_dir)

    a2 = EngineA(p, work / "engine-a2.log")
    a2.call("start", model=model)
    a2.call("init", **init)
    out["a2_status"] = a2.call("update", store=url, step=last)
    out["a2_ok"] = a2.call("checksums") == expected[2][last]
    metrics = a2.call("rpc", method="deltasync_metrics")
    out["a2_downloaded"] = _metric(metrics, "deltasync_downloaded_bytes_total")
    out["a2_built"] = _metric(metrics, "deltasync_node_versions_built_total")
    out["b_metrics"] = b.collective_rpc("deltasync_metrics")
    a2.close()
    out["b_final_ok"] = ec.checksums(b) == expected[1][last]
    return out
