"""A trainer that crashes and restarts: a new uploader continues the same chain when it proves the
store's head by digests, starts with an anchor otherwise, and never rewrites a committed step.

The crash is real: a child process pushes steps into a local store and is SIGKILLed while the
manifest of its last step is being written (its data files are in the store, uncommitted)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.errors import ChecksumMismatch, ProtocolError, WriterFenced
from deltasync.protocol import Manifest, file_key, manifest_key, step_prefix
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

torch = pytest.importorskip("torch")

WAIT = 60.0
KILLED_AT = 5  # the child commits steps 0..4, then dies writing step 5's manifest
ROOT = Path(__file__).resolve().parents[2]


def state_at(step: int) -> dict[str, Any]:
    """The trainer's weights after ``step`` (deterministic: parent and child compute the same)."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g)
    for i in range(1, step + 1):
        gi = torch.Generator().manual_seed(i)
        idx = torch.randint(0, w.numel(), (40,), generator=gi)
        w.view(-1)[idx] += 0.125
        b[i % 64] -= 1.0
    return {"w": w, "b": b}


class HangOnManifest(WrapperStore[ds.Store]):
    """Passes writes through, but hangs forever writing the manifest of ``step`` (after
    touching ``ready``), so the process can be killed mid-commit."""

    def __init__(self, inner: ds.Store, step: int, ready: Path) -> None:
        super().__init__(inner)
        self.step, self.ready = step, ready

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        if manifest_key(self.step) in items:
            self.ready.touch()
            threading.Event().wait()
        self.inner.put_many(items, mode=mode)


