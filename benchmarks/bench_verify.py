"""What verification costs per sync: verify=False / True / "full", side by side in one run.

    python benchmarks/bench_verify.py [--params 150e6] [--density 0.03] [--steps 6]

A bf16 state of ``--params`` elements in 16 tensors, on a MemoryStore; each step changes
``--density`` of the elements (RL-like, spread uniformly). A fetcher one step behind syncs to
the next step; the table gives medians over the steps and the ratio to a memcpy of the weights
and to one xxh3-128 pass over them (what "full" adds, by construction).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

import deltasync as ds
from deltasync.protocol.digests import xxh3_128_array


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=150e6)
    p.add_argument("--density", type=float, default=0.03)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    n = int(a.params) // 16
    g = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(16)}
    store = ds.MemoryStore("bench-verify")
    states: list[dict[str, Any]] = []
    with ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s in range(a.steps + 1):
            if s:
                state = {k: v.clone() for k, v in state.items()}
                for v in state.values():
                    idx = torch.randint(0, n, (int(n * a.density),), generator=g)
                    v[idx] = (v[idx].float() * 1.001 + 1e-3).to(torch.bfloat16)
            up.push(state, s).result()
            states.append(state)
    nbytes = sum(v.numel() * 2 for v in state.values())
    flat = [v.view(torch.int16).numpy() for v in state.values()]
    dst = [np.empty_like(x) for x in flat]
    memcpy = statistics.median(
        _time(lambda: [np.copyto(d, x) for d, x in zip(dst, flat, strict=True)]) for _ in range(5)
    )
    hash_pass = statistics.median(_time(lambda: [xxh3_128_array(x) for x in flat]) for _ in range(5))
    rows = []
    for verify in (False, True, "full"):
        fetcher = ds.DeltaFetcher(store, verify=verify)
        target = {k: v.clone() for k, v in states[0].items()}
        fetcher.sync(target, step=0)
        secs = []
        for s in range(1, a.steps + 1):
            secs.append(_time(lambda s=s, f=fetcher, t=target: f.sync(t, step=s)))
            assert all(torch.equal(target[k].view(torch.int16), states[s][k].view(torch.int16)) for k in target)
        rows.append((str(verify), statistics.median(secs)))
    print(f"state {nbytes / 1e9:.2f} GB bf16, {a.density:.1%} of elements change per step, {a.steps} steps (medians)")
    print(
        f"memcpy of the weights {memcpy * 1e3:.0f} ms ({nbytes / memcpy / 1e9:.1f} GB/s); "
        f"one xxh3-128 pass {hash_pass * 1e3:.0f} ms ({nbytes / hash_pass / 1e9:.1f} GB/s)"
    )
    print(f"{'verify':>8} | {'sync 1 behind':>13} | {'x memcpy':>8} | {'x False':>7}")
    base = rows[0][1]
    for name, t in rows:
        print(f"{name:>8} | {t * 1e3:>10.0f} ms | {t / memcpy:>8.2f} | {t / base:>7.2f}")


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
