"""Sharded push: real multi-process torch.distributed groups (gloo, CPU) pushing DTensor shards.

Each run starts ``world`` processes of tests/sharded_worker.py (rendezvous through a
file, gloo on the loopback interface, 60 s timeouts). Rank 0 fetches every committed
step with a single-process DeltaFetcher(verify="full") and compares it bit for bit
with the model gathered by full_tensor(). The pure parts (owner map, anchor layout,
global positions) and the device diff path are tested in-process below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rank_group import run_ranks

from deltasync.protocol import TensorInfo
from deltasync.uploader.sharded._shardmap import Box, anchor_plan, owner_map, patch_file_names, to_global, write_box

torch = pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parents[1] / "sharded_worker.py"


def _run(world: int, scenario: str, run_dir: Path) -> list[dict[str, Any]]:
    return run_ranks(WORKER, world, scenario, run_dir, timeout=240)


def _check_anchor_files(store_dir: Path, step: int) -> None:
    """The anchor written by several ranks is an ordinary HF sharded checkpoint matching its manifest:
    rank 0's writer subfolder of the step holds it, and only it (every rank wrote there)."""
    from safetensors.torch import load_file

    from deltasync._util.tensors import flat_bits
    from deltasync.protocol import Manifest
    from deltasync.protocol.digests import xxh3_128_array

    m = Manifest.from_json((store_dir / "steps" / f"{step:012d}" / "manifest.json").read_bytes())
    assert m.writer is not None
    folder = store_dir / "steps" / f"{step:012d}" / f"w{m.writer.id}"
    assert sorted(f"w{m.writer.id}/{p.name}" for p in folder.iterdir()) == sorted(f.path for f in m.files)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == {t.name for t in m.inventory}
    inv = {t.name: t for t in m.inventory}
    loaded: dict[str, Any] = {}
    for s in shards:
        loaded.update(load_file(str(folder / s)))
    assert set(loaded) == set(inv)
    for name, arr in loaded.items():
        assert tuple(arr.shape) == inv[name].shape
        assert xxh3_128_array(flat_bits(arr).numpy()) == m.tensor_digests[name]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_push_shards_and_a_fetcher_ends_bit_exact(tmp_path: Path, world: int) -> None:
    ranks = _run(world, "chain", tmp_path)
    events0 = ranks[0]["events"]
    assert [e["step"] for e in events0] == list(range(8))
    assert all(e["ok"] for r in ranks for e in r["events"])
    assert [e["kind"] for e in events0] == ["anchor", "patch", "patch"] * 2 + ["anchor", "patch"]
    for r in ranks[1:]:  # every rank's Future tells the same story
        assert [(e["kind"], e["changed"]) for e in r["events"]] == [(e["kind"], e["changed"]) for e in events0]
    for e in events0:
        assert e["fetched"] == e["step"] and e["exact"], e
        if e["kind"] == "patch":  # realistic sparsity: 1-15% of the elements change per step
            assert 0.01 * e["total"] < e["changed"] < 0.2 * e["total"], e
    _check_anchor_files(tmp_path / "store", 6)
    full = ranks[0]["full_bytes"]
    for r in ranks:  # no rank holds the full state: its baseline, staged shards and owned copies are each a part
        assert max(r["baseline_bytes"], r["staging_bytes"], r["owned_bytes"]) < 0.75 * full, r
        assert r["staging_bytes"] == r["baseline_bytes"]  # defer_diff: one staged copy of this rank's own shards
        if world == 4:
            assert r["max_buffer_bytes"] < full, r
    assert sum(r["owned_bytes"] for r in ranks) == full  # each tensor has exactly one owner


def test_a_failing_rank_fails_the_step_everywhere_and_the_next_push_recovers(tmp_path: Path) -> None:
    ranks = _run(2, "failure", tmp_path)
    for r in ranks:
        ev = {e["step"]: e for e in r["events"]}
        assert [s for s, e in ev.items() if not e["ok"]] == [3, 5, 7, 11]
        assert "rank 1: StorageError: injected write failure" in ev[3]["error"]
        assert "rank 1 reported w" in ev[5]["error"] and "/patch-" in ev[5]["error"]
        assert "the store holds" in ev[5]["error"]
        assert "the ranks pushed different steps (rank 0: 7, rank 1: 8)" in ev[7]["error"]
        assert "Partial" in ev[11]["error"] and "not supported by a sharded push" in ev[11]["error"]
        # after each failure the next push is an anchor, on every rank
        assert [ev[s]["kind"] for s in (4, 6, 9, 12)] == ["anchor"] * 4
        assert ev[10]["kind"] == "patch"
    for e in ranks[0]["events"]:
        if e["ok"]:
            assert e["fetched"] == e["step"] and e["exact"], e
    steps = sorted(p.name for p in (tmp_path / "store" / "steps").iterdir() if (p / "manifest.json").exists())
    assert [int(s) for s in steps] == [0, 1, 2, 4, 6, 9, 10, 12]  # nothing committed for a failed step


# ----------------------------------------------------------- pure parts, in-process


def _inv(*sizes: int) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(f"t{i:02d}", "BF16", (n,)) for i, n in enumerate(sizes))


def test_owner_map_is_a_contiguous_byte_balanced_split() -> None:
    inv = _inv(100, 100, 100, 100, 10, 10, 300, 80)
    for world in (1, 2, 3, 4, 8):
        owners = owner_map(inv, world)
        seq = [owners[t.name] for t in inv]
        assert seq == sorted(seq) and all(0 <= o < world for o in seq)
    owners = owner_map(inv, 4)
    load = [sum(t.nbytes for t in inv if owners[t.name] == r) for r in range(4)]
    assert max(load) <= 2 * sum(load) / 4


