"""Folded steps are visible wherever a user pushes: when the store falls behind (``on_backlog="coalesce"``),
a pushed step folded into a later one is counted (``DeltaUploader.folded``, ``folded_steps``), resolves
with ``kind="skipped"`` naming the step that holds its changes (``CommitInfo.folded``), and the uploader
itself logs the first fold as one warning (later ones at DEBUG, with the count), in a process that
configured no logging too (``delta-upload``, a plain script).

No clock: the store's writes of a step are held at a gate, so the backlog is full, and the next
pushes fold, at exactly the same steps every run."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from spy_store import SpyStore
from tensors import assert_state_equal

import deltasync as ds
from deltasync.errors import CommitFailed

torch = pytest.importorskip("torch")

WAIT = 60.0
ROOT = Path(__file__).resolve().parents[2]

FIRST_FOLD = (
    "deltasync: step 1 was folded into step 3: the store fell behind (the commit of an earlier step was still "
    "running and max_pending=1 steps were already waiting for it; on_backlog='coalesce'), so step 1 is not "
    "committed as its own step and no engine can be updated to exactly it (its Future resolves with "
    "kind='skipped', committed_step=3). To commit every step: push less often, raise max_pending, use a faster "
    "store, or pass on_backlog='block' (DeltaSyncCallback: keep_every_step=True; push() then waits for the store "
    "while it is behind). Further folds are logged at DEBUG and counted in DeltaUploader.folded."
)


def state_at(step: int) -> dict[str, Any]:
    """The weights after ``step``: a few elements of each tensor change per step."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(300, generator=g)
    for i in range(1, step + 1):
        gi = torch.Generator().manual_seed(i)
        w.view(-1)[torch.randperm(w.numel(), generator=gi)[:40]] += 1
        b[torch.randperm(b.numel(), generator=gi)[:10]] -= 1
    return {"w": w, "b": b}


@pytest.fixture
def spy_store(tmp_path: Path) -> SpyStore:
    """A SpyStore over a LocalStore in ``tmp_path / 'store'``."""
    return SpyStore(ds.LocalStore(tmp_path / "store", fsync=False))


def uploader(store: ds.Store, **kw: Any) -> ds.DeltaUploader:
    """A coalescing uploader (the default) with one waiting step at most; no spans (their writes are not held)."""
    return ds.DeltaUploader(store, max_pending=1, anchor_every=100, anchor_bytes_fraction=0, span_levels=(), **kw)


def push_behind(up: ds.DeltaUploader, store: SpyStore, steps: range) -> list[Any]:
    """Push ``steps`` while the store holds the first one's writes, then let the store go on and flush.

    The first step's commit is held at the gate; the second waits in the backlog (max_pending=1);
    every later one finds the backlog full and takes the waiting step's place: all steps between
    the first and the last are folded into the last."""
    gate = threading.Event()
    store.blocked.clear()
    store.gate = gate
    # the pipeline's test seam runs on the digest stage once a step is in the backlog (folded into the
    # waiting step, or waiting itself); without it, the last step could still be on its way there
    # when the gate opens, and the commit stage might take the waiting step before the last is folded in
    handed = threading.Event()
    up._pipeline.after_release = lambda job: handed.set() if job.step == steps[-1] else None
    try:
        futs = [up.push(state_at(steps[0]), steps[0])]
        assert store.blocked.wait(WAIT), "the first step never reached the store"
        futs += [up.push(state_at(s), s) for s in steps[1:]]  # none of them waits: the store is behind
        assert handed.wait(WAIT)
        assert not any(f.done() for f in futs)
    finally:
        gate.set()
        up._pipeline.after_release = None
    up.flush(WAIT)
    return [f.result(0) for f in futs]


def fold_records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records if "was folded into" in r.getMessage()]


def test_folds_are_counted_and_the_first_one_is_warned_once(
    spy_store: SpyStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "deltasync.uploader")
    with uploader(spy_store) as up:
        assert (up.folded, up.folded_steps) == (0, ())
        infos = push_behind(up, spy_store, range(0, 4))  # 1 and 2 fold into 3
        assert [(i.step, i.kind, i.committed_step, i.folded) for i in infos] == [
            (0, "anchor", 0, False), (1, "skipped", 3, True), (2, "skipped", 3, True), (3, "patch", 3, False),
        ]  # fmt: skip
        assert (up.folded, up.folded_steps) == (2, ((1, 3), (2, 3)))
        assert fold_records(caplog) == [
            ("deltasync.uploader", "WARNING", FIRST_FOLD),
            ("deltasync.uploader", "DEBUG", "deltasync: step 2 was folded into step 3 (2 steps folded so far)"),
        ]

        # later folds, behind another held commit: counted, at DEBUG only (the warning is once per uploader)
        caplog.clear()
        more = push_behind(up, spy_store, range(4, 8))  # 5 and 6 fold into 7
        assert [(i.step, i.kind, i.committed_step) for i in more] == [
            (4, "patch", 4), (5, "skipped", 7), (6, "skipped", 7), (7, "patch", 7),
        ]  # fmt: skip
        assert (up.folded, up.folded_steps) == (4, ((1, 3), (2, 3), (5, 7), (6, 7)))
        assert fold_records(caplog) == [
            ("deltasync.uploader", "DEBUG", f"deltasync: step {s} was folded into step 7 ({n} steps folded so far)")
            for n, s in ((3, 5), (4, 6))
        ]

    # a folded step's CommitInfo is the committed step's: it never claims a commit of its own
    three = infos[3]
    for i in infos[1:3]:
        assert (i.nbytes, i.changed, i.total, i.anchor_step, i.manifest_digest) == (
            three.nbytes, three.changed, three.total, three.anchor_step, three.manifest_digest,
        )  # fmt: skip
    reader = ds.RunReader(spy_store)
    assert reader.steps() == [0, 3, 4, 7]
    target = {k: torch.zeros_like(v) for k, v in state_at(0).items()}
    for step in (3, 7):  # the committed step holds the folded steps' changes
        assert ds.DeltaFetcher(spy_store).sync(target, step=step) == step
        assert_state_equal(target, state_at(step), f"step {step}")


