"""``DeltaFetcher.expected_changes``: the tensors a sync would write, from the manifests alone."""

from __future__ import annotations

import torch

import deltasync as ds
from deltasync.fetcher import SyncJournal


def _run(store: ds.MemoryStore, touched: list[list[str]], anchor_every: int = 1000) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(16, 8, generator=g) for n in "abcd"}
    states = [{n: t.clone() for n, t in state.items()}]
    with ds.DeltaUploader(store, anchor_every=anchor_every, anchor_bytes_fraction=0, span_levels=()) as up:
        up.push(state, 0).result(30)
        for step, names in enumerate(touched, start=1):
            for n in names:
                state[n][step % 16] += 1.0
            up.push(state, step).result(30)
            states.append({n: t.clone() for n, t in state.items()})
    return states


def test_the_union_of_what_the_steps_change_and_what_a_sync_then_writes() -> None:
    store = ds.MemoryStore("expected")
    states = _run(store, [["a"], ["b", "c"], [], ["a"]])
    f = ds.DeltaFetcher(store)
    assert f.expected_changes(0, 1) == ["a"]
    assert f.expected_changes(0, 3) == ["a", "b", "c"]
    assert f.expected_changes(1, 4) == ["a", "b", "c"]
    assert f.expected_changes(3, 3) == []
    target = {n: t.clone() for n, t in states[1].items()}
    journal = SyncJournal()
    f.sync(target, step=3, have_step=1, journal=journal)
    assert sorted(journal.names) == f.expected_changes(1, 3) == ["b", "c"]
    assert f.expected_changes(0, 99) is None  # not committed: a sync says why


def test_a_plan_that_loads_an_anchor_expects_none() -> None:
    """Back to an earlier step the sync loads an anchor, which rewrites every tensor: no guess."""
    store = ds.MemoryStore("expected-anchor")
    states = _run(store, [["a"], ["b"], ["c"]], anchor_every=2)
    f = ds.DeltaFetcher(store)
    assert f.expected_changes(2, 3) == ["c"]  # forward from step 2 (an anchor): its patch
    assert f.reader.plan(1, (3, f.reader.committed(3).digest)).base == "anchor"
    assert f.expected_changes(3, 1) is None
    target = {n: t.clone() for n, t in states[3].items()}
    f.sync(target, step=1, have_step=3)
    assert all(torch.equal(target[n], states[1][n]) for n in target)