def test_anchor_plan_numbers_shards_in_rank_order_and_index_lists_every_tensor() -> None:
    inv = _inv(100, 100, 100, 100, 10, 10, 300, 80)
    owners = owner_map(inv, 3)
    plan = anchor_plan(inv, owners, 3, shard_bytes=250)
    names = [f for r in range(3) for f, _ in plan.shards[r]]
    assert names == [f"model-{i:05d}-of-{plan.count:05d}.safetensors" for i in range(1, plan.count + 1)]
    packed = [t for r in range(3) for _, ts in plan.shards[r] for t in ts]
    assert packed == [t.name for t in inv]  # the checkpoint stays packed in inventory order
    index = json.loads(plan.index)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in inv)
    assert set(index["weight_map"]) == {t.name for t in inv}
    # rank 0's writer id puts every rank's shards in its subfolder; the index (beside them) names
    # them relative to itself, so it is the same bytes
    own = anchor_plan(inv, owners, 3, shard_bytes=250, writer_id="ab12")
    assert [[(f, ts) for f, ts in own.shards[r]] for r in range(3)] == [
        [(f"wab12/{f}", ts) for f, ts in plan.shards[r]] for r in range(3)
    ]
    assert own.index == plan.index
    assert anchor_plan((), {}, 2, 250, writer_id="ab12").shards[0] == [("wab12/model-00001-of-00001.safetensors", [])]


def test_patch_file_names_are_disjoint_across_ranks() -> None:
    names = [n for r in range(4) for n in patch_file_names(r, 4, 3)]
    assert len(set(names)) == 12 and "patch-00000.safetensors" in names
    own = [n for r in range(4) for n in patch_file_names(r, 4, 3, writer_id="ab12")]
    assert own == [f"wab12/{n}" for n in names]


@pytest.mark.parametrize(
    ("gshape", "box"),
    [
        ((7, 5), Box((3, 5), (4, 0))),
        ((6, 13), Box((6, 4), (0, 8))),
        ((4, 6, 5), Box((2, 3, 5), (1, 3, 0))),
        ((9,), Box((9,), (0,))),
    ],
)
def test_local_positions_map_to_global_positions(gshape: tuple[int, ...], box: Box) -> None:
    full = np.arange(int(np.prod(gshape)), dtype=np.int64)
    region = tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))
    local = full.reshape(gshape)[region].reshape(-1).copy()
    idx = np.flatnonzero(np.random.default_rng(0).random(local.size) < 0.4)
    g = to_global(idx, box, gshape)
    assert np.array_equal(g, local[idx]) and np.all(np.diff(g) > 0)
    rebuilt = np.full(full.size, -1, dtype=np.int64)
    write_box(rebuilt, gshape, box, local)
    assert np.array_equal(rebuilt.reshape(gshape)[region].reshape(-1), local)


def test_device_diff_path_matches_the_numpy_path_on_cpu() -> None:
    from deltasync.uploader._diff import _diff_torch, diff_tensor

    gen = torch.Generator().manual_seed(0)
    base = torch.randint(-(2**15), 2**15, (10_000,), dtype=torch.int16, generator=gen)
    new = base.clone()
    hit = torch.rand(10_000, generator=gen) < 0.05
    new[hit] ^= 1
    b1, b2 = base.clone(), base.clone()
    c1, c2 = diff_tensor(b1, new), _diff_torch(b2, new)
    assert c1 is not None and c2 is not None
    c2.wait()
    assert np.array_equal(c1.idx, c2.idx) and np.array_equal(c1.old, c2.old) and np.array_equal(c1.new, c2.new)
    assert torch.equal(b1, new) and torch.equal(b2, new)
    assert _diff_torch(b2, new) is None


def test_distributed_true_without_a_group_is_a_clear_error(tmp_path: Path) -> None:
    from deltasync import DeltaUploader

    with pytest.raises(ValueError, match="initialized torch.distributed"):
        DeltaUploader(tmp_path / "s", distributed=True)
    with DeltaUploader(tmp_path / "s") as up:  # no group: the single-process path
        assert up._sharded is None


def test_a_change_waits_for_its_device_copies_once() -> None:
    from deltasync.uploader._diff import TensorDiff

    calls: list[int] = []

    class Event:
        def synchronize(self) -> None:
            calls.append(1)

    c = TensorDiff(np.zeros(1, np.int64), np.zeros(1, np.int16), np.ones(1, np.int16), Event())
    c.wait()
    c.wait()
    assert calls == [1] and c.ready is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_diff_matches_the_cpu_diff_and_copies_only_the_changes_to_pinned_memory() -> None:
    from deltasync.uploader._diff import diff_tensor

    gen = torch.Generator().manual_seed(1)
    base = torch.randint(-(2**15), 2**15, (1 << 20,), dtype=torch.int16, generator=gen)
    new = base.clone()
    new[torch.rand(1 << 20, generator=gen) < 0.03] ^= 3
    b_gpu = base.cuda()
    c_gpu, c_cpu = diff_tensor(b_gpu, new.cuda()), diff_tensor(base.clone(), new)
    assert c_gpu is not None and c_cpu is not None and c_gpu.ready is not None
    c_gpu.wait()
    assert np.array_equal(c_gpu.idx, c_cpu.idx) and np.array_equal(c_gpu.old, c_cpu.old)
    assert np.array_equal(c_gpu.new, c_cpu.new) and torch.equal(b_gpu.cpu(), new)
