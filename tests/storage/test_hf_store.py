"""HFBucketStore: the conformance suite and backend specifics, against the fake Hub.

The real huggingface_hub + hf_xet code runs unmodified; only the Hub is fake
(``tests/fakehub.py``) and the Xet CAS is hf_xet's own ``local://`` store.
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fakehub import TOKEN, FakeHub, hf_store, new_bucket, raw_path, shard_file_sizes
from hypothesis import HealthCheck, settings

from deltasync.errors import (
    AlreadyExists,
    DeltaSyncError,
    InvalidKey,
    ObjectNotFound,
    ObjectTooLarge,
    StorageError,
    TransientStorageError,
)
from deltasync.storage import HFBucketStore, open_store
from deltasync.storage._hf import parse_hf_url, translate_hf_error
from deltasync.testing.store import StoreTests


def _api(hub: FakeHub) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.endpoint, token=TOKEN)


class TestHFBucketStore(StoreTests[HFBucketStore]):
    big_object_size: ClassVar[int] = 3 * 1024 * 1024 + 7
    state_machine_settings: ClassVar[settings] = settings(
        max_examples=12,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

    @pytest.fixture(autouse=True)
    def _hub(self, fake_hub: FakeHub) -> None:
        self.hub = fake_hub

    at_bucket_root: ClassVar[bool] = False

    def make_store(self, path: Path) -> HFBucketStore:
        # a fresh bucket per store, the run under a prefix (or at the bucket's root, below)
        prefix = "" if self.at_bucket_root else f"runs/{path.name}"
        return hf_store(self.hub, new_bucket(self.hub), prefix)

    def raw_get(self, store: HFBucketStore, key: str) -> bytes | None:
        api = _api(self.hub)
        remote = raw_path(store, key)
        infos = list(api.get_bucket_paths_info(store.bucket_id, [remote]))
        if not infos:
            return None
        if infos[0].size == 0:
            return b""
        dest = Path(store._tmpdir()) / "raw-get.bin"
        api.download_bucket_files(store.bucket_id, [(infos[0], dest)])
        try:
            return dest.read_bytes()
        finally:
            dest.unlink()

    def raw_put(self, store: HFBucketStore, key: str, data: bytes) -> None:
        _api(self.hub).batch_bucket_files(store.bucket_id, add=[(bytes(data), raw_path(store, key))])

    def test_concurrent_create_has_exactly_one_winner(self, store: HFBucketStore) -> None:
        """Replaces the suite's test: without conditional writes, racing creates may all "win".

        What still holds: at least one writer wins, the object is whole (one writer's
        bytes, never a mix), and a create after the race sees the object and refuses.
        """
        assert not store.supports_conditional_put
        n = 8
        payloads = [f"writer {i:02d};".encode() * (1000 + i) for i in range(n)]
        barrier = threading.Barrier(n)

        def attempt(i: int) -> bool:
            barrier.wait(timeout=60)
            try:
                store.put("steps/000000000001/manifest.json", payloads[i], mode="create")
            except AlreadyExists:
                return False
            return True

        with ThreadPoolExecutor(max_workers=n) as pool:
            won = list(pool.map(attempt, range(n)))
        assert any(won)
        got = store.get("steps/000000000001/manifest.json")
        assert got in [p for p, w in zip(payloads, won, strict=True) if w]
        with pytest.raises(AlreadyExists):
            store.put("steps/000000000001/manifest.json", b"late", mode="create")


class TestHFBucketStoreAtBucketRoot(TestHFBucketStore):
    """The same suite with keys at the bucket's root (no prefix)."""

    at_bucket_root = True


# -- URLs and open_store ------------------------------------------------------------


def test_parse_hf_url() -> None:
    assert parse_hf_url("hf://buckets/ns/b") == ("ns/b", "")
    assert parse_hf_url("hf://buckets/ns/b/") == ("ns/b", "")
    assert parse_hf_url("hf://buckets/ns/b/run/1") == ("ns/b", "run/1")
    for bad in ("hf://ns/b", "hf://buckets/ns", "hf://buckets//b", "hf://buckets/ns/b/../x", "hf://buckets/ns/b/a//c"):
        with pytest.raises(StorageError, match="hf://buckets/|invalid prefix"):
            parse_hf_url(bad)


def test_open_store_hf_url_uses_endpoint_env(hf_env: FakeHub, hf_bucket: str) -> None:
    with open_store(f"hf://buckets/{hf_bucket}/exp/1") as store:
        assert isinstance(store, HFBucketStore)
        assert (store.bucket_id, store.prefix, store.endpoint) == (hf_bucket, "exp/1", hf_env.endpoint)
        assert store.url == f"hf://buckets/{hf_bucket}/exp/1"
        store.put("HEAD.json", b"{}")
    assert hf_env.file_entry(hf_bucket, "exp/1/HEAD.json") is not None
    assert hf_env.count("POST", f"/api/buckets/{hf_bucket}/batch") == 1


