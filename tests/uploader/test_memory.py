"""What the uploader keeps in memory: no finished step's arrays, no unbounded span compositions."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_spans import Stream, build, span_keys  # noqa: E402

import deltasync as ds  # noqa: E402
import deltasync.uploader._spans as spans_mod  # noqa: E402


def test_a_committed_step_lets_go_of_its_arrays(tmp_path: Path) -> None:
    """The last job stays referenced until the next push (for coalescing); its changes and
    snapshot must not: at 0.6B and 25% density they are 2.25 GB."""
    stream = Stream()
    with ds.DeltaUploader(tmp_path, anchor_every=1000, anchor_bytes_fraction=0, on_backlog="block") as up:
        assert up.push(stream.state, 0).result().kind == "anchor"
        assert up._prev_job is not None and not up._prev_job.snapshot
        info = up.push(stream.advance(), 1).result()
        assert info.kind == "patch" and info.changed > 0
        job = up._prev_job
        assert job is not None and job.step == 1
        assert not job.changes and not job.snapshot and not job.staged


def test_dense_span_compositions_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A level whose merged changes pass SPAN_MAX_DENSITY of the state (and the memory floor) is
    abandoned with every level above it; lower levels go on, and the chain is untouched."""
    monkeypatch.setattr(spans_mod, "SPAN_MEMORY_FLOOR", 0)
    store = ds.open_store(tmp_path)
    history = build(store, 9, levels=(2, 4))  # 4% a step: 2 steps ~8% (kept), 4 steps ~15% (dropped)
    keys = span_keys(store)
    assert keys == {(0, 2), (2, 4), (4, 6), (6, 8)}
    target = {k: torch.zeros_like(v) for k, v in Stream().state.items()}
    assert ds.DeltaFetcher(store, verify="full").sync(target) == 8
    assert {k: v.view(torch.int16).numpy().tobytes() for k, v in target.items()} == history[8]
