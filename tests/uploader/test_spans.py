"""Spans end to end: the uploader writes them, fetchers catch up through them (folded), and bad
spans never cost a replica its state. Real LocalStores under tmp_path; bytes from SyncStats."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync._util.retry import RetryPolicy  # noqa: E402
from deltasync.errors import ChecksumMismatch, ObjectNotFound, StorageError, TransientStorageError  # noqa: E402
from deltasync.protocol import SPAN_OF, Manifest, parse_span_key, span_manifest_key  # noqa: E402
from deltasync.storage.base import Data, PutMode  # noqa: E402
from deltasync.testing.counting import CountingStore  # noqa: E402
from deltasync.uploader._config import check_levels  # noqa: E402
from deltasync.uploader._diff import TensorDiff  # noqa: E402
from deltasync.uploader._spans import SpanWriter  # noqa: E402

LEVELS = (4, 16)


class Stream:
    """A bf16 state whose steps change 4% of a fixed 25% "active" set (changes overlap, as in AdamW)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.state = {
            "a": torch.from_numpy(self.rng.standard_normal((64, 48)).astype(np.float32)).bfloat16(),
            "b": torch.from_numpy(self.rng.standard_normal(500).astype(np.float32)).bfloat16(),
            "c": torch.zeros(16, dtype=torch.bfloat16),  # never changes
        }
        self.active = {k: self.rng.random(v.numel()) < 0.25 for k, v in self.state.items() if k != "c"}

    def advance(self) -> dict[str, Any]:
        for k, act in self.active.items():
            flat = self.state[k].view(-1)
            hit = torch.from_numpy(act & (self.rng.random(act.size) < 0.16))
            flat[hit] = (flat[hit].float() * 1.01 + 1e-3).bfloat16()
        return self.state

    def copy(self) -> dict[str, Any]:
        return {k: v.clone() for k, v in self.state.items()}


def bits(state: Mapping[str, Any]) -> dict[str, bytes]:
    return {k: v.view(torch.int16).numpy().tobytes() for k, v in state.items()}


def build(
    store: ds.Store, steps: int, *, anchor_every: int = 1000, levels: Sequence[int] = LEVELS
) -> dict[int, dict[str, bytes]]:
    """Push ``steps`` steps; returns the bits of every step."""
    stream = Stream()
    history: dict[int, dict[str, bytes]] = {}
    with ds.DeltaUploader(
        store, anchor_every=anchor_every, anchor_bytes_fraction=0, span_levels=tuple(levels), on_backlog="block"
    ) as up:
        for s in range(steps):
            up.push(stream.state if s == 0 else stream.advance(), s)
            history[s] = bits(stream.state)
    return history


def span_keys(store: ds.Store) -> set[tuple[int, int]]:
    return {k for o in store.list("spans/") if (k := parse_span_key(o.key)) is not None}


SHAPES = {"a": (64, 48), "b": (500,), "c": (16,)}


def at_step(history: Mapping[int, Mapping[str, bytes]], step: int) -> dict[str, Any]:
    """A fresh state holding the bits of ``step``."""
    return {
        k: torch.frombuffer(bytearray(b), dtype=torch.int16).view(torch.bfloat16).reshape(SHAPES[k]).clone()
        for k, b in history[step].items()
    }


# ------------------------------------------------------------------ uploader


def test_spans_at_power_boundaries_never_across_anchors(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path)
    build(store, 16, anchor_every=7, levels=(2, 4))
    # anchors at 0, 7, 14; patch index since the anchor: 1..6, 1..6, 1
    assert span_keys(store) == {(0, 2), (2, 4), (4, 6), (0, 4), (7, 9), (9, 11), (11, 13), (7, 11)}
    reader = ds.RunReader(store)
    for a, b in span_keys(store):
        m = Manifest.from_json(store.get(span_manifest_key(a, b)))
        end, start = reader.committed(b), reader.committed(a)
        assert (m.step, m.parent_step, m.parent_digest) == (b, a, start.digest)
        assert (
            m.extra[SPAN_OF] == end.digest and m.anchor_step == end.manifest.anchor_step == start.manifest.anchor_step
        )
        assert m.tensor_digests == end.manifest.tensor_digests and m.inventory == end.manifest.inventory
        # a span's files are in its writer's subfolder, like the steps' (SPEC.md "Commit rule")
        assert m.writer is not None and m.writer == end.manifest.writer
        assert m.files and all(f.path.startswith(f"w{m.writer.id}/patch-") for f in m.files)


