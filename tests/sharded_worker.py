"""One rank of a sharded-push test run (tests/uploader/test_sharded_push.py starts ``world`` of these).

    python tests/sharded_worker.py RANK WORLD RUN_DIR SCENARIO

RUN_DIR holds the process group's rendezvous file, the store (``store/``) and one
``rank{R}.json`` per rank with what happened. Rank 0 fetches every committed step
with a single-process ``DeltaFetcher(verify="full")`` and compares it bit for bit
with the gathered model (``full_tensor()``, only here, for the comparison).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from deltasync import DeltaFetcher, DeltaUploader
from deltasync._util.tensors import flat_bits
from deltasync.errors import CommitFailed, StorageError
from deltasync.storage import LocalStore, Store
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

SHAPES: dict[str, tuple[tuple[int, ...], str, Any]] = {
    # name: (global shape, placement, dtype); rows/cols chosen so 2 and 4 ranks split unevenly
    "a.weight": ((11, 6), "shard0", torch.bfloat16),
    "b.weight": ((6, 13), "shard1", torch.bfloat16),
    "c.bias": ((17,), "shard0", torch.bfloat16),
    "d.norm": ((9,), "plain", torch.float32),
    "e.rep": ((4, 5), "replicate", torch.bfloat16),
    "f.big": ((32, 40), "shard0", torch.bfloat16),
    "g.proj": ((24, 30), "shard1", torch.bfloat16),
    "h.mlp": ((41, 32), "shard0", torch.bfloat16),
    "i.emb": ((30, 37), "shard1", torch.bfloat16),
}


class FaultyStore(WrapperStore[Store]):
    """A LocalStore that fails (or silently truncates) the data files of chosen steps."""

    def __init__(self, inner: Store, fail_steps: Sequence[int] = (), truncate_steps: Sequence[int] = ()) -> None:
        super().__init__(inner)
        self.fail, self.truncate = set(fail_steps), set(truncate_steps)

    def _step_of(self, key: str) -> int | None:
        # a data file: steps/<step>/<name>, or steps/<step>/w<writer id>/<name>
        parts = key.split("/")
        return int(parts[1]) if len(parts) >= 3 and parts[0] == "steps" and parts[-1] != "manifest.json" else None

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        steps = {self._step_of(k) for k in items}
        if steps & self.fail:
            raise StorageError(f"injected write failure for step {sorted(steps & self.fail)}")
        if steps & self.truncate:
            items = {
                k: (bytes(v)[:-1] if isinstance(v, (bytes, bytearray, memoryview)) else v) for k, v in items.items()
            }
        self.inner.put_many(items, mode=mode)


def build_model(mesh: Any, world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)  # the same full model on every rank, before sharding
    out: dict[str, torch.Tensor] = {}
    for name, (shape, place, dtype) in SHAPES.items():
        full = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        if place == "plain":
            out[name] = full
        else:
            p = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[place]
            out[name] = distribute_tensor(full, mesh, [p])
    return out


def adamw_like_step(state: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], step: int, rank: int) -> None:
    """A tiny sign-ish update of fp32 masters, cast back to the bf16/fp32 weights (1-15% of bf16 bits change)."""
    for i, (name, t) in enumerate(state.items()):
        local = t.to_local() if isinstance(t, DTensor) else t
        replicated = not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)
        seed = step * 1000 + i + (0 if replicated else 100_000 * (rank + 1))  # replicated: same on every rank
        g = torch.Generator().manual_seed(seed)
        m = masters.setdefault(name, local.float().clone())
        upd = torch.randn(m.shape, generator=g).sign() * 6e-6 + torch.randn(m.shape, generator=g) * 2e-6
        m -= upd
        local.copy_(m.to(local.dtype))


def gathered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def main() -> None:
    rank, world, run_dir, scenario = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{run_dir / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (world,))
    state = build_model(mesh, world)
    full_bytes = sum(v.numel() * v.element_size() for v in state.values())
    inner = LocalStore(run_dir / "store")
    store: Store = inner
    events: list[dict[str, Any]] = []
    plan: list[int] = list(range(8))
    if scenario == "failure":
        # step 3: rank 1's writes fail; step 5: rank 1's files land truncated (rank 0 must notice);
        # step 7: rank 1 pushes step 8 while the others push 7; then step 9 recovers with an anchor;
        # step 11 carries a Partial DTensor (refused on every rank); step 12 recovers
        store = FaultyStore(inner, fail_steps=[3] if rank == 1 else [], truncate_steps=[5] if rank == 1 else [])
        plan = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12]
    masters: dict[str, torch.Tensor] = {}
    fetcher = DeltaFetcher(inner, verify="full") if rank == 0 else None
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    up = DeltaUploader(store, anchor_every=3, retries=0, encode_threads=1, distributed_timeout=60)
    assert up._sharded is not None
    max_buffer = 0
    for step in plan:
        if step:
            adamw_like_step(state, masters, step, rank)
        push_step = 8 if (scenario == "failure" and step == 7 and rank == 1) else step
        ev: dict[str, Any] = {"step": step}
        pushed = state
        if scenario == "failure" and step == 11:
            pushed = dict(state, partial=DTensor.from_local(torch.ones(3), mesh, [Partial()]))
        try:
            info = up.push(pushed, push_step).result(timeout=120)
            ev.update(ok=True, kind=info.kind, changed=info.changed, total=info.total)
        except CommitFailed as exc:
            ev.update(ok=False, error=str(exc))
        max_buffer = max(max_buffer, up._sharded.buffer_bytes)
        expect = gathered(state)  # a collective: every rank
        if fetcher is not None and ev["ok"]:
            got = fetcher.sync(target, step=step)
            ev["fetched"] = got
            ev["exact"] = all(torch.equal(flat_bits(target[k]), flat_bits(expect[k])) for k in expect)
        events.append(ev)
    up.close()
    out = {"rank": rank, "events": events, "full_bytes": full_bytes, "max_buffer_bytes": max_buffer}
    out["owned_bytes"] = up._sharded.copies.nbytes
    out["baseline_bytes"] = sum(t.numel() * t.element_size() for t in up._sharded.base.values())
    out["staging_bytes"] = sum(t.numel() * t.element_size() for t in up._sharded.staging.values())
    (run_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
