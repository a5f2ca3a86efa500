"""A fetcher proves what a target holds before patching it, and proves what it wrote after.

Issue 11: targets were recognised by id() and data addresses, so a fresh target that reused a
collected one's id was patched forward from a state it did not hold; a manifest whose entries
dropped a tensor (its digest still saying it changed) was applied and returned as exact.
"""

from __future__ import annotations

import gc
import json
import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import ChecksumMismatch  # noqa: E402
from deltasync.protocol import build_patch_files, encode_changes, manifest_key, xxh3_128  # noqa: E402

STEPS = 8


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(512, generator=g).to(torch.bfloat16)
    v = torch.randn(64, generator=g)
    for s in range(1, step + 1):
        g.manual_seed(100 + s)
        idx = torch.randint(0, 512, (8,), generator=g)
        w[idx] = (w[idx].float() * 1.01 + 0.01).to(torch.bfloat16)
        v[s % 64] += 1.0
    return {"w": w, "v": v}


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


def _equal(target: dict[str, Any], want: dict[str, Any]) -> bool:
    return sorted(target) == sorted(want) and all(torch.equal(_bits(target[k]), _bits(want[k])) for k in want)


@pytest.fixture(scope="module")
def run() -> ds.MemoryStore:
    store = ds.MemoryStore("identity")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(STEPS):
            assert up.push(_state(s), s).result().kind == ("anchor" if s == 0 else "patch")
    return store


def _copy(store: ds.MemoryStore) -> ds.MemoryStore:
    out = ds.MemoryStore("copy")
    out.put_many({o.key: store.get(o.key) for o in store.list()})
    return out


def test_fresh_targets_through_one_long_lived_fetcher(run: ds.MemoryStore) -> None:
    """500 fresh targets (many at a reused id and reused addresses), each filled with a state the
    fetcher did not write, end exactly at the step asked for."""
    rng = random.Random(11)
    fetcher = ds.DeltaFetcher(run)
    for i in range(500):
        held = rng.randrange(STEPS)
        target = {k: v.clone() for k, v in _state(held).items()}
        if i % 3 == 0:  # garbage that is no step at all
            target["w"].view(torch.int16)[rng.randrange(512)] ^= 0x5A
        want = rng.randrange(STEPS)
        assert fetcher.sync(target, step=want) == want
        assert _equal(target, _state(want)), f"target {i} (held {held}) is not step {want}"
        del target
        if i % 50 == 0:
            gc.collect()


@pytest.mark.parametrize("verify", [True, "full"])
def test_changes_behind_the_fetchers_back(run: ds.MemoryStore, verify: Any) -> None:
    fetcher = ds.DeltaFetcher(run, verify=verify)
    target = {k: v.clone() for k, v in _state(0).items()}
    fetcher.sync(target, step=2)
    # a tracked in-place op bumps torch's version counter: the fetcher re-proves by digests
    with torch.no_grad():
        target["v"].add_(1.0)
    fetcher.sync(target, step=4)
    assert _equal(target, _state(4))
    # a write through a numpy view leaves no trace in torch; a tensor the next patch touches is
    # caught by its digest after applying, rolled back, and the fetcher restarts from the anchor
    target["w"].view(torch.int16).numpy()[3] ^= 1
    fetcher.sync(target, step=6)
    assert _equal(target, _state(6))
    # a module parameter replaced wholesale (new memory) is noticed too
    target["w"] = target["w"].clone()
    target["w"].view(torch.int16)[0] ^= 1
    fetcher.sync(target, step=7)
    assert _equal(target, _state(7))


@pytest.mark.parametrize("bump", [False, True])
def test_a_version_bump_after_steps_in_a_row_is_noticed(run: ds.MemoryStore, bump: bool) -> None:
    """Synced step after step, the fetcher keeps the version counters it read before writing (its
    writes go through the tensors' memory and bump none): a tracked in-place op afterwards is still
    noticed (without digests, the next sync starts again from the anchor), and without one the next
    sync patches from the step held."""
    fetcher = ds.DeltaFetcher(run, verify=False)
    target = {k: v.clone() for k, v in _state(0).items()}
    for step in range(1, 5):
        fetcher.sync(target, step=step)
        assert fetcher.last_stats is not None and fetcher.last_stats.base_step == (None if step == 1 else step - 1)
    if bump:
        with torch.no_grad():
            target["v"].add_(0.0)  # the same bits, a new version
    fetcher.sync(target, step=5)
    assert fetcher.last_stats is not None
    assert fetcher.last_stats.base_step == (None if bump else 4)
    assert _equal(target, _state(5))