def test_span_levels_option() -> None:
    assert ds.UploaderConfig().span_levels == (8, 64)
    assert ds.UploaderConfig(span_levels=()).span_levels == ()
    for bad in ((1,), (4, 6), (16, 4), (4, 4), (0,)):
        with pytest.raises(ValueError, match="span_levels"):
            ds.UploaderConfig(span_levels=bad)
    assert check_levels([2, 8]) == (2, 8)


def test_no_spans_when_disabled(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path)
    build(store, 10, levels=())
    assert span_keys(store) == set()


class SpanTrouble(CountingStore):
    """Span writes fail (``fail``) or wait for ``gate``; everything else goes through."""

    def __init__(self, inner: ds.Store, *, fail: bool = False) -> None:
        super().__init__(inner)
        self.fail = fail
        self.gate = threading.Event()
        if fail:
            self.gate.set()
        self.waiting = threading.Event()

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        if any(k.startswith("spans/") for k in items):
            self.waiting.set()
            assert self.gate.wait(30), "test gate never opened"
            if self.fail:
                raise StorageError("span writes refused by the test store")
        super().put_many(items, mode=mode)


def test_failing_span_writes_never_fail_a_step(tmp_path: Path) -> None:
    store = SpanTrouble(ds.open_store(tmp_path), fail=True)
    stream = Stream()
    with ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0, span_levels=(2, 4), retries=0) as up:
        infos = [up.push(stream.state if s == 0 else stream.advance(), s).result(timeout=30) for s in range(9)]
        up.flush()
        assert [i.kind for i in infos] == ["anchor"] + ["patch"] * 8
        assert up.spans is not None and up.spans.failures == 6 and up.spans.written == 0 and up.failures == 0
    assert span_keys(store) == set()
    target = {k: torch.zeros_like(v) for k, v in stream.state.items()}
    assert ds.DeltaFetcher(store).sync(target) == 8
    assert bits(target) == bits(stream.state)


def test_slow_span_writes_never_delay_commits(tmp_path: Path) -> None:
    store = SpanTrouble(ds.open_store(tmp_path))
    stream = Stream()
    up = ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0, span_levels=(2,))
    try:
        for s in range(3):
            up.push(stream.state if s == 0 else stream.advance(), s).result(timeout=30)
        assert store.waiting.wait(30)  # the span thread is stuck writing span 0->2
        # later steps still commit while it is stuck
        for s in range(3, 8):
            assert up.push(stream.advance(), s).result(timeout=30).kind == "patch"
        assert span_keys(store) == set()
    finally:
        store.gate.set()
        up.close()
    assert span_keys(store) == {(0, 2), (2, 4), (4, 6)}


# ------------------------------------------------------------------ fetcher


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[ds.Store, dict[int, dict[str, bytes]]]:
    store = ds.open_store(tmp_path_factory.mktemp("spans-run"))
    return store, build(store, 60)


@pytest.mark.parametrize("behind", [1, 3, 10, 37])
def test_replica_behind_catches_up_bit_exact_with_fewer_bytes(
    run: tuple[ds.Store, dict[int, dict[str, bytes]]], behind: int
) -> None:
    store, history = run
    top = max(history)
    start = top - behind
    got: dict[str, int] = {}
    for name, options in {
        "patches": dict(spans=False, fold=False),
        "fold": dict(spans=False, fold=True),
        "spans": dict(spans=True, fold=True),
        "full": dict(spans=True, fold=True, verify="full"),
    }.items():
        fetcher = ds.DeltaFetcher(store, **options)  # type: ignore[arg-type]
        target = at_step(history, start)
        assert fetcher.sync(target, have_step=start, step=start) == start  # proven by digests: nothing to do
        assert fetcher.sync(target, step=top) == top
        assert bits(target) == history[top], name
        stats = fetcher.last_stats
        assert stats is not None and stats.base_step == start
        got[name] = stats.nbytes
        if name == "patches":
            assert stats.steps == behind and stats.spans == 0
    assert got["fold"] == got["patches"]
    assert got["spans"] <= got["patches"]
    if behind >= 10:
        assert got["spans"] < got["patches"] * 0.8, got