def test_open_store_prefers_deltasync_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert open_store("hf://buckets/a/b").endpoint == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    monkeypatch.setenv("DELTASYNC_HF_ENDPOINT", "http://127.0.0.1:10/")
    assert open_store("hf://buckets/a/b").endpoint == "http://127.0.0.1:10"  # type: ignore[attr-defined]


def test_invalid_bucket_ids() -> None:
    for bad in ("nobucket", "/b", "a/", "a/b/c"):
        with pytest.raises(StorageError, match="invalid bucket id"):
            HFBucketStore(bad, endpoint="http://127.0.0.1:9")
    with pytest.raises(InvalidKey):
        HFBucketStore("a/b", "x/../y", endpoint="http://127.0.0.1:9")


# -- batching -------------------------------------------------------------------------


def test_one_batch_call_per_put_many(fake_hub: FakeHub, hf_bucket: str, tmp_path: Path) -> None:
    store = hf_store(fake_hub, hf_bucket, spill_bytes=1000)
    src = tmp_path / "big.bin"
    src.write_bytes(b"p" * 5000)
    before = fake_hub.count("POST", r"/batch$")
    store.put_many(
        {"steps/000000000001/a": b"small", "steps/000000000001/b": bytearray(b"s" * 4000), "steps/000000000001/c": src},
        mode="create",
    )
    assert fake_hub.count("POST", r"/batch$") == before + 1
    assert store.get_many(["steps/000000000001/a", "steps/000000000001/b", "steps/000000000001/c"]) == {
        "steps/000000000001/a": b"small",
        "steps/000000000001/b": b"s" * 4000,
        "steps/000000000001/c": b"p" * 5000,
    }
    # the spilled temp file is gone; reading three objects is one paths-info + one download group
    assert list(Path(store._tmpdir()).iterdir()) == []
    n_info, n_resolve = fake_hub.count("POST", r"/paths-info$"), fake_hub.count("HEAD", r"/resolve/")
    store.get_many(["steps/000000000001/a", "steps/000000000001/b", "steps/000000000001/c"])
    assert fake_hub.count("POST", r"/paths-info$") == n_info + 1
    assert fake_hub.count("HEAD", r"/resolve/") == n_resolve + 1
    store.close()
    assert not store._tmp


def test_a_bounded_read_downloads_nothing_of_an_object_over_its_limit(fake_hub: FakeHub, hf_bucket: str) -> None:
    """The sizes come from the paths-info request every read makes first."""
    store = hf_store(fake_hub, hf_bucket)
    store.put_many({"probes.json": b"p" * 5000, "HEAD.json": b"{}"})
    n_info, n_resolve = fake_hub.count("POST", r"/paths-info$"), fake_hub.count("HEAD", r"/resolve/")
    with pytest.raises(ObjectTooLarge, match="probes.json holds 5000 bytes, over the 4999-byte limit"):
        store.get_many_bounded({"HEAD.json": 2, "probes.json": 4999})
    assert fake_hub.count("POST", r"/paths-info$") == n_info + 1
    assert fake_hub.count("HEAD", r"/resolve/") == n_resolve, "nothing was downloaded"
    assert store.get_many_bounded({"HEAD.json": 2, "probes.json": 5000}) == {
        "HEAD.json": b"{}",
        "probes.json": b"p" * 5000,
    }
    store.close()


