"""Store round trips of the read path do not grow with the run's history or its uploader sessions.

Counted with a CountingStore (a ``get_many`` batch is one round trip; see
deltasync/testing/counting.py) on runs built the way ``delta-upload`` builds them:
every session a new DeltaUploader that resumes from the store and pushes its share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bench_loader import load_bench

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.testing.counting import CountingStore  # noqa: E402


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_requests")


@pytest.mark.parametrize(("steps", "sessions"), [(10, 1), (10, 10), (1000, 1), (1000, 1000)])
def test_sync_costs_do_not_grow_with_history(bench: Any, steps: int, sessions: int) -> None:
    c = bench.measure(steps, sessions)
    assert c.behind <= 4, f"a fetcher one step behind took {c.behind} round trips"
    # 7, plus a listing of spans/ and one batch of span manifests (its plan applies 2+ patches)
    assert c.fresh <= 9, f"a fresh fetcher took {c.fresh} round trips"


def test_polling_an_unchanged_run_lists_only(bench: Any) -> None:
    store, stream = bench.build_run(30, 3)
    counting = CountingStore(store)
    reader = ds.RunReader(counting)
    assert reader.latest_step() == 29
    counting.reset()
    for _ in range(5):
        assert reader.latest_step() == 29
    assert counting.calls == {"list": 10}  # steps/ and writers/, nothing read


def test_fresh_reader_without_head_lists_the_run_once(bench: Any) -> None:
    """HEAD is a hint: without it (or with a lying one) the reader lists everything and is still right."""
    store, stream = bench.build_run(60, 2)
    for head in (
        None,
        b'{"format_version": 1, "step": 999999, "manifest_digest": "' + b"0" * 32 + b'", "run_id": "x"}',
    ):
        if head is None:
            store.delete_many(["HEAD.json"])
        else:
            store.put("HEAD.json", head)
        counting = CountingStore(store)
        target = {k: torch.zeros_like(v) for k, v in stream.state.items()}
        assert ds.DeltaFetcher(counting).sync(target) == 59
        assert all(torch.equal(target[k].view(torch.uint8), stream.state[k].view(torch.uint8)) for k in target)
        assert counting.requests <= 10  # 8, plus the spans listing and its batch


def test_stale_head_still_finds_newer_steps(bench: Any) -> None:
    store, stream = bench.build_run(20, 1)
    old_head = store.get("HEAD.json")
    with ds.DeltaUploader(store, anchor_every=50) as up:
        up.resume(stream.state, 19)
        for s in (20, 21):
            up.push(stream.advance(), s).result()
    store.put("HEAD.json", old_head)  # HEAD still says 19
    assert ds.RunReader(store).latest_step() == 21


def test_manifest_cache_is_bounded(bench: Any) -> None:
    """A long-lived reader keeps at most ``max_cached`` manifests and reads evicted ones again."""
    store, stream = bench.build_run(40, 1)
    reader = ds.RunReader(store, max_cached=3)
    fetcher = ds.DeltaFetcher(store, reader=reader)
    target = {k: torch.zeros_like(v) for k, v in stream.state.items()}
    for step in (5, 17, 39):
        assert fetcher.sync(target, step=step) == step
        assert len(reader._manifests) <= 3
    assert all(torch.equal(target[k].view(torch.uint8), stream.state[k].view(torch.uint8)) for k in target)
