"""The uploader's retry of commit writes: policy, idempotent re-writes, giving up, the next anchor."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from spy_store import SpyStore
from tensors import assert_state_equal

import deltasync as ds
from deltasync._util.retry import RetryPolicy
from deltasync.errors import AlreadyExists, CommitFailed, StorageError, TransientStorageError
from deltasync.storage.base import Data, PutMode
from deltasync.uploader._commit_step import put_idempotent, with_retries

torch = pytest.importorskip("torch")
WAIT = 30.0


class FlakyStore(SpyStore):
    """A SpyStore whose ``put_many`` writes only part of a batch, then raises TransientStorageError.

    ``flaky(keys) -> int``: how many of the batch's objects to write before failing
    (-1: do not fail). Decided per call, so tests script sequences of failures.
    """

    def __init__(self, inner: ds.Store) -> None:
        super().__init__(inner)
        self.flaky: Any = None
        self.calls = 0

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        if all(k.startswith("writers/") for k in items):  # the writer claim (first push)
            super().put_many(items, mode=mode)
            return
        self.calls += 1
        n = self.flaky(list(items)) if self.flaky else -1
        if n < 0:
            super().put_many(items, mode=mode)
            return
        part = dict(list(items.items())[:n])
        if part:
            super().put_many(part, mode=mode)
        raise TransientStorageError(f"FlakyStore: injected partial batch ({n} of {len(items)} written)")


def test_policy_delays_and_validation() -> None:
    p = RetryPolicy(retries=5, backoff=0.5, max_backoff=3.0)
    assert [p.delay(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)
    with pytest.raises(ValueError):
        RetryPolicy(backoff=-1)
    with pytest.raises(ValueError):
        ds.DeltaUploader(ds.MemoryStore(), retries=-1)


def test_with_retries_retries_only_transient_errors() -> None:
    waits: list[float] = []
    calls = iter([TransientStorageError("503"), TransientStorageError("429"), "ok"])

    def fn() -> str:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert with_retries(fn, RetryPolicy(3, 0.25), "step 9: x", wait=waits.append) == "ok"
    assert waits == [0.25, 0.5]

    def boom() -> None:
        raise StorageError("permission denied")

    with pytest.raises(StorageError, match="permission denied"):
        with_retries(boom, RetryPolicy(3, 0.25), "w", wait=waits.append)
    assert waits == [0.25, 0.5], "a non-transient error is not retried"

    def always() -> None:
        raise TransientStorageError("HTTP 503")

    with pytest.raises(CommitFailed, match=r"step 9: writing: gave up after 3 attempts: HTTP 503") as info:
        with_retries(always, RetryPolicy(2, 0.0), "step 9: writing", wait=waits.append)
    assert isinstance(info.value.__cause__, TransientStorageError)


def test_put_idempotent(tmp_path: Path) -> None:
    store = ds.MemoryStore()
    items: dict[str, Data] = {"steps/000000000001/a": b"A", "steps/000000000001/b": bytearray(b"B")}
    store.put("steps/000000000001/a", b"A")  # left by an earlier, partly failed attempt
    put_idempotent(store, items)
    assert store.get_many(list(items)) == {"steps/000000000001/a": b"A", "steps/000000000001/b": b"B"}
    put_idempotent(store, items)  # all there already: nothing to do
    src = tmp_path / "c"
    src.write_bytes(b"C")
    put_idempotent(store, {"steps/000000000001/a": b"A", "steps/000000000001/c": src})
    assert store.get("steps/000000000001/c") == b"C"
    with pytest.raises(AlreadyExists, match="other content"):
        put_idempotent(store, {"steps/000000000001/b": b"not B", "steps/000000000001/d": b"D"})
    assert not store.exists("steps/000000000001/d")
    assert store.get("steps/000000000001/b") == b"B"


def _states(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    s = {"w": torch.randn(2000, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    out = [s]
    for _ in range(1, n):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        idx = torch.randperm(2000, generator=g)[:50]
        nxt["w"][idx] += 1
        out.append(nxt)
    return out


def test_uploader_retries_partial_batches(tmp_path: Path) -> None:
    store = FlakyStore(ds.LocalStore(tmp_path / "s", fsync=False))
    script = iter([1, -1, 0, -1, -1, 0, 0, -1])  # step 0 files: 1 of n written, then ok; manifest: fails once ...
    store.flaky = lambda keys: next(script, -1)
    ss = _states(3)
    with ds.DeltaUploader(store, anchor_every=10, retries=3, retry_backoff=0.001, on_backlog="block") as up:
        infos = [up.push(s, i).result(WAIT) for i, s in enumerate(ss)]
    assert [i.kind for i in infos] == ["anchor", "patch", "patch"]
    assert up.failures == 0
    assert store.calls > 3 * 3, "three steps of three writes each, plus the retries"
    f = ds.DeltaFetcher(store)
    assert f.steps() == [0, 1, 2]
    target = {k: torch.zeros_like(v) for k, v in ss[0].items()}
    for step in range(3):
        f.sync(target, step=step)
        assert_state_equal(target, ss[step], f"step {step}")


def test_uploader_gives_up_then_anchors(tmp_path: Path) -> None:
    store = FlakyStore(ds.LocalStore(tmp_path / "s", fsync=False))
    ss = _states(4)
    with ds.DeltaUploader(store, anchor_every=10, retries=2, retry_backoff=0.001, on_backlog="block") as up:
        assert up.push(ss[0], 0).result(WAIT).kind == "anchor"
        # step 1's manifest never goes through: its data files do
        store.flaky = lambda keys: 0 if any(k.endswith("manifest.json") for k in keys) else -1
        with pytest.raises(CommitFailed, match=r"step 1: writing its manifest: gave up after 3 attempts") as info:
            up.push(ss[1], 1).result(WAIT)
        assert isinstance(info.value.__cause__, TransientStorageError)
        store.flaky = None
        i2 = up.push(ss[2], 2).result(WAIT)
        i3 = up.push(ss[3], 3).result(WAIT)
    assert (i2.kind, i3.kind) == ("anchor", "patch")
    f = ds.DeltaFetcher(store)
    assert f.steps() == [0, 2, 3], "the failed step has no manifest: fetchers never see it"
    target = {k: torch.zeros_like(v) for k, v in ss[0].items()}
    f.sync(target)
    assert_state_equal(target, ss[3])


def test_close_cuts_a_retry_backoff_short(tmp_path: Path) -> None:
    """A commit waiting out a retry backoff (30 s here) waits on the uploader's stop event: once
    close() gives up flushing it sets that event, and the step fails at once, saying why."""
    store = FlakyStore(ds.LocalStore(tmp_path / "s", fsync=False))
    attempted = threading.Event()

    def always_fail(keys: list[str]) -> int:
        attempted.set()
        return 0  # nothing written, TransientStorageError

    store.flaky = always_fail
    up = ds.DeltaUploader(store, retries=4, retry_backoff=30.0, span_levels=())
    fut = up.push(_states(1)[0], 0)
    assert attempted.wait(WAIT), "the commit never tried to write"
    # the commit is now in (or about to enter) its 30 s backoff: close() may not sit it out
    with pytest.raises(TimeoutError):
        up.close(timeout=0)
    with pytest.raises(
        CommitFailed, match=r"step 0: writing \d+ data files: stopped after 1 attempts \(the uploader is closing\)"
    ):
        fut.result(WAIT)
    assert store.calls == 1, "no write is retried once the uploader is closing"
    assert up.failures == 1
