"""Two writers racing for one step never touch each other's objects (issue 23, point 5).

Writer A commits steps 0 and 1; writer B resumes from step 1 (claiming the next epoch, which
fences A) and pushes step 2; its data files are written and its manifest is held back. A, not
yet told, pushes its own step 2: its data files go up, then its fence check stops it. The HF
Bucket API has no create-only writes, and the uploader used to replace "leftovers" of a step
without a manifest, so A overwrote B's files and B's committed step 2 failed its checksums.

Each writer now puts its data files in its own subfolder of the step (``w<writer id>/patch-00000.safetensors``,
SPEC.md "Commit rule"): the keys A writes are disjoint from B's, B's objects hold B's bytes, every
step reads back bit-exact, ``inspect --verify`` finds nothing wrong, and gc collects the folder of a
dropped step with the loser's subfolder in it, and nothing else. Run on the memory and local stores
and on HF buckets (the real huggingface_hub client against the fake Hub).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from fakehub import FakeHub, hf_store
from tensors import assert_state_equal

import deltasync as ds
from deltasync.errors import StorageError, WriterFenced
from deltasync.protocol import HEAD_KEY, Manifest, file_key, manifest_key, step_prefix
from deltasync.run.audit import verify_run
from deltasync.run.gc import collect_garbage
from deltasync.storage import Store
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

torch = pytest.importorskip("torch")

WAIT = 60.0  # bound for anything that should happen "soon" (HF transfers on a busy machine)
RACED = 2


class Writes(WrapperStore[Store]):
    """One writer's view of the shared store: records what it wrote, and can hold back one manifest."""

    def __init__(self, inner: Store, hold: str | None = None) -> None:
        super().__init__(inner)
        self.written: dict[str, bytes] = {}
        self.hold = hold
        self.held = threading.Event()  # set once the held key's write is waiting
        self.release = threading.Event()
        self._lock = threading.Lock()

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        if self.hold is not None and self.hold in items:
            self.held.set()
            if not self.release.wait(WAIT):
                raise StorageError("Writes: the held write was never released (test bug)")
        self.inner.put_many(items, mode=mode)
        with self._lock:
            for key, data in items.items():
                self.written[key] = data.read_bytes() if isinstance(data, Path) else bytes(data)

    def close(self) -> None:
        """Leaves the shared store open."""


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(500, generator=g),
    }


def _perturb(state: dict[str, Any], seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for v in out.values():
        flat = v.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 20]
        flat[idx] = (flat[idx].float() + 1).to(v.dtype)
    return out


