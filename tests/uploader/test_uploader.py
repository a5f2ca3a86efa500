"""DeltaUploader: push never waits for the store, bounded backlog, commit kinds, failures, resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from spy_store import SpyStore, step_of_key
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync.errors import ChecksumMismatch, CommitFailed, InventoryMismatch, ProtocolError, WriterFenced
from deltasync.protocol import Manifest, manifest_key

torch = pytest.importorskip("torch")

WAIT = 30.0  # generous bound for anything that should happen "soon"


def make_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(300, generator=g),
        "c.bias": torch.randn(16, generator=g).to(torch.float16),
    }


def perturb(state: dict[str, Any], seed: int, frac: float = 0.05) -> dict[str, Any]:
    """A copy with a random ``frac`` of the elements of every tensor changed."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in state.items():
        v = v.clone()
        flat = v.view(-1)
        n = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = (flat[idx].float() + torch.randn(n, generator=g)).to(v.dtype)
        out[k] = v
    return out


def states(n: int, seed: int = 0) -> list[dict[str, Any]]:
    out = [make_state(seed)]
    for i in range(1, n):
        out.append(perturb(out[-1], seed * 100 + i))
    return out


def fetch_all(store: ds.Store, pushed: dict[int, dict[str, Any]]) -> None:
    """A fresh fetcher reaches every given committed step bit-exactly."""
    f = ds.DeltaFetcher(store)
    target = {k: torch.zeros_like(v) for k, v in next(iter(pushed.values())).items()}
    for step in sorted(pushed):
        assert f.sync(target, step=step) == step
        assert_state_equal(target, pushed[step], f"step {step}")