def test_listing_pages(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    items = {f"steps/{i:012d}/manifest.json": bytes([i]) * i for i in range(130)}  # page_size is 50
    store.put_many(items)
    assert {o.key: o.size for o in store.list("steps/")} == {k: len(v) for k, v in items.items()}
    assert [o.key for o in store.list("steps/00000000012")] == [
        f"steps/{i:012d}/manifest.json" for i in range(120, 130)
    ]


def test_prefixes_isolate_runs(fake_hub: FakeHub, hf_bucket: str) -> None:
    a, ab, root = (
        hf_store(fake_hub, hf_bucket, "a"),
        hf_store(fake_hub, hf_bucket, "a/b"),
        hf_store(fake_hub, hf_bucket, ""),
    )
    a.put("x", b"1")
    ab.put("x", b"2")
    root.put("ab", b"3")
    assert [o.key for o in a.list()] == ["b/x", "x"]
    assert [o.key for o in ab.list()] == ["x"]
    assert [o.key for o in root.list()] == ["a/b/x", "a/x", "ab"]
    assert ab.get("x") == b"2" and a.get("b/x") == b"2"
    ab.delete_many(["x"])
    assert a.get("x") == b"1" and [o.key for o in root.list()] == ["a/x", "ab"]


def test_create_is_best_effort_and_checks_first(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    assert HFBucketStore.supports_conditional_put is False
    store.put("steps/000000000001/f", b"old")
    before = fake_hub.count("POST", r"/batch$")
    with pytest.raises(AlreadyExists, match="steps/000000000001/f"):
        store.put_many({"steps/000000000001/g": b"g", "steps/000000000001/f": b"new"}, mode="create")
    assert fake_hub.count("POST", r"/batch$") == before, "nothing is uploaded when a key exists"
    assert not store.exists("steps/000000000001/g")


def test_create_bucket_if_missing(fake_hub: FakeHub) -> None:
    bucket_id = "ns/created-by-store"
    with pytest.raises(StorageError, match="not found or not accessible") as info:
        hf_store(fake_hub, bucket_id).put("k", b"v")
    assert not isinstance(info.value, ObjectNotFound)
    store = hf_store(fake_hub, bucket_id, create=True)
    assert fake_hub.buckets[bucket_id].private
    store.put("k", b"v")
    again = hf_store(fake_hub, bucket_id, create=True)  # exists: fine
    assert again.get("k") == b"v"


# -- error mapping ---------------------------------------------------------------------


def test_bad_token_is_a_storage_error_naming_the_token(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = HFBucketStore(hf_bucket, endpoint=fake_hub.endpoint, token="hf_wrong")
    for call in (lambda: store.put("k", b"v"), lambda: store.get("k"), lambda: store.list()):
        with pytest.raises(StorageError, match="HF_TOKEN") as info:
            call()
        assert not isinstance(info.value, TransientStorageError | ObjectNotFound)
        assert info.value.__cause__ is not None


def test_5xx_on_single_attempt_calls_is_transient(fake_hub: FakeHub, hf_bucket: str) -> None:
    fake_hub.fail(r"^/api/buckets/ns/never-made$", method="POST", status=503)
    with pytest.raises(TransientStorageError, match="503"):
        hf_store(fake_hub, "ns/never-made", create=True)


def test_hub_retries_a_429_with_retry_after(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    store.put("k", b"v")
    fault = fake_hub.fail(r"/paths-info$", status=429, retry_after=0)
    assert store.get("k") == b"v"  # huggingface_hub's own backoff honours Retry-After
    assert fault.hits == 1


def test_partial_batch_failure_is_transient_and_retry_is_harmless(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    items = {f"steps/000000000003/f{i}": bytes([i]) * 100 for i in range(4)}
    fake_hub.fail_batch_paths(r"f2$")
    with pytest.raises(TransientStorageError, match="f2") as info:
        store.put_many(items)
    assert {o.key for o in store.list()} == set(items) - {"steps/000000000003/f2"}
    store.put_many(items)  # the same batch again: re-adds the same bytes
    assert store.get_many(list(items)) == items
    assert pickle.loads(pickle.dumps(info.value)).message == info.value.message


def test_translate_errors() -> None:
    import httpx2
    from huggingface_hub import errors as hf

    req = httpx2.Request("GET", "http://127.0.0.1/api/buckets/a/b/tree")

    def http(status: int, cls: type[Exception] = hf.HfHubHTTPError, url: str = "/api/buckets/a/b/tree") -> Exception:
        response = httpx2.Response(status, request=httpx2.Request("GET", f"http://127.0.0.1{url}"))
        return cls(f"{status} error", response=response)  # type: ignore[call-arg]

    cases: list[tuple[Exception, type[DeltaSyncError]]] = [
        (http(500), TransientStorageError),
        (http(502), TransientStorageError),
        (http(429), TransientStorageError),
        (http(408), TransientStorageError),
        (http(401), StorageError),
        (http(403), StorageError),
        (http(404), ObjectNotFound),
        (http(404, url="/buckets/a/b/resolve/k"), ObjectNotFound),
        (http(404, url="/api/buckets/a/b/paths-info"), StorageError),
        (http(404, url="/api/buckets/a/b/xet-write-token"), StorageError),
        (http(400), StorageError),
        (http(404, hf.RemoteEntryNotFoundError), ObjectNotFound),
        (httpx2.ConnectError("refused", request=req), TransientStorageError),
        (httpx2.ReadTimeout("slow", request=req), TransientStorageError),
        (RuntimeError("xet: connection reset"), TransientStorageError),
        (ValueError("odd"), StorageError),
        (hf.OfflineModeIsEnabled("offline"), StorageError),
        (hf.BucketBatchError("partial", response=httpx2.Response(200, request=req)), TransientStorageError),
    ]
    for exc, want in cases:
        got = translate_hf_error(exc, "op", "a/b")
        assert type(got) is want, (exc, got)
        assert "op" in str(got)
    assert "HF_TOKEN" in str(translate_hf_error(http(401), "op", "a/b"))
    assert "HF_HUB_OFFLINE" in str(translate_hf_error(hf.OfflineModeIsEnabled("x"), "op", "a/b"))


def test_shard_parser_matches_uploaded_sizes(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    store.put_many({"a": b"x" * 12345, "b": b"y"})
    sizes: dict[str, int] = {}
    for shard in fake_hub.cas_dir.rglob("*.mdb"):
        sizes.update(shard_file_sizes(shard.read_bytes()))
    for key, size in (("a", 12345), ("b", 1)):
        entry = fake_hub.file_entry(hf_bucket, raw_path(store, key))
        assert entry is not None and sizes[entry[0]] == size == entry[1]
