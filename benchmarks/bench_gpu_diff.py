"""The device diff path (CUDA): correctness against the CPU path, and what push() costs on the GPU.

    python benchmarks/bench_gpu_diff.py [--params 600e6] [--tensors 28] [--fraction 0.05] [--repeat 5]

Needs a CUDA device (exits with a message otherwise). For a bf16 state of
``--params`` elements on the GPU, with ``--fraction`` of the elements changed:

- checks that ``diff_tensor`` on the device gives exactly the CPU path's
  positions, old and new bits, and updates the baseline alike;
- times (medians) one device compare pass (``torch.ne(...).any()`` per tensor,
  synchronised), the device diff of all tensors until it returns (what push()
  pays: the copies of the sparse changes to pinned memory are still in flight),
  and until every change is readable on the host (``TensorDiff.wait``);
- times a full DeltaUploader push (defer_diff=False: the diff in push) and its commit
  on a memory store.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from deltasync.uploader._diff import diff_tensor


def make(params: int, tensors: int, fraction: float, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    n = params // tensors
    gen = torch.Generator(device=device).manual_seed(0)
    base = [
        torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=device, generator=gen) for _ in range(tensors)
    ]
    new = []
    for b in base:
        m = torch.rand(n, device=device, generator=gen) < fraction
        new.append(torch.where(m, b ^ 1, b))
    return base, new


def median_time(fn: Any, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=600e6)
    ap.add_argument("--tensors", type=int, default=28)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_diff needs a CUDA device")
    params = int(a.params)
    base, new = make(params, a.tensors, a.fraction, "cuda")

    # correctness: device path == CPU path, bit for bit
    for b, n in zip(base[:3], new[:3], strict=True):
        bc, nc = b.cpu(), n.cpu()
        bg = b.clone()
        cg, cc = diff_tensor(bg, n), diff_tensor(bc, nc)
        assert cg is not None and cc is not None
        cg.wait()
        assert np.array_equal(cg.idx, cc.idx) and np.array_equal(cg.old, cc.old) and np.array_equal(cg.new, cc.new)
        assert torch.equal(bg.cpu(), bc)
    print("device diff == CPU diff: ok")

    def compare() -> None:
        for b, n in zip(base, new, strict=True):
            torch.ne(b, n).any()
        torch.cuda.synchronize()

    work: list[torch.Tensor] = []
    changes: list[Any] = []

    def reset() -> None:
        work[:] = [b.clone() for b in base]
        torch.cuda.synchronize()

    def diff_returns() -> None:
        changes[:] = [diff_tensor(w, n) for w, n in zip(work, new, strict=True)]

    t_cmp = median_time(compare, a.repeat)
    t_ret, t_host = [], []
    for _ in range(a.repeat):
        reset()
        t0 = time.perf_counter()
        diff_returns()
        t1 = time.perf_counter()
        for c in changes:
            if c is not None:
                c.wait()
        t2 = time.perf_counter()
        t_ret.append(t1 - t0)
        t_host.append(t2 - t0)
    r, h = statistics.median(t_ret), statistics.median(t_host)
    gb = params * 2 / 1e9
    print(f"state {params / 1e6:.0f}M bf16 ({gb:.2f} GB) on {torch.cuda.get_device_name()}, {a.fraction:.0%} changed")
    print(f"compare pass          {t_cmp * 1e3:8.2f} ms")
    print(f"diff, returned        {r * 1e3:8.2f} ms  ({r / t_cmp:.2f}x compare)")
    print(f"diff, changes on host {h * 1e3:8.2f} ms  ({h / t_cmp:.2f}x compare)")

    from deltasync import DeltaUploader
    from deltasync.storage import MemoryStore

    state = {f"t{i:03d}": w.view(torch.bfloat16) for i, w in enumerate(work)}
    pushes, commits = [], []
    with DeltaUploader(MemoryStore("gpu-bench"), anchor_every=10_000, defer_diff=False, distributed=False) as up:
        up.push(state, 0).result()
        for step in range(1, a.repeat + 1):
            for i, w in enumerate(work):
                w.copy_(new[i] if step % 2 else base[i])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = up.push(state, step)
            t1 = time.perf_counter()
            fut.result()
            pushes.append(t1 - t0)
            commits.append(time.perf_counter() - t1)
    p, c = statistics.median(pushes), statistics.median(commits)
    print(f"uploader push()       {p * 1e3:8.2f} ms  ({p / t_cmp:.2f}x compare); commit {c * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