def test_verify_full_proves_tensors_a_patch_does_not_touch(run: ds.MemoryStore) -> None:
    fetcher = ds.DeltaFetcher(run, verify="full")
    target = {k: v.clone() for k, v in _state(0).items()}
    fetcher.sync(target, step=5)
    target["v"].numpy()[63] += 5.0  # no version bump; step 6's patch does not touch v[63]
    fetcher.sync(target, step=6)
    assert _equal(target, _state(6))


@pytest.mark.parametrize("verify", [True, False])
def test_module_target_and_rebound_parameter(run: ds.MemoryStore, verify: bool) -> None:
    """Without digests to fall back on (verify=False), the identity check alone must see the rebound
    parameter: the views and the held state are both kept from the last sync, and both must let go."""

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(512, dtype=torch.bfloat16), requires_grad=False)
            self.register_buffer("v", torch.zeros(64))

    m = M()
    fetcher = ds.DeltaFetcher(run, verify=verify)
    fetcher.sync(m, step=3)
    fetcher.sync(m, step=4)  # the views and the held state are the kept ones now
    assert fetcher.current_step(m) == 4
    m.w.data = torch.zeros(512, dtype=torch.bfloat16)  # new memory behind the fetcher's back
    assert fetcher.current_step(m) is None
    fetcher.sync(m, step=5)
    assert _equal(dict(m.state_dict()), _state(5))
    m.v.data = m.v.data.view(torch.int32).view(torch.float32).clone()  # same values, new memory
    m.v.data[0] = 7.0  # untracked (a .data write bumps no version counter the fetcher reads)
    fetcher.sync(m, step=6)
    assert _equal(dict(m.state_dict()), _state(6))


@pytest.mark.parametrize("version", [1, 2])
def test_dropped_patch_entry_is_a_checksum_mismatch(version: int) -> None:
    """A patch whose entries omit a tensor its digests say changed is refused; the target is untouched
    (in both manifest formats: format 2 would code v and w as one group entry)."""
    store = ds.MemoryStore(f"identity-v{version}")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, format_version=version) as up:
        for s in range(6):
            up.push(_state(s), s).result()
    # a consistent lie: the patch file is rebuilt without v's blobs, sizes and checksums fixed up,
    # while the manifest's tensor digest of v still says that v changed
    body = json.loads(store.get(manifest_key(5)))
    items = []
    old, new = _state(4), _state(5)
    w_old, w_new = old["w"].view(torch.int16).numpy(), new["w"].view(torch.int16).numpy()
    idx = np.flatnonzero(w_old != w_new).astype(np.int64)
    items.append(("w", encode_changes(w_old.size, idx, w_old[idx], w_new[idx])))
    files, entries = build_patch_files(5, items, 1 << 30)
    for f in body["files"]:
        store.delete_many([f"steps/{5:012d}/{f['path']}"])
    body["files"] = []
    for name, data in files.items():
        store.put(f"steps/{5:012d}/{name}", data)
        body["files"].append({"path": name, "size": len(data), "xxh3_128": xxh3_128(data)})
    if version == 2:
        from deltasync.protocol.manifest import Manifest
        from deltasync.protocol.manifest_v2 import group_entry_to_json

        index = {t.name: i for i, t in enumerate(Manifest.from_json(store.get(manifest_key(5))).inventory)}
        body["entries"] = [group_entry_to_json(e, index) for e in entries]
    else:
        body["entries"] = [e.to_json() for e in entries]
    body["stats"]["nbytes"] = sum(len(d) for d in files.values())
    store.put(manifest_key(5), json.dumps(body).encode())
    fetcher = ds.DeltaFetcher(store)
    target = {k: v.clone() for k, v in _state(0).items()}
    fetcher.sync(target, step=4)
    with pytest.raises(ChecksumMismatch, match="'v'"):
        fetcher.sync(target, step=5)
    assert _equal(target, _state(4))
    fresh = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    before = {k: v.clone() for k, v in fresh.items()}
    with pytest.raises(ChecksumMismatch):
        ds.DeltaFetcher(store).sync(fresh, step=5)  # from the anchor: proven off the target
    assert _equal(fresh, before)


def test_verify_full_needs_digests() -> None:
    store = ds.MemoryStore("nodigests")
    with ds.DeltaUploader(store, tensor_digests=False) as up:
        up.push(_state(0), 0).result()
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    with pytest.raises(ChecksumMismatch, match="verify='full'"):
        ds.DeltaFetcher(store, verify="full").sync(target)
    assert ds.DeltaFetcher(store, verify=True).sync(target) == 0
    with pytest.raises(ValueError, match="verify"):
        ds.DeltaFetcher(store, verify="yes")  # type: ignore[arg-type]