def wait_until(pred: Any, timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return pred()


@pytest.fixture
def spy_store(tmp_path: Path) -> SpyStore:
    """A SpyStore over a LocalStore in ``tmp_path / 'store'``."""
    return SpyStore(ds.LocalStore(tmp_path / "store", fsync=False))


# ------------------------------------------------------------ not waiting


def test_push_returns_while_the_store_is_blocked(spy_store: SpyStore) -> None:
    gate = threading.Event()
    spy_store.gate = gate
    ss = states(3)
    up = ds.DeltaUploader(spy_store, on_backlog="block", max_pending=4)
    try:
        f0 = up.push(ss[0], 0)
        assert spy_store.blocked.wait(WAIT), "the commit thread never started writing"
        # both pushes return while the store's writes are held at the gate (no clock needed:
        # a push that waited for the store would never get past here)
        f1 = up.push(ss[1], 1)
        f2 = up.push(ss[2], 2)
        assert not gate.is_set() and spy_store.blocked.is_set()
        # the writes are still held at the gate: nothing can be committed yet
        assert not f0.done() and not f1.done() and not f2.done()
        assert up.pending == 3
        assert spy_store.puts == []
        gate.set()
        kinds = [f.result(WAIT).kind for f in (f0, f1, f2)]
        assert kinds == ["anchor", "patch", "patch"]
        assert up.pending == 0
    finally:
        gate.set()
        up.close()
    fetch_all(spy_store, dict(enumerate(ss)))


def test_block_mode_bounds_the_backlog(spy_store: SpyStore) -> None:
    gate = threading.Event()
    spy_store.gate = gate
    ss = states(6)
    returned: list[int] = []
    futs: list[Any] = []
    up = ds.DeltaUploader(spy_store, on_backlog="block", max_pending=2, anchor_every=100)

    def producer() -> None:
        for i, s in enumerate(ss):
            futs.append(up.push(s, i))
            returned.append(i)

    t = threading.Thread(target=producer, daemon=True)
    try:
        t.start()
        assert spy_store.blocked.wait(WAIT)
        # step 0 is held in the store, two more steps may wait: the 4th push must block
        assert wait_until(lambda: len(returned) >= 3)
        time.sleep(0.3)  # give a wrongly non-blocking push the chance to slip through
        assert returned == [0, 1, 2], f"pushes returned while the store was blocked: {returned}"
        assert t.is_alive()
        assert all(not f.done() for f in futs)
        gate.set()
        t.join(WAIT)
        assert not t.is_alive()
        assert returned == list(range(6))
        infos = [f.result(WAIT) for f in futs]
    finally:
        gate.set()
        up.close()
    assert [i.kind for i in infos] == ["anchor"] + ["patch"] * 5
    assert [i.committed_step for i in infos] == list(range(6))
    fetch_all(spy_store, dict(enumerate(ss)))


def test_a_step_is_in_the_backlog_before_the_next_push_is_let_go(spy_store: SpyStore) -> None:
    """The digest stage lets the next push go on (``digests_ready``) only once the step is in
    the backlog: a "block" push in between would count one step too few and slip past
    max_pending (regression: it did, bef4a9b). The digest stage is held in that window by
    the pipeline's ``after_release`` hook, where the next push decides: it must find no room."""
    gate = threading.Event()
    spy_store.gate = gate
    ss = states(5)
    in_window = threading.Event()
    release = threading.Event()
    room_in_window: list[bool] = []
    up = ds.DeltaUploader(spy_store, on_backlog="block", max_pending=2, anchor_every=100)

    def hold(job: Any) -> None:
        if job.step == 2:
            room_in_window.append(up._pipeline.has_room())  # what push 3, let go now, would see
            in_window.set()
            assert release.wait(WAIT)

    up._pipeline.after_release = hold
    returned: list[int] = []
    futs: list[Any] = []

    def producer() -> None:
        for i in (3, 4):
            futs.append(up.push(ss[i], i))
            returned.append(i)

    t = threading.Thread(target=producer, daemon=True)
    try:
        f0 = up.push(ss[0], 0)
        assert spy_store.blocked.wait(WAIT), "step 0 never reached the store"  # the backlog is empty again
        futs += [f0, up.push(ss[1], 1), up.push(ss[2], 2)]  # both wait: the backlog is full
        assert in_window.wait(WAIT)
        assert room_in_window == [False], "push 3 was let go while step 2 was not counted in the backlog"
        t.start()  # push 3 must block until the store moves
        release.set()
        assert returned == [] and not any(f.done() for f in futs)
        gate.set()
        t.join(WAIT)
        assert not t.is_alive() and returned == [3, 4]
        infos = sorted((f.result(WAIT) for f in futs), key=lambda i: i.step)
    finally:
        release.set()
        gate.set()
        up.close()
    assert [i.kind for i in infos] == ["anchor"] + ["patch"] * 4
    assert [i.committed_step for i in infos] == list(range(5))
    fetch_all(spy_store, dict(enumerate(ss)))


def test_coalesce_mode_never_blocks_and_skips(spy_store: SpyStore) -> None:
    gate = threading.Event()
    spy_store.gate = gate
    ss = states(10)
    up = ds.DeltaUploader(spy_store, on_backlog="coalesce", max_pending=2, anchor_every=4, anchor_bytes_fraction=0)
    try:
        futs = []
        for i, s in enumerate(ss):
            futs.append(up.push(s, i))  # never blocks: the gate is closed the whole time
            assert wait_until(lambda: not up._pipeline.digesting())
            assert up._pipeline.waiting() <= 2, "more jobs waiting than max_pending"
        assert spy_store.blocked.is_set()
        assert not any(f.done() for f in futs)
        assert up.pending == 10
        gate.set()
        infos = [f.result(WAIT) for f in futs]
    finally:
        gate.set()
        up.close()
    committed = sorted({i.committed_step for i in infos})
    # one step was being written, at most max_pending others waited
    assert len(committed) <= 3
    assert committed[0] == 0 and committed[-1] == 9
    assert fetcher_steps(spy_store) == committed
    for i in infos:
        assert i.committed_step >= i.step
        if i.committed_step == i.step:
            assert i.kind in ("anchor", "patch")
        else:
            assert i.kind == "skipped"
    assert any(i.kind == "skipped" for i in infos)
    assert infos[0].kind == "anchor"
    # every committed step holds exactly what was pushed at that step
    fetch_all(spy_store, {s: ss[s] for s in committed})


def fetcher_steps(store: ds.Store) -> list[int]:
    return ds.DeltaFetcher(store).steps()


# ------------------------------------------------------------- failures


def test_failed_commit_raises_and_next_push_is_an_anchor(spy_store: SpyStore) -> None:
    spy_store.fail = lambda keys: any(k.startswith("steps/000000000002/") for k in keys)
    ss = states(6)
    with ds.DeltaUploader(spy_store, anchor_every=100, on_backlog="block") as up:
        infos = [up.push(ss[i], i).result(WAIT) for i in range(2)]
        f2 = up.push(ss[2], 2)
        with pytest.raises(CommitFailed, match=r"step 2: commit failed: .*injected write failure"):
            f2.result(WAIT)
        assert up.failures == 1
        i3 = up.push(ss[3], 3).result(WAIT)
        i4 = up.push(ss[4], 4).result(WAIT)
    assert [i.kind for i in infos] == ["anchor", "patch"]
    assert i3.kind == "anchor" and i3.anchor_step == 3
    assert i4.kind == "patch" and i4.anchor_step == 3
    assert fetcher_steps(spy_store) == [0, 1, 3, 4]
    fetch_all(spy_store, {0: ss[0], 1: ss[1], 3: ss[3], 4: ss[4]})


def test_patch_on_a_failed_parent_fails_too(spy_store: SpyStore) -> None:
    gate = threading.Event()
    spy_store.gate = gate
    spy_store.fail = lambda keys: any(k.startswith("steps/000000000001/") for k in keys)
    ss = states(5)
    with ds.DeltaUploader(spy_store, anchor_every=100, on_backlog="block") as up:
        futs = [up.push(ss[i], i) for i in range(3)]  # 1 and 2 are patches, pushed before 1 fails
        gate.set()
        assert futs[0].result(WAIT).kind == "anchor"
        with pytest.raises(CommitFailed, match="step 1: commit failed"):
            futs[1].result(WAIT)
        with pytest.raises(CommitFailed, match="step 2: its parent step was not committed"):
            futs[2].result(WAIT)
        i3 = up.push(ss[3], 3).result(WAIT)
        i4 = up.push(ss[4], 4).result(WAIT)
    assert (i3.kind, i4.kind) == ("anchor", "patch")
    fetch_all(spy_store, {0: ss[0], 3: ss[3], 4: ss[4]})


# ----------------------------------------------------------- commit kinds


def test_first_push_anchor_every_and_inventory_change() -> None:
    store = ds.MemoryStore()
    ss = states(9)
    with ds.DeltaUploader(store, anchor_every=3, anchor_bytes_fraction=0) as up:
        kinds = [up.push(s, i).result(WAIT).kind for i, s in enumerate(ss[:7])]
        assert kinds == ["anchor", "patch", "patch", "anchor", "patch", "patch", "anchor"]
        # a new tensor: anchor, then patches again
        s7 = dict(ss[7], extra=torch.ones(5))
        assert up.push(s7, 7).result(WAIT).kind == "anchor"
        s8 = dict(ss[8], extra=torch.ones(5))
        assert up.push(s8, 8).result(WAIT).kind == "patch"
        # a changed shape and a changed dtype: anchors
        s9 = dict(s8, extra=torch.ones(6))
        assert up.push(s9, 9).result(WAIT).kind == "anchor"
        s10 = dict(s9, extra=torch.ones(6, dtype=torch.float64))
        assert up.push(s10, 10).result(WAIT).kind == "anchor"
    f = ds.DeltaFetcher(store)
    target = snapshot(s10)
    f.sync(target, step=10)
    assert_state_equal(target, s10)


def test_anchor_every_one_and_byte_fraction() -> None:
    ss = states(4)
    with ds.DeltaUploader(ds.MemoryStore(), anchor_every=1) as up:
        assert [up.push(s, i).result(WAIT).kind for i, s in enumerate(ss)] == ["anchor"] * 4
    # every element changes: each patch is about as big as the anchor, so the byte budget forces anchors
    dense = [make_state(0)] + [perturb(make_state(0), i, frac=1.0) for i in range(1, 5)]
    with ds.DeltaUploader(ds.MemoryStore(), anchor_every=100, anchor_bytes_fraction=0.5) as up:
        kinds = [up.push(s, i).result(WAIT).kind for i, s in enumerate(dense)]
    assert kinds[0] == "anchor" and "patch" in kinds and kinds.count("anchor") >= 2


def test_commit_info_fields() -> None:
    ss = states(2)
    with ds.DeltaUploader(ds.MemoryStore(), anchor_every=10) as up:
        a = up.push(ss[0], 0).result(WAIT)
        p = up.push(ss[1], 5).result(WAIT)
        assert up.last_committed_step == 5
    total = sum(v.numel() for v in ss[0].values())
    assert (a.step, a.kind, a.changed, a.total, a.anchor_step, a.committed_step) == (0, "anchor", total, total, 0, 0)
    changed = sum(int((x.view(-1) != y.view(-1)).sum()) for x, y in zip(ss[0].values(), ss[1].values(), strict=True))
    assert (p.step, p.kind, p.changed, p.total, p.anchor_step) == (5, "patch", changed, total, 0)
    assert 0 < p.nbytes < a.nbytes
    assert len(p.manifest_digest) == 32


def test_steps_must_increase() -> None:
    ss = states(2)
    with ds.DeltaUploader(ds.MemoryStore()) as up:
        up.push(ss[0], 5)
        for bad in (5, 4, 0):
            with pytest.raises(
                ProtocolError,
                match=f"step {bad} is not after the last step 5; steps must increase: push step 6 or later",
            ):
                up.push(ss[1], bad)
        for bad in (-1, True, 1.5, "6"):
            with pytest.raises(ProtocolError, match="step must be a non-negative integer"):
                up.push(ss[1], bad)  # type: ignore[arg-type]
        assert up.push(ss[1], 6).result(WAIT).kind == "patch"


def test_caller_may_mutate_right_after_push(spy_store: SpyStore) -> None:
    gate = threading.Event()
    spy_store.gate = gate
    ss = states(3)
    live = snapshot(ss[0])
    up = ds.DeltaUploader(spy_store, anchor_every=100, on_backlog="block")
    try:
        futs = []
        for i in range(3):
            for k in live:
                live[k].copy_(ss[i][k])
            futs.append(up.push(live, i))
            # scribble over the pushed tensors while the store has not seen a byte
            for v in live.values():
                v.fill_(7)
        gate.set()
        assert [f.result(WAIT).kind for f in futs] == ["anchor", "patch", "patch"]
    finally:
        gate.set()
        up.close()
    fetch_all(spy_store, dict(enumerate(ss)))


def test_cast_dtype_pushes_the_cast_view() -> None:
    store = ds.MemoryStore()
    master = {"w": torch.randn(100, generator=torch.Generator().manual_seed(3)), "i": torch.arange(10)}
    with ds.DeltaUploader(store, cast_dtype=torch.bfloat16) as up:
        up.push(master, 0).result(WAIT)
    target = {"w": torch.zeros(100, dtype=torch.bfloat16), "i": torch.zeros(10, dtype=torch.int64)}
    ds.DeltaFetcher(store).sync(target)
    assert_state_equal(target, {"w": master["w"].to(torch.bfloat16), "i": master["i"]})


# ------------------------------------------------------------ resume, lifecycle


def test_resume_continues_the_chain_with_a_patch(spy_store: SpyStore) -> None:
    ss = states(5)
    with ds.DeltaUploader(spy_store, anchor_every=100) as up:
        for i in range(3):
            up.push(ss[i], i).result(WAIT)
        run_id = up.run_id
    with ds.DeltaUploader(spy_store, anchor_every=100) as up2:
        assert up2.run_id == run_id
        assert up2.last_committed_step == 2
        with pytest.raises(ProtocolError, match="already committed .* differs"):
            up2.push(ss[3], 2)
        with pytest.raises(ChecksumMismatch, match="differs from committed step 2"):
            up2.resume(ss[1], 2, strict=True)
        with pytest.raises(InventoryMismatch, match="inventory"):
            up2.resume({k: v for k, v in ss[2].items() if k != "c.bias"}, 2, strict=True)
        assert up2.resume(ss[2], 2) is True
        info = up2.push(ss[3], 3).result(WAIT)
        assert info.kind == "patch" and info.anchor_step == 0
        up2.push(ss[4], 4).result(WAIT)
    m3 = Manifest.from_json(spy_store.get(manifest_key(3)))
    assert (m3.parent_step, m3.run_id) == (2, run_id)
    fetch_all(spy_store, dict(enumerate(ss)))
    # a fetcher at step 2 continues with patches only
    f = ds.DeltaFetcher(spy_store)
    target = snapshot(ss[0])
    f.sync(target, step=2)
    spy_store.reset()
    f.sync(target, step=4)
    assert_state_equal(target, ss[4])
    assert {step_of_key(k) for k in spy_store.data_gets()} == {3, 4}


def test_the_writer_claim_is_taken_by_the_first_push() -> None:
    """An uploader that never pushes (refused, or closed at once) leaves no writer claim behind."""
    store = ds.MemoryStore()
    ss = states(4)
    with ds.DeltaUploader(store) as idle:
        assert idle.epoch == 0
    assert store.list("writers/") == []
    with ds.DeltaUploader(store) as up:
        up.push(ss[0], 0).result(WAIT)
        assert up.epoch == 1
    claims = [o.key for o in store.list("writers/")]
    assert claims == ["writers/000000000001.json"]
    refused = ds.DeltaUploader(store)
    with pytest.raises(ProtocolError, match="step 0 is already committed"):
        refused.push(ss[1], 0)
    refused.close()
    assert [o.key for o in store.list("writers/")] == claims


def test_a_second_uploader_fences_the_first_at_its_first_push() -> None:
    store = ds.MemoryStore()
    ss = states(4)
    with ds.DeltaUploader(store) as up:
        up.push(ss[0], 0).result(WAIT)
    a = ds.DeltaUploader(store)
    b = ds.DeltaUploader(store)  # constructed, no claim yet: a still commits
    try:
        assert a.push(ss[1], 1).result(WAIT).kind == "anchor"
        assert (a.epoch, b.epoch) == (2, 0)
        b.push(ss[2], 2).result(WAIT)  # claims epoch 3 after step 0, the step b started from
        assert b.epoch == 3
        with pytest.raises(WriterFenced):
            a.push(ss[3], 3).result(WAIT)
    finally:
        a.close()
        b.close()
    f = ds.DeltaFetcher(store)
    assert f.latest_step() == 2  # a's step 1 lost the race: superseded by b's claim
    fetch_all(store, {0: ss[0], 2: ss[2]})


def test_new_uploader_without_resume_starts_with_an_anchor() -> None:
    store = ds.MemoryStore()
    ss = states(3)
    with ds.DeltaUploader(store) as up:
        up.push(ss[0], 0).result(WAIT)
        up.push(ss[1], 1).result(WAIT)
    with ds.DeltaUploader(store) as up2:
        info = up2.push(ss[2], 2).result(WAIT)
    assert info.kind == "anchor"
    assert Manifest.from_json(store.get(manifest_key(2))).parent_step == 1
    fetch_all(store, dict(enumerate(ss)))


def test_context_manager_flushes_and_close_is_final() -> None:
    slow = SpyStore(ds.MemoryStore())
    slow.delay = 0.05
    ss = states(4)
    with ds.DeltaUploader(slow, on_backlog="block") as up:
        futs = [up.push(s, i) for i, s in enumerate(ss)]
    assert all(f.done() for f in futs)
    assert [f.result().committed_step for f in futs] == [0, 1, 2, 3]
    assert up.pending == 0
    assert fetcher_steps(slow) == [0, 1, 2, 3]
    up.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        up.push(ss[0], 10)


def test_flush_timeout() -> None:
    gated = SpyStore(ds.MemoryStore())
    gated.gate = threading.Event()
    up = ds.DeltaUploader(gated)
    try:
        fut = up.push(make_state(), 0)
        with pytest.raises(TimeoutError, match="still pending"):
            up.flush(timeout=0.05)
        gated.gate.set()
        up.flush(WAIT)
        assert fut.result().kind == "anchor"
    finally:
        gated.gate.set()
        up.close()


@pytest.mark.parametrize("defer_diff", [True, False])
def test_push_copies_the_state_so_the_caller_may_change_it_at_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, defer_diff: bool
) -> None:
    """push() only stages a copy; the diff runs later on the digest thread. Changing the
    caller's tensors (a live module's parameters) right after push must not leak into the step."""
    import torch

    import deltasync.uploader._snapshot as uupl

    may_diff = threading.Event()
    real_diff = uupl.diff_tensor

    def held_diff(base: Any, new: Any) -> Any:
        if defer_diff:  # inline, the diff runs inside push(): nothing to hold
            assert may_diff.wait(WAIT)
        return real_diff(base, new)

    monkeypatch.setattr(uupl, "diff_tensor", held_diff)
    store = ds.LocalStore(tmp_path / "s", fsync=False)
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with ds.DeltaUploader(store, anchor_every=100, defer_diff=defer_diff) as up:
        up.push(model, 0).result(WAIT)  # the anchor
        with torch.no_grad():
            model.weight[3] += 1.0
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        fut = up.push(model, 1)
        with torch.no_grad():  # the next training step, while step 1 is not even diffed yet
            model.weight.add_(1.0)
            model.bias.add_(1.0)
        may_diff.set()
        assert fut.result(WAIT).changed == 64
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    ds.DeltaFetcher(store).sync(target, step=1)
    for k, want in expected.items():
        assert torch.equal(target[k].view(torch.int16), want.view(torch.int16)), k


def test_a_bytes_triggered_anchor_is_not_repeated_while_it_is_in_flight(spy_store: SpyStore) -> None:
    """The patch-bytes budget restarts when an anchor is pushed, not when it is committed:
    a push that comes while that anchor still waits for the store is a patch, not a second anchor."""
    ss = states(4)
    up = ds.DeltaUploader(spy_store, anchor_every=100, anchor_bytes_fraction=1e-6, on_backlog="block")
    try:
        assert up.push(ss[0], 0).result(WAIT).kind == "anchor"
        assert up.push(ss[1], 1).result(WAIT).kind == "patch"  # now over the (tiny) budget
        gate = threading.Event()
        spy_store.gate = gate
        f2 = up.push(ss[2], 2)  # the budget-triggered anchor, held at the gate
        f3 = up.push(ss[3], 3)
        gate.set()
        assert [f2.result(WAIT).kind, f3.result(WAIT).kind] == ["anchor", "patch"]
    finally:
        if spy_store.gate is not None:
            spy_store.gate.set()
        up.close()
    fetch_all(spy_store, dict(enumerate(ss)))
