"""gc against real stores: deterministic races (a step deleted mid-sync, a lease or a commit while gc plans),
the uploader's ``keep_anchors`` option, and a stress run of pushes, readers and repeated gc on the local,
S3 (SeaweedFS) and fake-HF stores. No wall-clock asserts: leases that must be expired carry a past expiry.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gc_support import HookStore, bits_equal_state, make_states, zeros_like

import deltasync as ds
from deltasync.errors import ChainBroken, StorageError
from deltasync.fetcher._lease import LeaseWriter
from deltasync.protocol import HEAD_KEY, Head, manifest_key
from deltasync.protocol.retention import Lease, lease_key
from deltasync.run import RunReader
from deltasync.run.gc import collect_garbage
from deltasync.storage import LocalStore, Store

torch = pytest.importorskip("torch")

WAIT = 120.0


def push(store: Store, states: list[dict[str, Any]], steps: range, **options: Any) -> None:
    options.setdefault("anchor_every", 5)
    with ds.DeltaUploader(store, on_backlog="block", **options) as up:
        for s in steps:
            up.push(states[s], s).result(WAIT)


def committed(store: Store) -> list[int]:
    return RunReader(store).steps()


# ------------------------------------------------------------ deterministic races


def test_sync_replans_when_gc_deletes_its_plan_mid_sync(tmp_path: Path) -> None:
    states = make_states(12)
    store = HookStore(LocalStore(tmp_path / "run", fsync=False))
    push(store, states, range(9))  # A0 P1-4 A5 P6-8
    model = zeros_like(states[0])
    fetcher = ds.DeltaFetcher(store)
    assert fetcher.sync(model, step=6) == 6
    store.hook = lambda: (push(store, states, range(9, 12)), collect_garbage(store, keep_anchors=1))
    # plan: patches 7, 8 from the held 6; before they download, a new uploader lands 9-11 (anchor 9)
    # and gc deletes 0-8
    assert fetcher.sync(model) == 11
    assert bits_equal_state(model, states[11])
    assert committed(store) == [9, 10, 11]
    stats = fetcher.last_stats
    assert stats is not None and stats.base_step is None  # re-planned from the anchor 9


def test_sync_to_an_explicit_step_gc_deleted_raises_chain_broken_and_keeps_the_target(tmp_path: Path) -> None:
    states = make_states(12)
    store = HookStore(LocalStore(tmp_path / "run", fsync=False))
    push(store, states, range(9))
    model = zeros_like(states[0])
    fetcher = ds.DeltaFetcher(store)
    fetcher.sync(model, step=6)
    store.hook = lambda: (push(store, states, range(9, 12)), collect_garbage(store, keep_anchors=1))
    with pytest.raises(
        ChainBroken, match=r"step 8: files of the plan were deleted .*garbage collection.*step 8 is not committed"
    ):
        fetcher.sync(model, step=8)
    assert bits_equal_state(model, states[6]) and fetcher.current_step(model) == 6  # untouched
    assert fetcher.sync(model) == 11 and bits_equal_state(model, states[11])


def test_materialize_replans_when_gc_deletes_its_plan(tmp_path: Path) -> None:
    states = make_states(12)
    store = HookStore(LocalStore(tmp_path / "run", fsync=False))
    push(store, states, range(9))
    fetcher = ds.DeltaFetcher(store)
    fetcher.materialize(tmp_path / "out", step=6)
    store.hook = lambda: (push(store, states, range(9, 12)), collect_garbage(store, keep_anchors=1))
    fetcher.materialize(tmp_path / "out")
    from deltasync._util.checkpoint_io import load_checkpoint

    assert bits_equal_state(load_checkpoint(tmp_path / "out"), states[11])


def test_a_lease_written_while_gc_plans_is_honoured(tmp_path: Path) -> None:
    states = make_states(16)
    store = LocalStore(tmp_path / "run", fsync=False)
    push(store, states, range(16))  # anchors 0, 5, 10, 15
    model = zeros_like(states[0])
    fetcher = ds.DeltaFetcher(store)
    fetcher.sync(model, step=7)

    def late_lease(plan: Any) -> None:
        assert plan.deleted_steps == tuple(range(15))
        store.put(lease_key("late"), Lease("late", 7, None, expires=2**40).to_json())

    report = collect_garbage(store, keep_anchors=1, on_planned=late_lease)
    assert report.plan.deleted_steps == tuple(range(7))
    assert committed(store) == list(range(7, 16))
    for s in range(8, 16):  # the leased holder goes forward one step at a time
        assert fetcher.sync(model, step=s) == s and bits_equal_state(model, states[s])


def test_a_commit_while_gc_plans_is_never_deleted(tmp_path: Path) -> None:
    states = make_states(21)
    store = LocalStore(tmp_path / "run", fsync=False)
    push(store, states, range(12))  # anchors 0, 5, 10
    # a new uploader lands 12-20 (anchors 12, 17) between the two readings: the second plan alone
    # would delete up to 11
    report = collect_garbage(store, keep_anchors=2, on_planned=lambda plan: push(store, states, range(12, 21)))
    assert report.plan.deleted_steps == tuple(range(5))
    assert committed(store) == list(range(5, 21))
    assert collect_garbage(store, keep_anchors=2).plan.deleted_steps == tuple(range(5, 12))


def test_a_stale_head_naming_a_deleted_step_falls_back_to_listing(tmp_path: Path) -> None:
    states = make_states(11)
    store = LocalStore(tmp_path / "run", fsync=False)
    push(store, states, range(11))
    stale = store.get(HEAD_KEY)
    head = Head.from_json(stale)
    store.put(HEAD_KEY, Head(3, "0" * 32, head.run_id).to_json())
    collect_garbage(store, keep_anchors=1)
    assert not store.exists(manifest_key(3)) and store.exists(HEAD_KEY)
    model = zeros_like(states[0])
    assert ds.DeltaFetcher(store).sync(model) == 10 and bits_equal_state(model, states[10])


def test_expired_leases_do_not_block_and_are_deleted(tmp_path: Path) -> None:
    states = make_states(11)
    store = LocalStore(tmp_path / "run", fsync=False)
    push(store, states, range(11))
    past = LeaseWriter(store, 60, "old-fetcher", clock=lambda: 1_000.0)
    past.renew(2, 3)
    live = LeaseWriter(store, 60, "live-fetcher", clock=lambda: 2.0**40)
    live.renew(None, 4)
    report = collect_garbage(store, keep_anchors=1)
    assert report.plan.expired_leases == (lease_key("old-fetcher"),)
    assert not store.exists(lease_key("old-fetcher")) and store.exists(lease_key("live-fetcher"))
    assert committed(store) == [0, 1, 2, 3, 4, 10]  # the live lease fetches 4: its chain from the anchor 0
    live.release()
    assert collect_garbage(store, keep_anchors=1).plan.deleted_steps == (0, 1, 2, 3, 4)


def test_a_fetcher_with_lease_ttl_writes_its_lease(tmp_path: Path) -> None:
    states = make_states(4)
    store = LocalStore(tmp_path / "run", fsync=False)
    push(store, states, range(4))
    fetcher = ds.DeltaFetcher(store, lease_ttl=30)
    assert fetcher.lease is not None
    fetcher.lease.clock = lambda: 500.0
    model = zeros_like(states[0])
    fetcher.sync(model, step=2)
    lease = Lease.from_json(store.get(fetcher.lease.key))
    assert (lease.step, lease.target, lease.expires) == (2, None, 530)
    fetcher.materialize(tmp_path / "out", step=3)
    assert Lease.from_json(store.get(fetcher.lease.key)).step == 3
    with pytest.raises(ValueError, match="lease_ttl"):
        ds.DeltaFetcher(store, lease_ttl=0)


# --------------------------------------------------------------- uploader option


def test_uploader_keep_anchors_collects_after_each_anchor(tmp_path: Path) -> None:
    states = make_states(13)
    store = LocalStore(tmp_path / "run", fsync=False)
    with ds.DeltaUploader(store, anchor_every=4, keep_anchors=2, on_backlog="block") as up:
        assert up.retention is not None
        for s in range(13):
            up.push(states[s], s).result(WAIT)
            assert up.retention.wait_idle(WAIT)
    assert up.retention.failures == 0 and up.retention.runs >= 3
    assert committed(store) == list(range(8, 13))  # anchors 0, 4, 8, 12: the last two and their chains
    model = zeros_like(states[0])
    assert ds.DeltaFetcher(store).sync(model) == 12 and bits_equal_state(model, states[12])
    with pytest.raises(ValueError, match="keep_anchors"):
        ds.DeltaUploader(store, keep_anchors=0)


class _NoDelete(LocalStore):
    def delete_many(self, keys: Any) -> None:
        raise StorageError("deletes are not allowed here")


def test_a_failing_background_gc_is_counted_and_never_fails_a_commit(tmp_path: Path) -> None:
    states = make_states(9)
    store = _NoDelete(tmp_path / "run", fsync=False)
    with ds.DeltaUploader(store, anchor_every=2, keep_anchors=1, on_backlog="block") as up:
        infos = [up.push(states[s], s).result(WAIT) for s in range(9)]
        assert up.retention is not None and up.retention.wait_idle(WAIT)
    assert [i.step for i in infos] == list(range(9))
    assert up.retention.failures >= 1 and isinstance(up.retention.last_error, StorageError)
    assert committed(store) == list(range(9))


# ------------------------------------------------------------------ stress run


def _stress(make_store: Callable[[], Store], steps: int, anchor_every: int) -> None:
    """A trainer pushes (with keep_anchors=1) while gc runs in a loop and readers sync: none may fail.

    Readers: a live one syncing to the latest step, fresh fetchers each syncing once, and a lagging
    one holding a lease that walks the first half of the steps in order, each only once the trainer
    is well ahead of it (gc would have deleted them without the lease). The trainer waits for a gc
    run after each commit, and the lagging and live readers wait, between planning and downloading,
    for a whole gc run, so gc really deletes under them. Every state reached is checked bit-exact.
    """
    states = make_states(steps)
    errors: list[str] = []
    done = threading.Event()
    cv = threading.Condition()
    progress = {"committed": -1, "gc_runs": 0, "deleted": 0}
    with make_store() as store:  # an expired lease on the first steps must not keep them
        store.put(lease_key("expired"), Lease("expired", 0, 1, expires=1).to_json())

    def guard(name: str, fn: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                done.set()
                with cv:
                    cv.notify_all()

        return threading.Thread(target=run, name=name, daemon=True)

    def wait_for(step: int) -> None:
        with cv:
            if not cv.wait_for(lambda: progress["committed"] >= step or bool(errors), timeout=WAIT):
                raise TimeoutError(f"step {step} never came")

    def pusher() -> None:
        with (
            make_store() as store,
            ds.DeltaUploader(store, anchor_every=anchor_every, keep_anchors=1, on_backlog="block") as up,
        ):
            for s in range(steps):
                up.push(states[s], s).result(WAIT)
                with cv:
                    progress["committed"] = s
                    cv.notify_all()
                    if ready.is_set():  # paced: one gc run after each commit, so gc overlaps the readers
                        runs = progress["gc_runs"]
                        cv.wait_for(lambda runs=runs: progress["gc_runs"] > runs or bool(errors), timeout=WAIT)
            assert up.retention is not None and up.retention.wait_idle(WAIT)
            assert up.retention.failures == 0, up.retention.last_error

    def next_commit(seen: int) -> int:
        """Wait for a commit after ``seen`` (or the end); returns the newest committed step."""
        with cv:
            cv.wait_for(lambda: progress["committed"] > seen or done.is_set(), timeout=WAIT)
            return progress["committed"]

    def gc_loop() -> None:
        seen = -1
        with make_store() as store:
            for _ in range(10_000):
                if done.is_set():
                    break
                seen = next_commit(seen)  # twice per commit: one overlaps the readers' syncs of it
                for _ in range(2):
                    report = collect_garbage(store, keep_anchors=1, grace=0)
                    with cv:
                        progress["gc_runs"] += 1
                        progress["deleted"] += report.deleted
                        cv.notify_all()

    def gc_between_plan_and_download(store: HookStore) -> None:
        """Make the next sync of ``store`` wait, after planning, for a whole gc run (while the trainer runs)."""

        def hold() -> None:
            with cv:
                seen = progress["gc_runs"]  # the one running now may have read the store before the plan
                cv.wait_for(
                    lambda: progress["gc_runs"] > seen + 1 or progress["committed"] == steps - 1 or done.is_set(),
                    timeout=WAIT,
                )

        store.hook = hold

    def live_reader() -> None:
        with make_store() as inner:
            store = HookStore(inner)
            fetcher = ds.DeltaFetcher(store)
            model = zeros_like(states[0])
            reached = -1
            while reached < steps - 1 and not errors:
                wait_for(reached + 1)
                gc_between_plan_and_download(store)
                reached = fetcher.sync(model)
                assert bits_equal_state(model, states[reached]), f"live reader wrong at step {reached}"

    def fresh_readers() -> None:
        seen = -1
        with make_store() as store:
            for _ in range(10_000):
                if done.is_set():
                    break
                seen = next_commit(seen)
                model = zeros_like(states[0])
                reached = ds.DeltaFetcher(store).sync(model)
                assert bits_equal_state(model, states[reached]), f"fresh reader wrong at step {reached}"

    ready = threading.Event()

    def lagging_leased_reader() -> None:
        with make_store() as inner:
            store = HookStore(inner)
            fetcher = ds.DeltaFetcher(store, lease_ttl=3600.0)
            model = zeros_like(states[0])
            wait_for(0)
            fetcher.sync(model, step=0)
            ready.set()  # its lease holds step 0 before gc starts
            for s in range(1, steps // 2):  # then it releases its lease: the live reader is on its own
                wait_for(min(steps - 1, s + 2 * anchor_every + 1))
                gc_between_plan_and_download(store)
                assert fetcher.sync(model, step=s) == s
                assert bits_equal_state(model, states[s]), f"lagging reader wrong at step {s}"
            assert fetcher.lease is not None and fetcher.lease.failures == 0
            fetcher.lease.release()

    push_thread = guard("pusher", pusher)
    lagger = guard("lagging", lagging_leased_reader)
    push_thread.start()
    lagger.start()
    assert ready.wait(WAIT), errors or "the lagging reader never started"
    others = [guard("gc", gc_loop), guard("live", live_reader), guard("fresh", fresh_readers)]
    for t in others:
        t.start()
    for t in (push_thread, lagger, others[1]):  # the trainer and the readers that end by themselves
        t.join(6 * WAIT)
        assert not t.is_alive(), f"{t.name} hung"
    with cv:
        done.set()
        cv.notify_all()
    for t in others:
        t.join(WAIT)
        assert not t.is_alive(), f"{t.name} hung"
    assert not errors, errors
    assert progress["gc_runs"] >= 1
    with make_store() as store:
        final = collect_garbage(store, keep_anchors=1)
        last_anchor = (steps - 1) // anchor_every * anchor_every
        assert committed(store) == list(range(last_anchor, steps))
        # nothing is left of a collected step, its writer's subfolder (w<writer id>/...) included
        data = [o.key for o in store.list("steps/") if not o.key.endswith("/manifest.json")]
        assert data and all(k.split("/")[2].startswith("w") and k.count("/") == 3 for k in data)
        assert {int(k.split("/")[1]) for k in data} == set(range(last_anchor, steps))
        assert not store.exists(lease_key("expired"))
        assert progress["deleted"] + final.deleted > 0
        model = zeros_like(states[0])
        assert ds.DeltaFetcher(store).sync(model) == steps - 1 and bits_equal_state(model, states[-1])


@pytest.fixture
def local_run(tmp_path: Path) -> Iterator[Callable[[], Store]]:
    yield lambda: LocalStore(tmp_path / "run", fsync=False)


def test_stress_local(local_run: Callable[[], Store]) -> None:
    _stress(local_run, steps=40, anchor_every=3)


@pytest.mark.slow
def test_stress_s3(s3_server: Any) -> None:
    prefix = f"gc/{uuid.uuid4().hex[:12]}"
    _stress(lambda: s3_server.store("test", prefix), steps=24, anchor_every=3)


@pytest.mark.slow
def test_stress_fake_hf(fake_hub: Any) -> None:
    from fakehub import hf_store, new_bucket

    bucket = new_bucket(fake_hub)
    _stress(lambda: hf_store(fake_hub, bucket, "run"), steps=16, anchor_every=3)
