"""Store round trips per sync, by run length and number of uploader sessions (issue 11).

    python benchmarks/bench_requests.py [--steps 10,100,1000] [--sessions 1,10,100,1000]

Builds each run on a MemoryStore the way `delta-upload` does (every session a new
DeltaUploader that resumes from the store's head and pushes its share of steps), with an
RL-like stream (~1% of bf16 elements change per step), then counts, through a
CountingStore, the round trips of (a) a fresh fetcher syncing to the latest step and
(b) a fetcher that held the previous step syncing to the latest. A get_many batch is one
round trip (backends send its keys concurrently); `objects` counts what was read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

import deltasync as ds
from deltasync.testing.counting import CountingStore

NUMEL = 4096


def base_state() -> dict[str, Any]:
    """Step 0 of the stream."""
    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(NUMEL, generator=g).to(torch.bfloat16), "b": torch.randn(16, generator=g)}


class Stream:
    """A deterministic RL-like stream: ~1% of ``w`` changes per step, ``b`` changes whole."""

    def __init__(self) -> None:
        self.step = 0
        self.state = base_state()

    def advance(self) -> dict[str, Any]:
        self.step += 1
        g2 = torch.Generator().manual_seed(self.step)
        idx = torch.randint(0, NUMEL, (NUMEL // 100,), generator=g2)
        w = self.state["w"].clone()
        w[idx] = (w[idx].float() + 1e-2).to(torch.bfloat16)
        self.state = {"w": w, "b": base_state()["b"] + self.step}
        return self.state


def build_run(steps: int, sessions: int, *, anchor_every: int = 50) -> tuple[ds.MemoryStore, Stream]:
    """A run of ``steps`` steps pushed by ``sessions`` consecutive uploaders (each resumes)."""
    store = ds.MemoryStore("bench-requests")
    stream = Stream()
    per = [steps // sessions + (1 if i < steps % sessions else 0) for i in range(sessions)]
    pushed = 0
    for n in per:
        with ds.DeltaUploader(store, anchor_every=anchor_every) as up:
            if pushed:
                up.resume(stream.state, pushed - 1)
            for _ in range(n):
                st = stream.state if pushed == 0 else stream.advance()
                up.push(st, pushed).result()
                pushed += 1
    return store, stream


@dataclass(frozen=True)
class Counts:
    fresh: int
    fresh_objects: int
    behind: int
    behind_objects: int


def measure(steps: int, sessions: int) -> Counts:
    """Round trips of a fresh fetcher and of one a step behind, on a run of that shape."""
    store, stream = build_run(steps, sessions)
    counting = CountingStore(store)
    target = {k: torch.zeros_like(v) for k, v in stream.state.items()}
    fetcher = ds.DeltaFetcher(counting)
    assert fetcher.sync(target) == steps - 1
    fresh, fresh_obj = counting.requests, counting.objects_read
    with ds.DeltaUploader(store, anchor_every=50) as up:  # one more session, one more step
        up.resume(stream.state, steps - 1)
        up.push(stream.advance(), steps).result()
    counting.reset()
    assert fetcher.sync(target) == steps
    assert all(torch.equal(target[k].view(torch.uint8), stream.state[k].view(torch.uint8)) for k in target)
    return Counts(fresh, fresh_obj, counting.requests, counting.objects_read)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="10,100,1000")
    p.add_argument("--sessions", default="1,10,100,1000")
    a = p.parse_args()
    print(
        f"{'steps':>6} {'sessions':>8} | {'fresh: round trips':>18} {'objects':>7} | {'1 behind: round trips':>21} {'objects':>7}"
    )
    for steps in (int(x) for x in a.steps.split(",")):
        for sessions in (int(x) for x in a.sessions.split(",")):
            if sessions > steps:
                continue
            c = measure(steps, sessions)
            print(
                f"{steps:>6} {sessions:>8} | {c.fresh:>18} {c.fresh_objects:>7} | {c.behind:>21} {c.behind_objects:>7}"
            )


if __name__ == "__main__":
    main()
