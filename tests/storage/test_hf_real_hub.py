"""HFBucketStore against the REAL Hugging Face Hub: only with ``HF_TOKEN`` set (marker ``hub``).

    HF_TOKEN=hf_... python -m pytest -m hub tests/test_hf_real_hub.py

Uses the bucket ``DELTASYNC_HF_TEST_BUCKET`` (``<namespace>/<bucket>``; default:
``<your user>/deltasync-tests``, created private if missing), each test under its own
random prefix, deleted afterwards. ``DELTASYNC_HF_ENDPOINT`` / ``HF_ENDPOINT`` pick
another Hub. These are the only skipped tests of the suite.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings

import deltasync as ds
from deltasync.errors import ObjectNotFound
from deltasync.storage import HFBucketStore
from deltasync.storage._hf import DEFAULT_ENDPOINT
from deltasync.testing.store import StoreTests

pytestmark = [
    pytest.mark.hub,
    pytest.mark.skipif(not os.environ.get("HF_TOKEN"), reason="needs HF_TOKEN to reach the real Hub"),
]


def _endpoint() -> str:
    return os.environ.get("DELTASYNC_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


@pytest.fixture(scope="module")
def bucket_id() -> str:
    from huggingface_hub import HfApi

    bucket = os.environ.get("DELTASYNC_HF_TEST_BUCKET")
    if not bucket:
        bucket = f"{HfApi(endpoint=_endpoint()).whoami()['name']}/deltasync-tests"
    HFBucketStore(bucket, endpoint=_endpoint(), create=True).close()
    return bucket


def _cleanup(store: HFBucketStore) -> None:
    store.delete_many([o.key for o in store.list()])
    store.close()


class TestRealHubStore(StoreTests[HFBucketStore]):
    big_object_size: ClassVar[int] = 3 * 1024 * 1024 + 7
    state_machine_settings: ClassVar[settings] = settings(
        max_examples=3, stateful_step_count=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )

    @pytest.fixture(autouse=True)
    def _bucket(self, bucket_id: str) -> Iterator[None]:
        self.bucket_id = bucket_id
        self.made: list[HFBucketStore] = []
        yield
        for store in self.made:
            _cleanup(HFBucketStore(store.bucket_id, store.prefix, endpoint=_endpoint()))

    def make_store(self, path: Path) -> HFBucketStore:
        store = HFBucketStore(self.bucket_id, f"t/{uuid.uuid4().hex[:12]}", endpoint=_endpoint())
        self.made.append(store)
        return store

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=_endpoint())

    def raw_get(self, store: HFBucketStore, key: str) -> bytes | None:
        remote = f"{store.prefix}/{key}"
        infos = list(self._api().get_bucket_paths_info(store.bucket_id, [remote]))
        if not infos:
            return None
        if infos[0].size == 0:
            return b""
        dest = store._tmpdir() / "raw-get.bin"
        self._api().download_bucket_files(store.bucket_id, [(infos[0], dest)])
        try:
            return dest.read_bytes()
        finally:
            dest.unlink()

    def raw_put(self, store: HFBucketStore, key: str, data: bytes) -> None:
        self._api().batch_bucket_files(store.bucket_id, add=[(bytes(data), f"{store.prefix}/{key}")])

    def test_concurrent_create_has_exactly_one_winner(self, store: HFBucketStore) -> None:
        assert not store.supports_conditional_put  # the bucket API has no conditional write


def test_push_and_fetch_through_the_real_hub(bucket_id: str) -> None:
    torch = pytest.importorskip("torch")
    store = HFBucketStore(bucket_id, f"e2e/{uuid.uuid4().hex[:12]}", endpoint=_endpoint())
    try:
        g = torch.Generator().manual_seed(0)
        states = [{"w": torch.randn(10_000, generator=g).to(torch.bfloat16)}]
        for _ in range(3):
            nxt = states[-1]["w"].clone()
            nxt[torch.randperm(10_000, generator=g)[:100]] += 1
            states.append({"w": nxt})
        with ds.DeltaUploader(store, anchor_every=10, on_backlog="block") as up:
            kinds = [up.push(s, i).result(300).kind for i, s in enumerate(states)]
        assert kinds == ["anchor", "patch", "patch", "patch"]
        target = {"w": torch.zeros(10_000, dtype=torch.bfloat16)}
        assert ds.DeltaFetcher(store).sync(target) == 3
        assert torch.equal(target["w"].view(torch.int16), states[3]["w"].view(torch.int16))
        with pytest.raises(ObjectNotFound):
            store.get("steps/000000000099/manifest.json")
    finally:
        _cleanup(store)
