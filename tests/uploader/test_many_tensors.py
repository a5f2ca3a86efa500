"""A step's work at many tensors and large ones: format 2's groups, chunked diffs, thread counts.

Bit-exactness is checked against a reader; the groups and chunks are checked by what the writer
produced. Timings are benchmarks/bench_scale.py's, never asserted here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync._util.batches import map_batched, results, split_even
from deltasync._util.cpus import usable_cpus
from deltasync.protocol import TensorInfo
from deltasync.uploader import _snapshot
from deltasync.uploader._commit_step import change_groups
from deltasync.uploader._job import StepJob

torch = pytest.importorskip("torch")


def _moe(seed: int, experts: int = 24) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = {
        f"layers.{i}.experts.{e}.w": torch.randn(8, 16, generator=g).to(torch.bfloat16)
        for i in range(2)
        for e in range(experts)
    }
    out["embed"] = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    out["norm"] = torch.randn(16, generator=g)  # F32: a group of its own dtype
    return out


def _step(state: dict[str, Any], seed: int, frac: float = 0.1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bits = v.clone().view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32).reshape(-1)
        pos = torch.randint(0, bits.numel(), (max(1, int(bits.numel() * frac)),), generator=g)
        bits[pos] += 1
        out[k] = bits.view(v.dtype).reshape(v.shape)
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_many_small_tensors_round_trip(version: int) -> None:
    store = ds.MemoryStore(f"many-v{version}")
    states = [_moe(0)]
    for s in range(1, 4):
        states.append(_step(states[-1], s))
    with ds.DeltaUploader(
        store, anchor_every=100, anchor_bytes_fraction=0, format_version=version, span_levels=()
    ) as up:
        infos = [up.push(s, i).result(30) for i, s in enumerate(states)]
    assert [i.kind for i in infos] == ["anchor", "patch", "patch", "patch"]
    m = ds.DeltaFetcher(store).manifest(3)
    assert m.format_version == version
    if version == 2:
        # the 49 BF16 tensors changed and come in one group; the F32 norm has its own entry
        assert sorted(len(e.tensors) for e in m.entries) == [1, 49]
    else:
        assert len(m.entries) == len(states[0])
    target = snapshot(states[0])
    f = ds.DeltaFetcher(store, verify="full")
    for step in (1, 3, 2):
        f.sync(target, step=step)
        assert_state_equal(target, states[step])


def test_change_groups_cut_by_dtype_and_size() -> None:
    inv = (
        TensorInfo("a", "BF16", (4,)),
        TensorInfo("b", "BF16", (4,)),
        TensorInfo("c", "F32", (4,)),
        TensorInfo("d", "BF16", (10,)),
        TensorInfo("e", "BF16", (4,)),
        TensorInfo("f", "BF16", (4,)),
    )
    job = StepJob(1, "patch", inv, changes=dict.fromkeys("abcdef", None))  # type: ignore[arg-type]
    assert change_groups(job, 8) == [("a", "b"), ("c",), ("d",), ("e", "f")]
    assert change_groups(job, 0) == [(n,) for n in "abcdef"]


@pytest.mark.parametrize("limit", [0, 1, 7, 64, 1 << 22])
def test_compiled_group_cuts_equal_the_python_loop(limit: int) -> None:
    """Past 64 names the cut is one compiled pass: the same groups as the per-name loop, with
    dtype changes, empty tensors and tensors over the limit."""
    from deltasync.protocol import kernels
    from deltasync.uploader._commit_step import cut_groups

    if not kernels.available():
        pytest.skip("numba cannot be imported here")
    rng = np.random.default_rng(limit)
    inv = tuple(
        TensorInfo(f"t{i:04d}", str(rng.choice(["BF16", "BF16", "BF16", "F32"])), (int(rng.integers(0, 40)),))
        for i in range(300)
    )
    names = sorted(rng.choice([t.name for t in inv], 200, replace=False).tolist())
    with kernels.using("numba"):
        fast = cut_groups(names, inv, limit)
    with kernels.using("numpy"):
        slow = cut_groups(names, inv, limit)
    assert fast == slow and sum(map(len, fast)) == len(names)


def test_a_large_tensor_is_diffed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor of more than DIFF_CHUNK elements is diffed chunk by chunk (on several threads); the
    patch and the follower are the same as when it is diffed whole."""
    outputs = []
    for chunk in (7, 1 << 23):
        monkeypatch.setattr(_snapshot, "DIFF_CHUNK", chunk)
        store = ds.MemoryStore(f"chunks-{chunk}")
        states = [_moe(1, experts=2)]
        states.append(_step(states[-1], 5, frac=0.3))
        with ds.DeltaUploader(store, encode_threads=3, span_levels=()) as up:
            for i, s in enumerate(states):
                up.push(s, i).result(30)
        target = snapshot(states[0])
        ds.DeltaFetcher(store).sync(target, step=1)
        assert_state_equal(target, states[1])
        outputs.append({o.key: store.get(o.key) for o in store.list("steps/000000000001/") if "patch" in o.key})
    assert [list(o.values()) for o in outputs[:1]] == [list(o.values()) for o in outputs[1:]]


