"""What a sync applied (``SyncJournal.changes``): the positions the patches carried, folded across
steps, reported as the one change type (``protocol.TensorChange``) so that nothing downstream
recomputes them by comparing tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.fetcher import SyncJournal  # noqa: E402
from deltasync.protocol import TensorChange, decode_patch, file_key  # noqa: E402

NAMES = ["a", "b", "c"]


def _state(step: int) -> dict[str, Any]:
    """~10% of each tensor's elements change per step; ``c`` changes only at odd steps."""
    g = torch.Generator().manual_seed(7)
    out = {n: torch.randn(40, 30, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        g2 = torch.Generator().manual_seed(100 + s)
        for n in NAMES:
            mask = torch.rand(40, 30, generator=g2) < 0.1
            if n == "c" and s % 2 == 0:
                continue
            out[n] = torch.where(mask, (out[n].float() * 1.03 + 1e-2).to(torch.bfloat16), out[n])
    return out


def _push(path: Path, steps: int) -> ds.Store:
    with ds.DeltaUploader(str(path), anchor_every=1000, anchor_bytes_fraction=0, span_levels=()) as up:
        for s in range(steps + 1):
            up.push(_state(s), s).result()
    return ds.open_store(str(path))


def _carried(store: ds.Store, fetcher: ds.DeltaFetcher, step: int) -> dict[str, np.ndarray]:
    """The positions step ``step``'s patch carries, by tensor, decoded from its files."""
    m = fetcher.manifest(step)
    files = store.get_many([file_key(step, f.path) for f in m.files])
    decoded = decode_patch(m, {f.path: files[file_key(step, f.path)] for f in m.files})
    return {d.tensor: d.idx for d in decoded}


def test_one_step_reports_the_positions_the_patch_carried(tmp_path: Path) -> None:
    store = _push(tmp_path / "run", 2)
    fetcher = ds.DeltaFetcher(store)
    target: dict[str, Any] = {}
    assert fetcher.sync(target, 1) == 1
    journal = SyncJournal()
    assert fetcher.sync(target, 2, journal=journal) == 2
    carried = _carried(store, fetcher, 2)
    assert sorted(journal.changes) == sorted(journal.names) == sorted(carried) == ["a", "b"]
    for name, change in journal.changes.items():
        assert isinstance(change, TensorChange) and change.tensor == name and change.values is None
        assert change.positions is not None
        assert np.array_equal(change.positions, carried[name])
        before, after = _state(1)[name], _state(2)[name]
        diff = torch.nonzero(before.view(-1).view(torch.int16) != after.view(-1).view(torch.int16)).view(-1)
        assert np.array_equal(change.positions, diff.numpy())  # exactly the elements whose bits changed


@pytest.mark.parametrize("fold", [True, False])
def test_several_steps_report_the_union_of_their_positions(tmp_path: Path, fold: bool) -> None:
    store = _push(tmp_path / "run", 4)
    fetcher = ds.DeltaFetcher(store, fold=fold)
    target: dict[str, Any] = {}
    fetcher.sync(target, 1)
    journal = SyncJournal()
    fetcher.sync(target, 4, journal=journal)
    carried = [_carried(store, fetcher, s) for s in (2, 3, 4)]
    assert sorted(journal.changes) == NAMES
    for name, change in journal.changes.items():
        assert change.positions is not None
        union = np.unique(np.concatenate([c[name] for c in carried if name in c]))
        net = torch.nonzero(
            _state(1)[name].view(-1).view(torch.int16) != _state(4)[name].view(-1).view(torch.int16)
        ).view(-1)
        # every element whose bits changed is reported, and nothing the patches did not write
        assert np.isin(net.numpy(), change.positions).all()
        assert np.isin(change.positions, union).all()
        if not fold:
            assert np.array_equal(change.positions, union)
        assert np.all(np.diff(change.positions) > 0)  # sorted, unique


def test_an_anchor_load_reports_whole_tensors(tmp_path: Path) -> None:
    """An anchor overwrites whole tensors: which elements changed is not known (positions None)."""
    store = _push(tmp_path / "run", 1)
    fetcher = ds.DeltaFetcher(store)
    target = {n: t.clone() for n, t in _state(1).items()}
    target["a"] = torch.zeros_like(target["a"])  # not step 0's bits anywhere: the sync loads an anchor
    journal = SyncJournal()
    fetcher.sync(target, 1, journal=journal)
    assert sorted(journal.changes) == ["a"]  # only the tensor whose bits differ was written
    assert journal.changes["a"].positions is None and journal.changes["a"].whole
    journal.rollback()
    assert dict(journal.changes) == {}


def test_tied_names_report_the_change_written_into_their_shared_memory(tmp_path: Path) -> None:
    """Names the target ties (one tensor under two names) are written once; both report that change."""

    def tied(step: int) -> dict[str, Any]:
        state = _state(step)
        state["b"] = state["a"].clone()
        return state

    with ds.DeltaUploader(str(tmp_path / "run"), anchor_every=1000, anchor_bytes_fraction=0, span_levels=()) as up:
        for s in range(3):
            up.push(tied(s), s).result()
    store = ds.open_store(str(tmp_path / "run"))
    fetcher = ds.DeltaFetcher(store)
    target = {n: t.clone() for n, t in tied(1).items()}
    target["b"] = target["a"]
    fetcher.sync(target, 1, have_step=1)
    journal = SyncJournal()
    fetcher.sync(target, 2, journal=journal)
    carried = _carried(store, fetcher, 2)
    a, b = journal.changes["a"], journal.changes["b"]
    assert (a.tensor, b.tensor) == ("a", "b")
    assert a.positions is not None and b.positions is not None
    assert np.array_equal(a.positions, carried["a"]) and np.array_equal(b.positions, a.positions)