@pytest.fixture(params=["memory", "local", "hf"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """A factory of handles on one fresh run prefix of the backend."""
    if request.param == "memory":
        mem = ds.MemoryStore("race")
        return lambda: mem
    if request.param == "local":
        return lambda: ds.LocalStore(tmp_path / "run", fsync=False)
    hub: FakeHub = request.getfixturevalue("fake_hub")
    bucket: str = request.getfixturevalue("hf_bucket")
    return lambda: hf_store(hub, bucket, "runs/race")


def test_a_fenced_writer_never_replaces_the_winners_objects(shared: Callable[[], Store]) -> None:
    s0 = _state(0)
    s1 = _perturb(s0, 1)
    won, lost = _perturb(s1, 2), _perturb(s1, 3)  # the two writers' step 2 differ
    a = Writes(shared())
    b = Writes(shared(), hold=manifest_key(RACED))
    up_a = ds.DeltaUploader(a, anchor_every=100)
    up_b = ds.DeltaUploader(b, anchor_every=100)
    try:
        assert up_a.push(s0, 0).result(WAIT).kind == "anchor"
        assert up_a.push(s1, 1).result(WAIT).kind == "patch"
        assert up_b.resume(s1, 1) is True  # claims epoch 2: A is fenced from now on
        fut_b = up_b.push(won, RACED)
        assert b.held.wait(WAIT), "B never reached its manifest"
        # B's data files are written, its manifest is not: A's step 2 goes up now
        with pytest.raises(WriterFenced):
            up_a.push(lost, RACED).result(WAIT)
        b.release.set()
        info = fut_b.result(WAIT)
        assert (info.step, info.kind) == (RACED, "patch")
    finally:
        b.release.set()
        up_a.close()
        up_b.close()

    store = shared()
    # the race happened: both wrote data files into step 2's folder, under disjoint keys
    a_data = {k for k in a.written if k.startswith(step_prefix(RACED))}
    b_data = {k for k in b.written if k.startswith(step_prefix(RACED)) and k != manifest_key(RACED)}
    assert a_data and b_data
    # each in its writer's own subfolder
    assert all(k.startswith(step_prefix(RACED) + f"w{up_a.writer_id}/") for k in a_data)
    assert all(k.startswith(step_prefix(RACED) + f"w{up_b.writer_id}/") for k in b_data)
    assert up_a.writer_id != up_b.writer_id
    assert manifest_key(RACED) not in a.written
    # HEAD.json is the one object every writer rewrites (a hint, SPEC.md "Commit rule")
    assert (set(a.written) & set(b.written)) - {HEAD_KEY} == set()
    # every object B made still holds B's bytes
    assert store.get_many(sorted(b.written)) == b.written
    # A's leftovers are there, and no manifest names them
    listed = {file_key(RACED, f.path) for f in Manifest.from_json(store.get(manifest_key(RACED))).files}
    assert listed == b_data and store.get_many(sorted(a_data)) == {k: a.written[k] for k in a_data}
    # the winner's step reads back bit-exact, proven tensor by tensor; the run verifies
    fetcher = ds.DeltaFetcher(store, verify="full")
    target = {k: torch.zeros_like(v) for k, v in s0.items()}
    for step, state in ((0, s0), (1, s1), (RACED, won)):
        assert fetcher.sync(target, step=step) == step
        assert_state_equal(target, state, f"step {step}")
    assert [c.line() for c in verify_run(store)] == [f"step {s}: OK" for s in (0, 1, RACED)]


def test_gc_collects_a_raced_step_with_the_losers_files_and_nothing_else(shared: Callable[[], Store]) -> None:
    """The folder of a collected step goes whole, the loser's files included; kept steps lose nothing."""
    s0 = _state(0)
    s1 = _perturb(s0, 1)
    won, lost = _perturb(s1, 2), _perturb(s1, 3)
    a = Writes(shared())
    b = Writes(shared(), hold=manifest_key(RACED))
    up_a = ds.DeltaUploader(a, anchor_every=100)
    up_b = ds.DeltaUploader(b, anchor_every=100)
    later = [_perturb(won, 4), _perturb(won, 5)]
    try:
        up_a.push(s0, 0).result(WAIT)
        up_a.push(s1, 1).result(WAIT)
        up_b.resume(s1, 1)
        fut_b = up_b.push(won, RACED)
        assert b.held.wait(WAIT)
        with pytest.raises(WriterFenced):
            up_a.push(lost, RACED).result(WAIT)
        b.release.set()
        fut_b.result(WAIT)
        up_b.close()
        # the run goes on from a new anchor (a new uploader without resume starts with one): steps 0-2
        # fall below it
        with ds.DeltaUploader(shared(), anchor_every=100) as up_c:
            assert up_c.push(later[0], 3).result(WAIT).kind == "anchor"
            assert up_c.push(later[1], 4).result(WAIT).kind == "patch"
    finally:
        b.release.set()
        up_a.close()
        up_b.close()
    store = shared()
    before = {o.key for o in store.list("")}
    assert any(k.startswith(step_prefix(RACED) + f"w{up_a.writer_id}/") for k in a.written)
    assert any(k.startswith(step_prefix(RACED) + f"w{up_b.writer_id}/") for k in before)
    report = collect_garbage(store, keep_anchors=1, grace=0.0)
    after = {o.key for o in store.list("")}
    gone = before - after
    assert report.plan.deleted_steps == (0, 1, RACED)
    assert gone == {k for k in before if k.startswith(tuple(step_prefix(s) for s in (0, 1, RACED)))}
    assert not any(k.startswith(tuple(step_prefix(s) for s in (0, 1, RACED))) for k in after)
    fetcher = ds.DeltaFetcher(store, verify="full")
    target = {k: torch.zeros_like(v) for k, v in s0.items()}
    for step, state in ((3, later[0]), (4, later[1])):
        assert fetcher.sync(target, step=step) == step
        assert_state_equal(target, state, f"step {step}")
