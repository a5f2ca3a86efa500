"""The node-mirror measurements that tests/integrations/test_vllm_node.py and
benchmarks/bench_vllm_node.py run inside the vLLM venv (test support, not deltasync).

``check(p)`` starts one engine with the ``"deltasync"`` backend and reads every engine process's
memory (``/proc/<pid>/smaps``: RSS, PSS, and the PSS of the node mirror's files; the node's leader
is a child of a worker and counted too) before deltasync is set up, after, and after each update.
Each update is prepared in the background first (``deltasync_prepare``, waited for) unless
``p["prefetch"]`` is false, so its time is the engine's pause. Optional: the weights after each
update against ``p["expected"]`` (vLLM checksums by step), the node's leader killed mid-build
(``p["kill_leader"]``), and vLLM's own ``reload_weights`` of ``p["reload_dir"]`` timed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import engine_checks as ec
import psutil


def engine_procs() -> list[Any]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


#: what the node's leader runs (``python -m deltasync.serving.node.leader``)
LEADER = "deltasync.serving.node.leader"


def _own_memory(procs: list[Any]) -> list[tuple[Any, bool]]:
    """(process, whether it is the node's leader) of each of ``procs`` with memory of its own: a
    child whose command line is its parent's is a fork that has not run exec yet (under ``vfork``,
    which Python's subprocess uses, it borrows its parent's memory, and its smaps are the parent's:
    a worker starting the leader showed its 1.5 GiB twice once), so it is left out."""
    out = []
    for proc in procs:
        try:
            cmd = proc.cmdline()
            parent = proc.parent() if proc.pid != os.getpid() else None  # this process always counts
            if parent is not None and parent.cmdline() == cmd:
                continue
        except (psutil.Error, OSError):
            continue
        out.append((proc, any(LEADER in part for part in cmd)))
    return out


def memory(node_dir: str) -> dict[str, int]:
    """The engine processes' memory from smaps: RSS, PSS, USS (pages no other process maps),
    anonymous memory (``anon``: heap, tensors, copied-on-write pages; what the kernel cannot take back
    without swap) and its proportional share (``pss_anon``, -1 where the kernel does not report it),
    the leader's part of both (``leader_anon``, ``leader_pss_anon``), the PSS and USS of their
    mappings of the node mirror's files, and the node's data files' bytes.
    PSS splits a shared library's pages among every process that maps it, other tests' engines
    included, so it moves when they start and stop; USS counts clean file pages (libraries, the
    model's safetensors) that the kernel drops and faults back in under memory pressure, so it moves
    with the load of the machine; ``anon`` counts a page that two processes share (after a fork)
    in both; ``pss_anon`` summed over the processes counts every anonymous page once."""
    keys = ("rss", "pss", "uss", "anon", "pss_anon", "leader_anon", "leader_pss_anon", "node_mapped", "node_private")
    out = dict.fromkeys(keys, 0) | {"procs": 0}
    for proc, is_leader in _own_memory(engine_procs()):
        try:
            text = Path(f"/proc/{proc.pid}/smaps").read_text()
            rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
        except OSError:
            continue
        out["procs"] += 1
        anon = re.search(r"^Anonymous:\s+(\d+) kB", rollup, re.M)
        pss_anon = re.search(r"^Pss_Anon:\s+(\d+) kB", rollup, re.M)
        out["anon"] += int(anon.group(1)) << 10 if anon else 0
        out["leader_anon"] += int(anon.group(1)) << 10 if anon and is_leader else 0
        if pss_anon is None or out["pss_anon"] < 0:
            out["pss_anon"] = out["leader_pss_anon"] = -1  # a kernel without it (before 5.9): "anon" instead
        else:
            out["pss_anon"] += int(pss_anon.group(1)) << 10
            out["leader_pss_anon"] += int(pss_anon.group(1)) << 10 if is_leader else 0
        in_node = False
        for line in text.splitlines():
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):  # a mapping's header: address range, perms, ..., [path]
                in_node = len(head) >= 6 and head[5].startswith(node_dir)
            elif head[0] == "Rss:":
                out["rss"] += int(head[1]) << 10
            elif head[0] == "Pss:":
                out["pss"] += int(head[1]) << 10
                if in_node:
                    out["node_mapped"] += int(head[1]) << 10
            elif head[0] in ("Private_Clean:", "Private_Dirty:"):
                out["uss"] += int(head[1]) << 10
                if in_node:
                    out["node_private"] += int(head[1]) << 10
    out["node"] = sum(f.stat().st_size for f in Path(node_dir).glob("*/data/*"))
    return out


def prepare(llm: Any, url: str, step: int, timeout: float = 600.0) -> float:
    # a bounded wait that never polls the workers (polling keeps vLLM's CPU workers spinning and starves
    # the build); a prepare that failed or timed out is the update's to report
    t0 = time.monotonic()
    try:
        llm.collective_rpc("deltasync_prepare", kwargs={"store": url, "step": step, "wait": True, "timeout": timeout})
    except Exception as exc:  # noqa: BLE001 - the update that follows raises what matters
        print(f"step {step} not prepared: {exc}", flush=True)
    return time.monotonic() - t0


def update(llm: Any, url: str, step: int) -> float:
    t0 = time.monotonic()
    llm.start_weight_update()
    # a failed update_weights raises, and vLLM has closed the update then: no finish_weight_update
    llm.update_weights({"update_info": {"store": url, "step": step}})
    llm.finish_weight_update(weight_version=str(step))
    return time.monotonic() - t0


def _kill_leader_at(node_dir: str, step: int, killed: list[int]) -> None:
    """Kill the node's leader once it has started on ``step`` (downloading, checking or decoding it, or
    writing its files: whatever it has reached by then)."""
    deadline = time.monotonic() + 300
    while not killed and time.monotonic() < deadline:
        for marker in glob.glob(os.path.join(node_dir, "*", "building.json")):
            try:
                job = json.loads(Path(marker).read_text())
            except (OSError, ValueError):
                continue
            if job["step"] == step and job["phase"] != "waiting":  # it told the worker it started
                os.kill(job["pid"], 9)
                killed.append(job["pid"])
                return
        time.sleep(0.002)


def _orphans(node_dir: str) -> list[str]:
    """Data files no version names."""
    out = []
    for d in glob.glob(os.path.join(node_dir, "*")):
        named = "".join(Path(v).read_text() for v in glob.glob(os.path.join(d, "versions", "*.json")))
        out += [f for f in os.listdir(os.path.join(d, "data")) if f not in named]
    return out


def _await_leader(timeout: float = 120.0) -> None:
    """Until a process of this engine runs the node's leader (bounded; the first update starts one
    if the init's did not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(is_leader for _, is_leader in _own_memory(engine_procs())):
            return
        time.sleep(0.2)