def child(store_dir: str, ready: str) -> None:
    """The trainer before the crash: commit steps 0..KILLED_AT-1, then hang committing KILLED_AT."""
    store = HangOnManifest(ds.open_store(store_dir), KILLED_AT, Path(ready))
    with ds.DeltaUploader(store, anchor_every=100) as up:
        for step in range(KILLED_AT):
            up.push(state_at(step), step).result(WAIT)
        up.push(state_at(KILLED_AT), KILLED_AT).result()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store left behind by a trainer killed (SIGKILL) while committing step KILLED_AT."""
    tmp = tmp_path_factory.mktemp("crashed")
    store_dir, ready = tmp / "store", tmp / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, __file__, str(store_dir), str(ready)], env=env, stdin=subprocess.DEVNULL)
    try:
        for _ in range(int(WAIT * 20)):  # bounded: the child touches `ready` once step 5's files are written
            if ready.exists() or proc.poll() is not None:
                break
            threading.Event().wait(0.05)
        assert ready.exists(), f"the child exited ({proc.returncode}) or hung before step {KILLED_AT}'s manifest"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(WAIT)
    assert proc.returncode == -signal.SIGKILL
    return store_dir


def copy_of(crashed: Path, tmp_path: Path) -> ds.Store:
    dst = tmp_path / "store"
    shutil.copytree(crashed, dst)
    return ds.open_store(dst)


def assert_reaches(store: ds.Store, steps: Sequence[int]) -> None:
    """A fresh verifying fetcher reaches each step bit-exactly, proving every tensor by digests."""
    f = ds.DeltaFetcher(store, verify="full")
    target = {k: torch.zeros_like(v) for k, v in state_at(0).items()}
    for step in steps:
        assert f.sync(target, step=step) == step
        for k, v in state_at(step).items():
            assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), (step, k)


def kind_of(store: ds.Store, step: int) -> tuple[str, int | None]:
    m = Manifest.from_json(store.get(manifest_key(step)))
    return m.kind, m.parent_step


def test_the_crashed_store_holds_steps_0_to_4_and_uncommitted_files_of_5(crashed: Path) -> None:
    store = ds.open_store(crashed)
    assert ds.RunReader(store).latest_step() == KILLED_AT - 1
    assert not store.exists(manifest_key(KILLED_AT))
    # the leftover of the killed commit, in its writer's subfolder (SPEC.md "Commit rule")
    (left,) = [o.key for o in store.list(step_prefix(KILLED_AT))]
    assert left.startswith(step_prefix(KILLED_AT) + "w") and left.endswith("/patch-00000.safetensors")


def test_re_pushing_the_head_proves_it_and_the_chain_goes_on_with_patches(crashed: Path, tmp_path: Path) -> None:
    store = copy_of(crashed, tmp_path)
    head = KILLED_AT - 1
    leftovers = store.get_many([o.key for o in store.list(step_prefix(KILLED_AT))])
    with ds.DeltaUploader(store, anchor_every=100) as up:
        info = up.push(state_at(head), head).result(WAIT)  # the checkpoint the trainer restarted from
        assert (info.kind, info.committed_step, info.nbytes) == ("skipped", head, 0)
        assert up.epoch == 2  # claimed at once: the old process, were it alive, is fenced off
        for step in (KILLED_AT, KILLED_AT + 1):
            assert up.push(state_at(step), step).result(WAIT).kind == "patch"
    assert kind_of(store, KILLED_AT) == ("patch", head)
    # step 5 is the new writer's files; the killed writer's leftovers are untouched, and unlisted
    assert store.get_many(list(leftovers)) == leftovers
    listed = {file_key(KILLED_AT, f.path) for f in Manifest.from_json(store.get(manifest_key(KILLED_AT))).files}
    assert listed and not listed & set(leftovers)
    assert_reaches(store, range(KILLED_AT + 2))


def test_resume_proven_continues_with_a_patch_and_unproven_starts_with_an_anchor(crashed: Path, tmp_path: Path) -> None:
    head = KILLED_AT - 1
    proven = copy_of(crashed, tmp_path / "a")
    with ds.DeltaUploader(proven, anchor_every=100) as up:
        assert up.resume(state_at(head), head) is True
        assert up.push(state_at(KILLED_AT), KILLED_AT).result(WAIT).kind == "patch"
    assert_reaches(proven, range(KILLED_AT + 1))

    differs = copy_of(crashed, tmp_path / "b")
    with ds.DeltaUploader(differs, anchor_every=100) as up:
        with pytest.raises(ChecksumMismatch, match="differs from committed step 4"):
            up.resume(state_at(head - 1), head, strict=True)
        assert differs.list("writers/")[-1].key.endswith("1.json")  # a refused resume claims nothing
        assert up.resume(state_at(head - 1), head) is False
        assert up.epoch == 2
        assert up.push(state_at(KILLED_AT), KILLED_AT).result(WAIT).kind == "anchor"
    assert kind_of(differs, KILLED_AT) == ("anchor", head)
    assert_reaches(differs, range(KILLED_AT + 1))


def test_a_checkpoint_newer_than_the_head_starts_with_an_anchor(crashed: Path, tmp_path: Path) -> None:
    """The trainer checkpointed step 6 but its pushes of 5 and 6 never landed."""
    store = copy_of(crashed, tmp_path)
    with ds.DeltaUploader(store, anchor_every=100) as up:
        with pytest.raises(ProtocolError, match="step 6 is not committed"):
            up.resume(state_at(6), 6, strict=True)
        assert up.resume(state_at(6), 6) is False
        assert up.push(state_at(7), 7).result(WAIT).kind == "anchor"
    assert_reaches(store, [4, 7])


def test_the_store_ahead_of_the_checkpoint_is_refused_with_what_to_do(crashed: Path, tmp_path: Path) -> None:
    """The trainer restarted from its step-2 checkpoint; the store holds up to step 4."""
    store = copy_of(crashed, tmp_path)
    with ds.DeltaUploader(store, anchor_every=100) as up:
        for call in (lambda: up.resume(state_at(2), 2), lambda: up.push(state_at(3), 3)):
            with pytest.raises(ProtocolError, match=r"store is ahead .* push only steps after 4 .* new run prefix"):
                call()
        with pytest.raises(ProtocolError, match="already committed .* differs"):
            up.push(state_at(3), 4)  # the re-trained step 4 is not the committed one
        assert [o.key for o in store.list("writers/")] == ["writers/000000000001.json"]  # refusals claim nothing
        info = up.push(state_at(5), 5).result(WAIT)
        assert info.kind == "anchor"
    assert kind_of(store, 5) == ("anchor", 4)
    assert_reaches(store, range(KILLED_AT + 1))


def test_a_step_without_digests_is_never_taken_as_proven() -> None:
    store = ds.MemoryStore()
    with ds.DeltaUploader(store, tensor_digests=False) as up:
        up.push(state_at(0), 0).result(WAIT)
    with ds.DeltaUploader(store) as up:
        with pytest.raises(ChecksumMismatch, match="no digest .* cannot be proven"):
            up.resume(state_at(0), 0, strict=True)
        assert up.resume(state_at(0), 0) is False
        assert up.push(state_at(1), 1).result(WAIT).kind == "anchor"


def test_the_old_uploader_still_alive_is_fenced_once_the_new_one_resumes() -> None:
    store = ds.MemoryStore()
    old = ds.DeltaUploader(store, anchor_every=100)
    try:
        for step in range(3):
            old.push(state_at(step), step).result(WAIT)
        with ds.DeltaUploader(store, anchor_every=100) as new:
            assert new.resume(state_at(2), 2) is True
            with pytest.raises(WriterFenced, match="took over"):
                old.push(state_at(3), 3).result(WAIT)
            assert not store.exists(manifest_key(3))
            assert new.push(state_at(3), 3).result(WAIT).kind == "patch"
    finally:
        old.close()
    assert ds.RunReader(store).latest_step() == 3
    assert_reaches(store, range(4))


def test_a_step_the_old_uploader_slipped_in_before_the_claim_is_skipped_not_reused() -> None:
    store = ds.MemoryStore()
    with ds.DeltaUploader(store) as first:
        first.push(state_at(0), 0).result(WAIT)
    new = ds.DeltaUploader(store)  # reads head 0
    try:
        with ds.DeltaUploader(store) as old:  # still alive elsewhere: commits 1 before `new` claims
            old.push(state_at(1), 1).result(WAIT)
        with pytest.raises(ProtocolError, match="older uploader .* push a later step"):
            new.push(state_at(1), 1)
        assert new.push(state_at(2), 2).result(WAIT).kind == "anchor"
    finally:
        new.close()
    reader = ds.RunReader(store)
    assert reader.latest_step() == 2 and reader.superseded_by(1) is not None
    assert_reaches(store, [0, 2])


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
