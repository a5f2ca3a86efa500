"""One rank of a sharded-push fault scenario (tests/uploader/test_sharded_faults.py starts ``world`` of these).

    python tests/sharded_faults_worker.py RANK WORLD RUN_DIR SCENARIO

A real FSDP2 model (``fully_shard`` on CPU, gloo, uneven shards) trained with a real AdamW;
every rank pushes its ``state_dict()`` (DTensor shards) and records each step's outcome in
``rank{R}.json``. Before each push every rank gathers the full state (``full_tensor()``, a
collective) so that rank 0 can check each committed step bit for bit with a single-process
``DeltaFetcher(verify="full")`` afterwards, also when a rank has died meanwhile.

Scenarios (the faults of issue 23):

- ``stale``: after step 3, rank 1 pushes step 3 again while the others push 4; then 5, 6, 7.
- ``kill``: rank 0's store kills the last rank (SIGKILL) just before it writes step 3's
  manifest, i.e. after every rank's report reached it.
- ``straggler``: rank 1's data write of step 3 stalls until rank 0 has given the step up
  (past ``distributed_timeout``); every rank keeps pushing as the error says.
- ``resume``: steps 0-3, then every rank makes a new uploader (a restarted trainer) and
  re-pushes step 3, then 4 and 5.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from deltasync import DeltaFetcher, DeltaUploader
from deltasync._util.tensors import flat_bits
from deltasync.errors import CommitFailed
from deltasync.storage import LocalStore, Store
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

TIMEOUT = 10.0  # distributed_timeout of the uploaders: long enough for a loaded 2-core machine


class Model(torch.nn.Module):
    """Dims chosen so that 2 and 3 ranks split the rows unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 16)
        self.up = torch.nn.Linear(16, 29)
        self.down = torch.nn.Linear(29, 7)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(self.emb(x)))))


class HookStore(WrapperStore[Store]):
    """Calls ``before(key)`` before each key of a write reaches the inner store."""

    def __init__(self, inner: Store, before: Any) -> None:
        super().__init__(inner)
        self.before = before

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        for key in items:
            self.before(key)
        self.inner.put_many(items, mode=mode)


def _wait_for(path: Path, stop_after: float = 120.0) -> None:
    """Block until ``path`` exists (bounded: a scenario that never gets there fails loudly)."""
    done = threading.Event()
    for _ in range(int(stop_after / 0.05)):
        if path.exists():
            return
        done.wait(0.05)
    raise TimeoutError(f"{path} never appeared")


def _kill_and_reap(pid: int) -> None:
    """SIGKILL ``pid`` (a sibling rank) and wait until it no longer runs."""
    os.kill(pid, signal.SIGKILL)
    gone = threading.Event()
    for _ in range(2400):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return
        gone.wait(0.05)
    raise TimeoutError(f"rank pid {pid} still runs after SIGKILL")


def main() -> None:
    rank, world, run_dir, scenario = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    (run_dir / f"pid{rank}").write_text(str(os.getpid()))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{run_dir / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1234)  # the same model on every rank before sharding
    model = Model().to(torch.bfloat16)
    for layer in (model.emb, model.up, model.down):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data_gen = torch.Generator().manual_seed(99)  # the same batches on every rank

    def train_step() -> None:
        x = torch.randint(0, 11, (8, 5), generator=data_gen)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def gathered() -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }

    inner = LocalStore(run_dir / "store")
    store: Store = inner
    last_rank = world - 1
    if scenario == "kill" and rank == 0:

        def kill_before_manifest(key: str) -> None:
            if key == "steps/000000000003/manifest.json":
                _kill_and_reap(int((run_dir / f"pid{last_rank}").read_text()))

        store = HookStore(inner, kill_before_manifest)
    if scenario == "straggler" and rank == 1:

        def stall(key: str) -> None:
            if key.startswith("steps/000000000003/") and not key.endswith("manifest.json"):
                _wait_for(run_dir / "rank0_gave_up_3")  # past rank 0's distributed_timeout, whatever it is

        store = HookStore(inner, stall)

    expected: dict[int, dict[str, torch.Tensor]] = {}
    events: list[dict[str, Any]] = []

    def new_uploader() -> DeltaUploader:
        return DeltaUploader(
            store, anchor_every=4, anchor_bytes_fraction=1e6, retries=0, encode_threads=1, distributed_timeout=TIMEOUT
        )

    def push(up: DeltaUploader, step: int, pushed_step: int | None = None) -> None:
        expected[step] = gathered()  # a collective: every rank, before any rank may die
        ev: dict[str, Any] = {"step": step, "pushed": step if pushed_step is None else pushed_step}
        try:
            info = up.push(model.state_dict(), ev["pushed"]).result(timeout=300)
            ev.update(ok=True, kind=info.kind, digest=info.manifest_digest, committed_step=info.committed_step)
        except CommitFailed as exc:
            ev.update(ok=False, error=str(exc), type=type(exc).__name__)
        events.append(ev)
        (run_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "events": events}))

    up = new_uploader()
    for step in range(4):
        if step:
            train_step()
        if scenario == "resume" and step == 3:
            push(up, 3)
            up.close()
            up = new_uploader()  # a restarted trainer: a new uploader on every rank, re-pushing the head
            push(up, 3)
            continue
        if scenario == "kill" and step == 3:
            push(up, 3)
            break
        if scenario == "straggler" and step == 3 and rank == 0:
            push(up, 3)
            (run_dir / "rank0_gave_up_3").write_text("")
            continue
        push(up, step)
    if scenario == "stale":
        train_step()
        push(up, 4, pushed_step=3 if rank == 1 else 4)
    after = {"stale": (5, 6, 7), "straggler": (4, 5, 6), "resume": (4, 5)}.get(scenario, ())
    for step in after:
        train_step()
        push(up, step)
    up.close()

    verified: dict[str, bool] = {}
    if rank == 0:
        fetcher = DeltaFetcher(inner, verify="full")
        target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in expected[0].items()}
        for ev in events:
            if ev["ok"] and ev["kind"] != "skipped":
                got = fetcher.sync(target, step=ev["step"])
                want = expected[ev["step"]]
                verified[str(ev["step"])] = got == ev["step"] and all(
                    torch.equal(flat_bits(target[k]), flat_bits(want[k])) for k in want
                )
    (run_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "events": events, "verified": verified}))
    if scenario != "kill":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