def test_fresh_replica_uses_spans_from_the_anchor(run: tuple[ds.Store, dict[int, dict[str, bytes]]]) -> None:
    store, history = run
    target = {k: torch.zeros_like(v) for k, v in at_step(history, 0).items()}
    fetcher = ds.DeltaFetcher(store)
    assert fetcher.sync(target, step=59) == 59
    assert bits(target) == history[59]
    stats = fetcher.last_stats
    assert stats is not None and stats.base_step is None and stats.spans >= 3  # 0-16, 16-32, 32-48, ...


class ListSpy(CountingStore):
    """Records the prefix of every listing."""

    def __init__(self, inner: ds.Store) -> None:
        super().__init__(inner)
        self.listed: list[str] = []

    def list_after(self, prefix: str, start_after: str | None) -> list[Any]:
        self.listed.append(prefix)
        return super().list_after(prefix, start_after)


def test_only_a_catch_up_of_two_patches_lists_spans(run: tuple[ds.Store, dict[int, dict[str, bytes]]]) -> None:
    store, history = run
    spy = ListSpy(store)
    fetcher = ds.DeltaFetcher(spy)
    target = at_step(history, 40)
    fetcher.sync(target, have_step=40, step=40)
    spy.reset()
    spy.listed.clear()
    assert fetcher.sync(target, step=41) == 41  # one behind: no spans listing, as before
    assert "spans/" not in spy.listed and spy.requests <= 4
    assert bits(target) == history[41]
    assert fetcher.sync(target, step=43) == 43
    assert spy.listed.count("spans/") == 1
    assert bits(target) == history[43]


def _copy_run(src: ds.Store, dst: Path) -> ds.Store:
    store = ds.open_store(dst)
    keys = [o.key for o in src.list("")]
    store.put_many(src.get_many(keys))
    return store


def test_corrupt_span_file_falls_back_to_patches(
    run: tuple[ds.Store, dict[int, dict[str, bytes]]], tmp_path: Path
) -> None:
    src, history = run
    store = _copy_run(src, tmp_path / "store")
    for o in store.list("spans/000000000016-000000000032/"):
        if o.key.endswith(".safetensors"):
            path = tmp_path / "store" / o.key
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))
    fetcher = ds.DeltaFetcher(store)
    target = at_step(history, 14)
    assert fetcher.sync(target, have_step=14, step=50) == 50
    assert bits(target) == history[50]
    assert fetcher.last_stats is not None and fetcher.last_stats.span_fallbacks == 1
    # a missing span file (deleted behind the listing) falls back the same way
    store.delete_many([o.key for o in store.list("spans/000000000032-000000000048/") if o.key.endswith(".safetensors")])
    target = at_step(history, 30)
    assert fetcher.sync(target, have_step=30, step=59) == 59
    assert bits(target) == history[59]


def test_corrupt_span_and_patch_fail_cleanly(run: tuple[ds.Store, dict[int, dict[str, bytes]]], tmp_path: Path) -> None:
    src, history = run
    store = _copy_run(src, tmp_path / "store")
    for prefix in ("spans/", "steps/000000000020/"):  # every span, and a patch on the way
        for o in store.list(prefix):
            if o.key.endswith(".safetensors"):
                path = tmp_path / "store" / o.key
                data = bytearray(path.read_bytes())
                data[-1] ^= 0x01
                path.write_bytes(bytes(data))
    fetcher = ds.DeltaFetcher(store)
    target = at_step(history, 14)
    fetcher.sync(target, have_step=14, step=14)
    with pytest.raises(ChecksumMismatch):
        fetcher.sync(target, step=40)
    assert bits(target) == history[14]


def _forge_span(store: ds.Store, start: int, end: int, history: Mapping[int, Mapping[str, bytes]]) -> None:
    """Replace span start->end with one whose sizes, digests and links are all consistent but whose
    content is wrong: the true change set with one element off."""
    reader = ds.RunReader(store)
    lo, hi = reader.committed(start), reader.committed(end)
    store.delete_many([o.key for o in store.list(f"spans/{start:012d}-{end:012d}/")])
    changes: dict[str, TensorDiff] = {}
    for name in history[end]:
        old = np.frombuffer(history[start][name], dtype=np.uint16)
        new = np.frombuffer(history[end][name], dtype=np.uint16).copy()
        new[0] ^= 0x0001  # the lie
        idx = np.flatnonzero(old != new).astype(np.int64)
        if idx.size:
            changes[name] = TensorDiff(idx, old[idx].copy(), new[idx].copy())
    writer = SpanWriter(store, (2,), shard_bytes=1 << 30, signing_key=None, retry=RetryPolicy(retries=0))
    try:
        writer._write(lo, hi, changes)
    finally:
        writer.close()
    assert writer.written == 1


