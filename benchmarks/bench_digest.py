"""What hashing a state for its tensor digests costs: format 1's one pass per tensor on one thread
(the digest before format 2's tree digest) against :func:`deltasync.protocol.digests.tensor_digests`
(format 2: 16 MiB chunks and batches of small tensors on a pool), 1 and N threads.

    python benchmarks/bench_digest.py [--gib 1] [--threads 1,2] [--reps 15]

Three bf16 states of about ``--gib`` GiB each: 8 large tensors, 18,432 small ones (58 kB each at
1 GiB: below the 64 kB from which python-xxhash releases the GIL), and tensors of a Qwen3-30B-A3B
expert's 3 MiB.
Prints medians over ``--reps`` runs (old and new in turn within each), the ratio old / new, the
cores each kept busy (CPU seconds / seconds), and the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from deltasync._util.cpus import parallel_map, usable_cpus
from deltasync.protocol.digests import tensor_digests, xxh3_128_array


def _medians(fns: list[Callable[[], Any]], reps: int) -> list[tuple[float, float]]:
    """(median seconds, median CPU seconds / seconds: the cores the call kept busy) of each of ``fns``,
    run in turn within every repetition (so that the load of a shared machine falls on all alike)."""
    for fn in fns:
        fn()  # warm: page faults, thread start
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times, strict=True):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            out.append((wall, (time.process_time() - c0) / wall))
    return [(statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args()
    nbytes = int(a.gib * (1 << 30))
    rng = np.random.default_rng(0)
    big_n = nbytes // 2 // 8
    small_n = nbytes // 2 // 18_432
    states = {
        "8 large": {f"layer.{i}.weight": rng.integers(0, 1 << 16, big_n, dtype=np.uint16) for i in range(8)},
        "18,432 small": {
            f"expert.{i}.weight": rng.integers(0, 1 << 16, small_n, dtype=np.uint16) for i in range(18_432)
        },
        # a Qwen3-30B-A3B expert's size (768 x 2048 bf16): small for the tree digest, but over the
        # 64 kB from which python-xxhash lets go of the GIL
        "3 MiB experts": {
            f"expert.{i}.weight": rng.integers(0, 1 << 16, 768 * 2048, dtype=np.uint16)
            for i in range(nbytes // (3 << 20))
        },
    }
    print(f"cpus usable: {usable_cpus()}, load average before: {os.getloadavg()}")
    print(
        "| state | bytes | old: format 1, serial | " + " | ".join(f"new, {t} thr" for t in a.threads.split(",")) + " |"
    )
    threads = [int(x) for x in a.threads.split(",")]
    for label, state in states.items():
        size = sum(int(x.nbytes) for x in state.values())
        fns: list[Callable[[], Any]] = [lambda s=state: [xxh3_128_array(x) for x in s.values()]]
        for t in threads:
            mapper = functools.partial(parallel_map, threads=t)
            fns.append(lambda s=state, m=mapper: tensor_digests(s, 2, mapper=m))
        (old, old_cores), *new = _medians(fns, a.reps)
        cells = [f"{old * 1e3:.0f} ms ({size / old / 1e9:.1f} GB/s, {old_cores:.2f} cores)"]
        cells += [f"{n * 1e3:.0f} ms ({old / n:.2f}x, {c:.2f} cores)" for n, c in new]
        print(f"| {label} | {size / 2**30:.2f} GiB | " + " | ".join(cells) + " |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
