"""Sharded push vs the single-process uploader on the same total state (CPU, gloo ranks).

    python benchmarks/bench_sharded_push.py [--params 32e6] [--tensors 16] [--steps 6] [--worlds 1,2,4]

The state is ``--tensors`` bf16 matrices (``--params`` elements in all). Each step
changes about 5% of the elements (an AdamW-like update of fp32 masters). Every
configuration pushes to a fresh local store with ``anchor_every`` large, so
steps 1.. are patches. Reported, as medians over the patch steps:

- push: seconds until ``push()`` returns (sharded: the slowest rank);
- commit: seconds from ``push()`` returning to the step's Future resolving
  (sharded: rank 0, whose Future resolves last: after the manifest).

"single" is one process holding the whole state (DeltaUploader with
``distributed=False``); "world N" is N processes (gloo on loopback, a 1-D device
mesh), each holding a Shard(0) DTensor slice, all on the same machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def make_state(params: int, tensors: int) -> dict[str, torch.Tensor]:
    cols = 1024
    rows = max(1, params // (tensors * cols))
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i:03d}.weight": (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16() for i in range(tensors)}


def update(local: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], step: int) -> None:
    for i, (name, t) in enumerate(local.items()):
        m = masters.setdefault(name, t.float())
        g = torch.Generator().manual_seed(step * 1000 + i)
        m -= torch.randn(m.shape, generator=g) * 2.5e-6
        t.copy_(m.bfloat16())


def timed_pushes(up: Any, state: Any, local: dict[str, torch.Tensor], steps: int) -> tuple[list[float], list[float]]:
    masters: dict[str, torch.Tensor] = {}
    push_s: list[float] = []
    commit_s: list[float] = []
    for step in range(steps + 1):
        if step:
            update(local, masters, step)
        t0 = time.perf_counter()
        fut = up.push(state, step)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        if step:  # step 0 is the anchor
            push_s.append(t1 - t0)
            commit_s.append(t2 - t1)
    return push_s, commit_s


def run_single(params: int, tensors: int, steps: int) -> dict[str, float]:
    from deltasync import DeltaUploader

    state = make_state(params, tensors)
    with tempfile.TemporaryDirectory() as d, DeltaUploader(d, anchor_every=10_000, distributed=False) as up:
        push_s, commit_s = timed_pushes(up, state, state, steps)
    return {"push": statistics.median(push_s), "commit": statistics.median(commit_s)}


def worker(rank: int, world: int, run_dir: Path, params: int, tensors: int, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltasync import DeltaUploader

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share this machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{run_dir / 'rdv'}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in make_state(params, tensors).items()}
    local = {k: v.to_local() for k, v in state.items()}
    with DeltaUploader(run_dir / "store", anchor_every=10_000, distributed=True) as up:
        push_s, commit_s = timed_pushes(up, state, local, steps)
    (run_dir / f"r{rank}.json").write_text(json.dumps({"push": push_s, "commit": commit_s}))
    dist.destroy_process_group()


def run_world(world: int, params: int, tensors: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
        args = [str(params), str(tensors), str(steps)]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), d, *args], env=env)
            for r in range(world)
        ]
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"a rank of world {world} failed")
        res = [json.loads((Path(d) / f"r{r}.json").read_text()) for r in range(world)]
    push = [max(r["push"][i] for r in res) for i in range(steps)]
    return {"push": statistics.median(push), "commit": statistics.median(res[0]["commit"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=32e6)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        r, w, d, p, t, s = a.worker
        worker(int(r), int(w), Path(d), int(p), int(t), int(s))
        return
    params = int(a.params)
    rows = [("single", run_single(params, a.tensors, a.steps))]
    for w in (int(x) for x in a.worlds.split(",")):
        rows.append((f"world {w}", run_world(w, params, a.tensors, a.steps)))
    base = rows[0][1]
    mb = params * 2 / 1e6
    print(f"state: {params / 1e6:.1f}M bf16 params ({mb:.0f} MB) in {a.tensors} tensors, ~5% change per step")
    print(f"{'setup':<10} {'push s':>8} {'x single':>9} {'commit s':>9} {'x single':>9}")
    for name, r in rows:
        print(
            f"{name:<10} {r['push']:>8.4f} {r['push'] / base['push']:>9.2f} "
            f"{r['commit']:>9.4f} {r['commit'] / base['commit']:>9.2f}"
        )


if __name__ == "__main__":
    main()