def test_lying_span_is_caught_by_verify(run: tuple[ds.Store, dict[int, dict[str, bytes]]], tmp_path: Path) -> None:
    src, history = run
    store = _copy_run(src, tmp_path / "store")
    _forge_span(store, 16, 32, history)
    fetcher = ds.DeltaFetcher(store)
    target = at_step(history, 16)
    fetcher.sync(target, have_step=16, step=16)
    assert fetcher.sync(target, step=32) == 32  # the span is refused after the proof fails: patches
    assert bits(target) == history[32]
    assert fetcher.last_stats is not None and fetcher.last_stats.span_fallbacks == 1
    # without a way around it (the other spans gone, a patch's file missing), the sync fails and
    # the target stays at its last good state
    store.delete_many([o.key for o in store.list("spans/") if not o.key.startswith("spans/000000000016-000000000032/")])
    store.delete_many([o.key for o in store.list("steps/000000000020/") if o.key.endswith(".safetensors")])
    fetcher = ds.DeltaFetcher(store)
    target = at_step(history, 16)
    fetcher.sync(target, have_step=16, step=16)
    with pytest.raises(ObjectNotFound):
        fetcher.sync(target, step=32)
    assert bits(target) == history[16]
    assert fetcher.current_step(target) == 16


def test_transient_span_errors_are_retried(tmp_path: Path) -> None:
    class Flaky(CountingStore):
        def __init__(self, inner: ds.Store) -> None:
            super().__init__(inner)
            self.failed = 0

        def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
            if self.failed < 2 and any(k.startswith("spans/") for k in items):
                self.failed += 1
                raise TransientStorageError("throttled (test)")
            super().put_many(items, mode=mode)

    store = Flaky(ds.open_store(tmp_path))
    stream = Stream()
    with ds.DeltaUploader(
        store, anchor_every=1000, anchor_bytes_fraction=0, span_levels=(2,), retries=3, retry_backoff=0.001
    ) as up:
        for s in range(5):
            up.push(stream.state if s == 0 else stream.advance(), s)
        up.flush()
        assert up.spans is not None and up.spans.written == 2 and up.spans.failures == 0
    assert span_keys(store) == {(0, 2), (2, 4)}


def test_materialize_catches_up_through_spans_and_around_a_corrupt_one(
    run: tuple[ds.Store, dict[int, dict[str, bytes]]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    src, history = run
    store = _copy_run(src, tmp_path / "store")
    out = tmp_path / "ckpt"
    fetcher = ds.DeltaFetcher(store)
    fetcher.materialize(out, step=14)
    for o in store.list("spans/000000000016-000000000032/"):
        if o.key.endswith(".safetensors"):
            path = tmp_path / "store" / o.key
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x08
            path.write_bytes(bytes(data))
    fetcher.materialize(out, step=59)
    got: dict[str, bytes] = {}
    for f in sorted(out.glob("model-*.safetensors")):
        got.update({k: v.view(torch.int16).reshape(-1).numpy().tobytes() for k, v in load_file(f).items()})
    assert got == history[59]


def test_spans_continue_after_resume(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path)
    stream = Stream()
    opts: dict[str, Any] = dict(anchor_every=1000, anchor_bytes_fraction=0, span_levels=(2,), on_backlog="block")
    with ds.DeltaUploader(store, **opts) as up:
        for s in range(4):
            up.push(stream.state if s == 0 else stream.advance(), s)
    with ds.DeltaUploader(store, **opts) as up:
        up.resume(stream.state, 3)
        for s in range(4, 8):
            assert up.push(stream.advance(), s).result(timeout=30).kind == "patch"
    assert span_keys(store) == {(0, 2), (3, 5), (5, 7)}
    target = {k: torch.zeros_like(v) for k, v in stream.state.items()}
    assert ds.DeltaFetcher(store).sync(target) == 7
    assert bits(target) == bits(stream.state)
