"""``fetcher.sync({})`` allocates the run's tensors; a failed sync leaves the dict empty again (issue 15)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import ChecksumMismatch, DeltaSyncError, InventoryMismatch  # noqa: E402
from deltasync.protocol import manifest_key  # noqa: E402


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 8, generator=g).to(torch.bfloat16)
    b = torch.randn(8, generator=g)
    n = torch.arange(5, dtype=torch.int64)
    w.view(-1)[: step * 3] += 0.5
    b[step % 8] += float(step)
    return {"layer.w": w, "layer.b": b, "count": n, "scalar": torch.tensor(float(step))}


@pytest.fixture
def run() -> ds.MemoryStore:
    store = ds.MemoryStore("alloc")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(4):
            up.push(_state(s), s).result()
    return store


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in b
    )


@pytest.mark.parametrize("verify", [False, True, "full"])
def test_empty_dict_is_allocated_and_filled(run: ds.MemoryStore, verify: Any) -> None:
    target: dict[str, Any] = {}
    fetcher = ds.DeltaFetcher(run, verify=verify)
    assert fetcher.sync(target) == 3
    assert _same(target, _state(3))
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in target.values())
    # the allocated tensors are the fetcher's own from then on: the next sync patches them
    assert fetcher.sync(target, step=1) == 1
    assert _same(target, _state(1))


def test_failed_sync_leaves_the_dict_empty(run: ds.MemoryStore) -> None:
    anchor = run.get(manifest_key(0))
    run.put(manifest_key(0), anchor[: len(anchor) // 2])  # the only anchor is unreadable
    target: dict[str, Any] = {}
    with pytest.raises(DeltaSyncError):
        ds.DeltaFetcher(run).sync(target)
    assert target == {}


def test_corrupt_anchor_data_leaves_the_dict_empty(run: ds.MemoryStore) -> None:
    key = next(o.key for o in run.list() if o.key.endswith(".safetensors") and "/00000000" in o.key)
    blob = bytearray(run.get(key))
    blob[-1] ^= 0xFF
    run.put(key, bytes(blob))
    target: dict[str, Any] = {}
    with pytest.raises(ChecksumMismatch):
        ds.DeltaFetcher(run, verify=True).sync(target)
    assert target == {}


def test_non_empty_mismatching_dict_says_an_empty_one_works(run: ds.MemoryStore) -> None:
    target = {"layer.w": torch.zeros(256, 8, dtype=torch.bfloat16)}
    with pytest.raises(InventoryMismatch, match="pass an empty dict"):
        ds.DeltaFetcher(run).sync(target)
    assert list(target) == ["layer.w"] and not target["layer.w"].any()


def test_a_run_declaring_more_than_the_cap_is_refused_before_allocating(
    run: ds.MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or real_zeros(*a, **k))
    target: dict[str, Any] = {}
    fetcher = ds.DeltaFetcher(run, max_alloc_bytes=1024)  # the run declares 4,172 bytes
    with pytest.raises(InventoryMismatch, match="max_alloc_bytes") as info:
        fetcher.sync(target)
    assert "pass an empty dict" not in str(info.value)  # it was one
    assert target == {} and made == []
    assert ds.DeltaFetcher(run, max_alloc_bytes=4200).sync(target) == 3 and _same(target, _state(3))
