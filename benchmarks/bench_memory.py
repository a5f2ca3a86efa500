"""Peak RSS per component at a model shape: trainer, uploader and fetcher in one process.

Run by hand: ``python benchmarks/bench_memory.py --preset qwen3-0.6b --lr 1e-5 --steps 3``
(about 3 minutes on 2 cores, 20 GB of RAM). A sampler thread reads VmRSS every 10 ms and
keeps, per phase, the RSS at its start, its peak and the RSS at its end; a component's
cost is the rise over the RSS before it. ``--mmap-threshold`` fixes glibc's mmap threshold
(mallopt M_MMAP_THRESHOLD, like ``MALLOC_MMAP_THRESHOLD_``) so freed arrays go back to the
OS instead of staying in the heap; the report says which was used.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_payload as bp  # noqa: E402

import deltasync as ds  # noqa: E402


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1e6
    return float("nan")


@dataclass
class Phase:
    name: str
    start: float
    peak: float
    end: float = 0.0


class Sampler:
    """Per-phase RSS: at the start, the peak while it ran, at the end."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            if self.phases:
                p = self.phases[-1]
                p.peak = max(p.peak, rss_gb())

    def mark(self, name: str) -> None:
        now = rss_gb()
        if self.phases:
            self.phases[-1].end = now
            self.phases[-1].peak = max(self.phases[-1].peak, now)
        self.phases.append(Phase(name, now, now))

    def close(self) -> None:
        self.mark("end")
        self._stop.set()
        self._t.join()


def run(preset: str, lr: float, steps: int) -> tuple[Sampler, list[str]]:
    cfg = bp.BenchConfig(**bp.PRESETS[preset]) if preset else bp.BenchConfig()
    s = Sampler()
    log: list[str] = []
    torch.manual_seed(cfg.seed)
    s.mark("trainer: model + AdamW")
    model = bp.build_model(cfg)
    opt = bp.make_optimizer(model, cfg, lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    root = tempfile.mkdtemp(prefix="bench-memory-")
    s.mark("trainer: bf16 view")
    state = bp.bf16_view(model)
    up = ds.DeltaUploader(root, anchor_every=1 << 30, anchor_bytes_fraction=0.0, on_backlog="block")
    s.mark("uploader: anchor push + commit")
    up.push(state, step=0).result()
    s.mark("fetcher: replica tensors")
    replica = {k: torch.zeros_like(v) for k, v in state.items()}
    fetcher = ds.DeltaFetcher(root, verify=True)
    s.mark("fetcher: anchor sync")
    fetcher.sync(replica, step=0)
    for step in range(1, steps + 1):
        s.mark(f"trainer: step {step}")
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = bp.bf16_view(model)
        s.mark(f"uploader: push {step}")
        fut = up.push(state, step=step)
        s.mark(f"uploader: commit {step}")
        info = fut.result()
        s.mark(f"fetcher: sync {step}")
        t0 = time.perf_counter()
        fetcher.sync(replica, step=step)
        log.append(
            f"step {step}: {info.kind}, density {info.changed / info.total:.1%}, {info.nbytes / 1e6:.0f} MB, "
            f"push -> committed {info.seconds:.2f} s, sync {time.perf_counter() - t0:.2f} s"
        )
    up.close()
    s.close()
    return s, log


def render(s: Sampler, log: Sequence[str], args: Any) -> str:
    out = [
        "## deltasync memory benchmark",
        "",
        f"Command: `python benchmarks/bench_memory.py {' '.join(sys.argv[1:])}`  ",
        f"glibc mmap threshold: {'fixed at ' + str(args.mmap_threshold) + ' B' if args.mmap_threshold else 'default (dynamic)'}; "
        f"machine RAM {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB",
        "",
        "| phase | RSS before (GB) | peak (GB) | peak rise (GB) | RSS after (GB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in s.phases[:-1]:
        out.append(f"| {p.name} | {p.start:.2f} | {p.peak:.2f} | {p.peak - p.start:+.2f} | {p.end:.2f} |")
    out += ["", f"Peak RSS of the whole run: {max(p.peak for p in s.phases):.2f} GB.", ""]
    out += [f"- {line}" for line in log]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["", *sorted(bp.PRESETS)], default="qwen3-0.6b")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mmap-threshold", type=int, default=1 << 20, help="bytes; 0 keeps glibc's dynamic threshold")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.mmap_threshold:
        ctypes.CDLL("libc.so.6").mallopt(-3, args.mmap_threshold)  # M_MMAP_THRESHOLD
    s, log = run(args.preset, args.lr, args.steps)
    text = render(s, log, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
