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


# ------------------------------------------------------------------ allocation bounded by proof (issue 34)

#: run in a child whose address space is limited to 3 GiB: ``sync({})`` of the store at argv[1], what it
#: raised (class, deltasync or not, message) and the peak address space it reached, as JSON on stdout
_LIMITED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import deltasync as ds
from deltasync.errors import DeltaSyncError
target = {}
try:
    ds.DeltaFetcher(ds.open_store(sys.argv[1]), verify=sys.argv[2] == "1").sync(target)
    out = {"error": None}
except BaseException as exc:
    out = {"error": type(exc).__name__, "ours": isinstance(exc, DeltaSyncError), "message": str(exc)}
peak = [ln for ln in open("/proc/self/status") if ln.startswith("VmPeak:")][0].split()[1]
out.update(target=len(target), peak_kib=int(peak))
print(json.dumps(out))
"""


def _sync_limited(store_dir: Any, verify: bool = True) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(store_dir), "1" if verify else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _lie(path: Any, name: str, shape: list[int], dtype: str, *, grow_file: bool) -> None:
    """Rewrite the manifest at ``path`` (in the format it was written in): tensor ``name`` declared as
    ``shape``/``dtype``, the inventory digest and the stats fixed up; with ``grow_file`` the lie is
    consistent all through the manifest (the entry's byte range holds the declared bytes at the end of
    its file, whose declared size, and the stats, grow to match), so only the store's own object says
    otherwise."""
    from dataclasses import replace

    from deltasync.protocol import Manifest, TensorInfo, inventory_digest
    from deltasync.protocol.dtypes import dtype_info
    from deltasync.protocol.entries import AnchorEntry, ByteRange, FileInfo, Stats

    m = Manifest.from_json(path.read_bytes())
    inv = tuple(TensorInfo(t.name, dtype, tuple(shape)) if t.name == name else t for t in m.inventory)
    files, entries = m.files, m.entries
    if grow_file:
        nbytes = _numel(shape) * dtype_info(dtype).itemsize
        entry = next(e for e in m.entries if e.tensor == name)
        assert isinstance(entry, AnchorEntry)
        f = m.file(entry.file)
        grown = ByteRange(f.size, f.size + nbytes)
        files = tuple(FileInfo(x.path, grown.end, x.xxh3_128) if x.path == f.path else x for x in m.files)
        entries = tuple(AnchorEntry(e.tensor, e.file, grown) if e.tensor == name else e for e in m.entries)  # type: ignore[union-attr]
    stats = Stats(m.stats.changed, sum(t.numel for t in inv), sum(x.size for x in files))
    liar = replace(
        m,
        inventory=inv,
        inventory_digest=inventory_digest(inv),
        files=files,
        entries=entries,
        stats=stats,
        tensor_digests={},  # the liar drops what it cannot fake
    )
    path.write_bytes(liar.to_json())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.fixture
def local_run(tmp_path: Any) -> Any:
    """A local run of one anchor (step 0) of ``_state(0)``."""
    with ds.DeltaUploader(ds.open_store(tmp_path / "run"), anchor_every=100) as up:
        up.push(_state(0), 0).result()
    return tmp_path / "run"


def _anchor_manifest(run_dir: Any) -> Any:
    return next(p for p in run_dir.rglob("manifest.json") if f"{0:012d}" in str(p))


@pytest.mark.parametrize("verify", [True, False])
def test_a_consistent_lying_manifest_is_refused_before_allocating_under_3_gib(local_run: Any, verify: bool) -> None:
    """Issue 34: an anchor manifest that declares ``layer.w`` as 2**31 fp32 (8 GiB) and says so
    consistently (inventory digest, byte range, file size, stats) is refused from the store's own
    object size before anything is allocated: a deltasync error, not torch's allocator's RuntimeError,
    in a process that could not allocate it, with the dict left empty."""
    _lie(_anchor_manifest(local_run), "layer.w", [2**31], "F32", grow_file=True)
    out = _sync_limited(local_run, verify)
    assert out["ours"] and out["error"] == "ChecksumMismatch", out
    assert "bytes in the store, its manifest says" in out["message"] and "nothing was allocated" in out["message"]
    assert out["target"] == 0
    assert out["peak_kib"] < 3 << 20  # never tried the 8 GiB


def test_a_lying_patch_at_the_head_allocates_nothing_under_3_gib(tmp_path: Any) -> None:
    """A patch whose inventory declares a tensor its anchor never held (2**31 fp32, digest fixed up): a
    patch may only reference tensors whose sizes its chain's anchor proved, so nothing fills the dict."""
    local_run = tmp_path / "run"
    with ds.DeltaUploader(ds.open_store(local_run), anchor_every=100, anchor_bytes_fraction=0) as up:
        assert [up.push(_state(s), s).result().kind for s in (0, 1)] == ["anchor", "patch"]
    patch = next(p for p in local_run.rglob("manifest.json") if f"{1:012d}" in str(p))
    _lie(patch, "layer.w", [2**31], "F32", grow_file=False)
    out = _sync_limited(local_run)
    assert out["ours"], out
    assert out["error"] in ("ChainBroken", "InventoryMismatch"), out
    assert out["target"] == 0 and out["peak_kib"] < 3 << 20


def test_an_allocation_the_host_cannot_make_names_the_tensor_the_bytes_and_the_option() -> None:
    """What the allocator cannot give (here: 4 GiB in a process limited to 3 GiB, within the cap) is an
    AllocationFailed (also a MemoryError) naming the tensor, its bytes and the cap's option."""
    import json
    import subprocess
    import sys

    code = """
import json, resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from deltasync._util.tensors import allocate
from deltasync.errors import AllocationFailed
from deltasync.protocol import TensorInfo
try:
    allocate([TensorInfo("small", "F32", (4,)), TensorInfo("big", "F32", (1 << 30,))], 8 << 30, option="OPT")
    print(json.dumps({"error": None}))
except AllocationFailed as exc:
    print(json.dumps({"error": type(exc).__name__, "memory": isinstance(exc, MemoryError), "message": str(exc)}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "AllocationFailed" and out["memory"], out
    assert "'big'" in out["message"] and "4,294,967,296 bytes" in out["message"] and "OPT" in out["message"]