def test_threads_follow_the_cpus_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    assert usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert usable_cpus() == 3
    assert ds.DeltaFetcher(ds.MemoryStore("cpus")).threads == 3
    with ds.DeltaUploader(ds.MemoryStore("cpus-up")) as up:
        assert up._pool._max_workers == 3  # noqa: SLF001 - the pool the encodes run on
    assert ds.DeltaFetcher(ds.MemoryStore("one"), threads=1).threads == 1


def test_batches_keep_order_and_every_error() -> None:
    assert split_even([], 4) == []
    for weights in ([1] * 10, [100, 1, 1, 1, 100], [5], [0, 0, 0]):
        ranges = split_even(weights, 3)
        assert [i for r in ranges for i in r] == list(range(len(weights)))
        assert len(ranges) <= 3 or len(ranges) <= len(weights)

    def fn(x: int) -> int:
        if x % 4 == 3:
            raise ValueError(f"bad {x}")
        return x * 2

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        out = map_batched(pool, fn, list(range(10)), parts=3)
    assert [v for v, _ in out] == [0, 2, 4, None, 8, 10, 12, None, 16, 18]
    assert [str(e) for _, e in out if e is not None] == ["bad 3", "bad 7"]
    with pytest.raises(ValueError, match="bad 3"):
        results(out)
    assert results(map_batched(None, abs, [-1, 2])) == [1, 2]
    assert np.array_equal(np.array(results(map_batched(None, abs, [-3]))), np.array([3]))


def test_a_runs_inventory_is_written_and_parsed_once_not_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of a run carries the same inventory: the writer encodes it once (the memo keeps the
    uploader's inventory object while it is equal) and a reader parses the same string once."""
    from deltasync.protocol import manifest_v2
    from deltasync.uploader import _commit_step

    written: list[int] = []
    parsed: list[int] = []
    encode, decode = _commit_step.inventory_fields, manifest_v2._decode_inventory_digest

    def counting_encode(inv: Any) -> tuple[str, str]:
        written.append(len(inv))
        return encode(inv)

    def counting_decode(v: Any, what: str) -> Any:
        parsed.append(len(v))
        return decode(v, what)

    monkeypatch.setattr(_commit_step, "inventory_fields", counting_encode)
    monkeypatch.setattr(manifest_v2, "_decode_inventory_digest", counting_decode)
    monkeypatch.setattr(manifest_v2, "_PARSED", {})
    store = ds.MemoryStore("inventory-once")
    states = [_moe(0)]
    for s in range(1, 5):
        states.append(_step(states[-1], s))
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, span_levels=()) as up:
        for i, s in enumerate(states):
            up.push({k: v.clone() for k, v in s.items()}, i).result(30)  # new tensor objects every step
    assert len(written) == 1
    fetcher = ds.DeltaFetcher(store)
    target = {k: v.clone() for k, v in states[0].items()}
    for i in range(len(states)):
        fetcher.sync(target, step=i)
    assert_state_equal(target, states[-1])
    assert len(parsed) == 1
    # a different inventory is parsed (and refused or accepted) on its own, never served from the cache
    other = {**states[-1], "extra": torch.zeros(3)}
    with ds.DeltaUploader(ds.MemoryStore("other"), span_levels=()) as up:
        up.push(other, 0).result(30)
    assert len(written) == 2