def test_a_new_uploader_warns_again(spy_store: SpyStore, caplog: pytest.LogCaptureFixture) -> None:
    """Once per uploader: a second uploader on the run (a restarted trainer) says it again."""
    caplog.set_level(logging.WARNING, "deltasync.uploader")
    with uploader(spy_store) as up:
        push_behind(up, spy_store, range(0, 3))
        assert up.folded == 1
    with uploader(spy_store) as up:
        push_behind(up, spy_store, range(3, 6))
        assert up.folded == 1
    said = [m for _, level, m in fold_records(caplog) if level == "WARNING"]
    assert [m.split(":")[1] for m in said] == [" step 1 was folded into step 2", " step 4 was folded into step 5"]


def test_steps_folded_into_a_failed_commit_fail_and_are_not_counted(
    spy_store: SpyStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A fold is counted (and told) when the step holding it is committed: if that commit fails, the
    folded steps' Futures raise CommitFailed like the step's own, and nothing was folded into a commit."""
    caplog.set_level(logging.DEBUG, "deltasync.uploader")
    spy_store.fail = lambda keys: any(k.startswith("steps/000000000003/") for k in keys)
    with uploader(spy_store) as up:
        gate = threading.Event()
        spy_store.gate = gate
        handed = threading.Event()
        up._pipeline.after_release = lambda job: handed.set() if job.step == 3 else None
        try:
            futs = [up.push(state_at(0), 0)]
            assert spy_store.blocked.wait(WAIT)
            futs += [up.push(state_at(s), s) for s in (1, 2, 3)]
            assert handed.wait(WAIT)  # 1 and 2 are folded into 3 (see push_behind)
        finally:
            gate.set()
        assert futs[0].result(WAIT).kind == "anchor"
        for f in futs[1:]:
            with pytest.raises(CommitFailed, match="step 3: commit failed"):
                f.result(WAIT)
        up.flush(WAIT)
        assert (up.folded, up.folded_steps, up.failures) == (0, (), 1)
    assert fold_records(caplog) == []


def test_block_mode_and_the_cli_uploader_never_fold(spy_store: SpyStore, tmp_path: Path) -> None:
    """``on_backlog="block"`` commits every step (push waits instead): nothing to count or tell. The
    uploader of ``delta-upload`` and ``delta-upload watch`` is one (and waits for each step's commit)."""
    from deltasync.cli._common import cli_uploader

    args = Namespace(anchor_every=50, signal=None, run=None)
    with cli_uploader(ds.MemoryStore(), args) as cli_up:
        assert cli_up.config.on_backlog == "block"
    with uploader(spy_store, on_backlog="block") as up:
        gate = threading.Event()
        spy_store.gate = gate
        futs = [up.push(state_at(0), 0)]
        assert spy_store.blocked.wait(WAIT)
        futs.append(up.push(state_at(1), 1))  # waits in the backlog; the next push would wait for room
        gate.set()
        futs.append(up.push(state_at(2), 2))
        assert [f.result(WAIT).kind for f in futs] == ["anchor", "patch", "patch"]
        assert (up.folded, up.folded_steps) == (0, ())


SCRIPT = """
import sys, threading
sys.path[:0] = {paths!r}
import torch
import deltasync as ds
from spy_store import SpyStore

store = SpyStore(ds.LocalStore({store!r}, fsync=False))
store.gate = gate = threading.Event()
with ds.DeltaUploader(store, max_pending=1, anchor_every=100, span_levels=()) as up:
    handed = threading.Event()  # step 4 is in the backlog (see push_behind)
    up._pipeline.after_release = lambda job: handed.set() if job.step == 4 else None
    futs = [up.push({{"w": torch.full((64,), 0.0)}}, 0)]
    assert store.blocked.wait(60)
    futs += [up.push({{"w": torch.full((64,), float(s))}}, s) for s in (1, 2, 3, 4)]
    assert handed.wait(60)
    gate.set()
    print([f.result(60).kind for f in futs], up.folded)
"""


def test_a_process_without_logging_set_up_shows_the_warning_once(tmp_path: Path) -> None:
    """No logging configured (a plain script, like ``delta-upload``): the warning still reaches stderr, once."""
    code = SCRIPT.format(paths=[str(ROOT), str(ROOT / "tests")], store=str(tmp_path / "store"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['anchor', 'skipped', 'skipped', 'skipped', 'patch'] 3"
    lines = [line for line in out.stderr.splitlines() if "was folded into" in line]
    assert len(lines) == 1 and lines[0].startswith("deltasync: step 1 was folded into step 4: the store fell behind")