def check(p: dict[str, Any]) -> dict[str, Any]:
    url, tp, node_dir = p["store"], p["tp"], p["node_dir"]
    expected = p.get("expected")
    llm = ec.make_llm(p["model"], tp=tp, weight_transfer_config={"backend": "deltasync"})
    out: dict[str, Any] = {"before": memory(node_dir), "steps": [], "ok": [], "pause": [], "prepare": []}
    llm.init_weight_transfer_engine({"init_info": {"store": url, "node_dir": node_dir}})
    _await_leader()  # started in the background by the init: measured once its exec is done
    out["after_init"] = memory(node_dir)
    for step in range(1, p["updates"] + 1):
        if p.get("prefetch", True):
            out["prepare"].append(prepare(llm, url, step))
        out["pause"].append(update(llm, url, step))
        if expected is not None:
            out["ok"].append(ec.checksums(llm) == expected[str(step)])
        out["steps"].append(memory(node_dir))
    if p.get("kill_leader"):
        step = p["updates"] + 1
        killed: list[int] = []
        hunter = threading.Thread(target=_kill_leader_at, args=(node_dir, step, killed))
        hunter.start()
        try:
            update(llm, url, step)
            out["kill_error"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["kill_error"] = f"{type(exc).__name__}: {exc}"
        hunter.join()
        out["killed"] = bool(killed)
        if expected is not None:
            out["after_kill_ok"] = ec.checksums(llm) == expected[str(p["updates"])]
        out["after_kill_status"] = llm.collective_rpc("deltasync_status")
        out["after_kill_orphans"] = _orphans(node_dir)
        update(llm, url, step)
        if expected is not None:
            out["retry_ok"] = ec.checksums(llm) == expected[str(step)]
    if p.get("reload_dir"):
        times = []
        for _ in range(3):
            t0 = time.monotonic()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": p["reload_dir"]})
            times.append(time.monotonic() - t0)
        out["reload"] = statistics.median(times)
    out["metrics"] = llm.collective_rpc("deltasync_metrics")
    return out
