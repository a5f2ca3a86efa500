"""EngineMirror: prepare off the engine, commit only what changed, undo what the engine refused.

The engine here is a plain dict of tensors behind a loader that copies into it (what vLLM's
``load_weights`` does for unfused names); tests/integrations/test_vllm_backend.py runs the same code against a
real vLLM engine. Also SyncJournal, which the mirror's undo rests on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tensors import bits_equal  # noqa: E402

import deltasync as ds  # noqa: E402
from deltasync.errors import (  # noqa: E402
    EngineIncompatible,
    InventoryMismatch,
    UpdateRolledBack,
    WorkerNeedsReplacement,
)
from deltasync.fetcher import SyncJournal  # noqa: E402
from deltasync.protocol import file_key  # noqa: E402
from deltasync.serving.engine.mirror import EngineMirror, EngineStatus, MirrorOptions  # noqa: E402
from deltasync.serving.engine.prefetch import Prefetcher  # noqa: E402
from deltasync.serving.engine.prepare_log import PrepareReport  # noqa: E402

STEPS = 6
NAMES = [f"layer{i}.w" for i in range(6)]


def _state(step: int) -> dict[str, Any]:
    """Step s changes a few elements of layers s % 6 and (s + 1) % 6 only."""
    g = torch.Generator().manual_seed(3)
    out = {n: torch.randn(64, 8, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        for n in (NAMES[s % 6], NAMES[(s + 1) % 6]):
            out[n][s % 64, :3] += 0.5
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run() -> ds.MemoryStore:
    store = ds.MemoryStore("mirror")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(STEPS):
            up.push(_state(s), s).result()
    return store


def _copy(store: ds.MemoryStore) -> ds.MemoryStore:
    out = ds.MemoryStore("copy")
    out.put_many({o.key: store.get(o.key) for o in store.list()})
    return out


class Engine:
    """Live weights plus a loader; ``fail_after`` makes the n-th loaded tensor (and later) fail."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state.items()}
        self.loads: list[list[str]] = []
        self.fail_after: int | None = None
        self.fail_calls: set[int] = set()

    def load(self, pairs: Iterable[tuple[str, Any]]) -> None:
        call = len(self.loads)
        self.loads.append([])
        for i, (name, t) in enumerate(pairs):
            if call in self.fail_calls and self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError(f"engine refused {name}")
            self.weights[name].copy_(t)
            self.loads[-1].append(name)


def _mirror(
    store: ds.MemoryStore, engine: Engine, step: int | None = 0, *, metrics: Any = None, clock: Any = None, **kw: Any
) -> EngineMirror:
    seed = {k: v.clone() for k, v in engine.weights.items()}
    options = MirrorOptions(seed=seed, seed_step=step, **kw)
    return EngineMirror(ds.DeltaFetcher(store), engine.load, options, metrics=metrics, clock=clock or time.perf_counter)


def test_prepare_leaves_the_engine_alone_and_commit_loads_only_what_changed(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine)
    assert m.prepare(1).result() == 1
    assert m.status().prepared == 1 and m.serving == 0
    assert _equal(engine.weights, _state(0)) and engine.loads == []
    report = m.commit(1)
    assert report.prepared and report.step == 1 and report.previous == 0
    assert engine.loads == [sorted([NAMES[1], NAMES[2]])]
    assert _equal(engine.weights, _state(1))
    for s in range(2, STEPS):
        m.prepare(s).result()
        assert m.commit(s).tensors == 2
        assert _equal(engine.weights, _state(s))
    status = m.status()
    assert status == EngineStatus(STEPS - 1, None, "serving", None, run.url, str(m.node.dir))
    assert status.to_json() == {  # the JSON keys the workers' RPCs answer with
        "step": STEPS - 1,
        "prepared": None,
        "state": "serving",
        "last_error": None,
        "store": run.url,
        "node_dir": str(m.node.dir),
    }


def test_catch_up_after_missed_steps_without_prepare(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine)
    report = m.commit(4)
    assert not report.prepared and report.tensors == 5  # steps 1..4 touch layers 1..5
    assert _equal(engine.weights, _state(4))


def test_prepared_past_the_asked_step_goes_back_to_it(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine)
    m.prepare(2).result()
    m.prepare(4).result()
    assert m.prepared == 4
    m.commit(3)
    assert _equal(engine.weights, _state(3))
    assert m.commit(5).step == 5 and _equal(engine.weights, _state(5))


def test_corrupted_patch_never_touches_the_engine(run: ds.MemoryStore) -> None:
    store = _copy(run)
    m0 = ds.DeltaFetcher(store).manifest(2)
    key = file_key(2, m0.files[0].path)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x40
    store.put(key, bytes(data))
    engine = Engine(_state(0))
    m = _mirror(store, engine)
    m.commit(1)
    fut = m.prepare(2)
    with pytest.raises(ds.errors.ChecksumMismatch):
        fut.result()
    with pytest.raises(UpdateRolledBack, match="still serves step 1"):
        m.commit(2)
    assert _equal(engine.weights, _state(1)) and m.serving == 1 and m.state == "serving"
    assert "ChecksumMismatch" in (m.status().last_error or "")


def test_prefetch_backs_off_a_bad_step_and_prepares_it_once_repaired(run: ds.MemoryStore) -> None:
    """The prefetcher (no vLLM) over a real mirror: a corrupted newest step is retried after 1, 2, 4 ...
    poll intervals, not at every poll (fake time: each wait lets the prepares finish, then moves on)."""
    store = _copy(run)
    last = STEPS - 1
    key = file_key(last, ds.DeltaFetcher(store).manifest(last).files[0].path)
    good = store.get(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    store.put(key, bytes(bad))
    engine = Engine(_state(0))
    m = _mirror(store, engine)
    now = [0.0]
    stop = threading.Event()
    tried: list[float] = []

    class Counting:
        serving = property(lambda self: m.serving)
        latest_step = staticmethod(m.latest_step)

        def prepare(self, step: int | None = None, *, coalesce: str | None = None) -> Any:
            tried.append(now[0])
            return m.prepare(step, coalesce=coalesce)

    def wait(seconds: float) -> None:
        assert m.wait_prepared(60)
        now[0] += seconds
        if now[0] == 10.0:
            store.put(key, good)  # repaired (a re-upload of the same bytes)
        if now[0] >= 16.0:
            stop.set()

    p = Prefetcher(lambda: Counting(), poll_interval=1.0, clock=lambda: now[0], wait=wait, stop=stop)
    p.run()
    assert m.wait_prepared(60)
    assert tried == [0.0, 1.0, 3.0, 7.0, 15.0]  # 16 polls, 5 tries; the fifth finds it repaired
    assert p.failures == 4 and m.prepared == last and engine.loads == []
    m.commit()
    assert _equal(engine.weights, _state(last)) and m.serving == last


@pytest.mark.parametrize("fail_after", [0, 1])
def test_engine_refusing_a_load_is_undone_bit_exact(run: ds.MemoryStore, fail_after: int) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine)
    m.commit(1)
    m.prepare(3).result()
    engine.fail_after, engine.fail_calls = fail_after, {1}
    with pytest.raises(UpdateRolledBack, match="still serves step 1"):
        m.commit(3)
    assert _equal(engine.weights, _state(1)) and m.serving == 1 and m.prepared is None
    # the mirror went back too: the next commit patches forward from step 1 correctly
    assert m.commit(4).step == 4 and _equal(engine.weights, _state(4))


def test_restore_failing_too_marks_the_worker_for_replacement(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine)
    engine.fail_after, engine.fail_calls = 1, {0, 1}
    with pytest.raises(WorkerNeedsReplacement, match="replace this worker"):
        m.commit(2)
    assert m.status().state == "needs_replacement"
    with pytest.raises(WorkerNeedsReplacement):
        m.commit(3)
    with pytest.raises(WorkerNeedsReplacement):
        m.prepare(3)


def test_unseeded_mirror_loads_everything_once_then_only_changes(run: ds.MemoryStore) -> None:
    engine = Engine({k: torch.zeros_like(v) for k, v in _state(0).items()})
    m = EngineMirror(ds.DeltaFetcher(run), engine.load)
    assert m.commit(2).tensors == len(NAMES)
    assert _equal(engine.weights, _state(2))
    assert m.commit(3).tensors == 2 and _equal(engine.weights, _state(3))


def test_unseeded_mirror_refuses_a_run_larger_than_the_engine(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = EngineMirror(ds.DeltaFetcher(run), engine.load, MirrorOptions(max_bytes=1024))
    with pytest.raises(UpdateRolledBack) as info:
        m.commit(1)
    assert isinstance(info.value.__cause__, InventoryMismatch)
    assert engine.loads == []


def test_seed_from_another_step_is_proven_not_trusted(run: ds.MemoryStore) -> None:
    engine = Engine(_state(3))
    m = _mirror(run, engine, step=1)  # the dir claims step 1 but holds step 3
    m.commit(4)
    assert _equal(engine.weights, _state(4))


def test_seed_with_unknown_step_loads_only_tensors_that_differ(run: ds.MemoryStore) -> None:
    engine = Engine(_state(2))
    m = _mirror(run, engine, step=None)
    report = m.commit(2)
    assert report.tensors == 0 and _equal(engine.weights, _state(2))


# ---------------------------------------------------------------- engine check

LAYOUT = {n: (torch.bfloat16, (64, 8)) for n in NAMES}


class Refuse:
    """An engine check that records the layouts it is shown and refuses them."""

    def __init__(self) -> None:
        self.layouts: list[dict[str, Any]] = []

    def __call__(self, layout: Any) -> None:
        self.layouts.append(dict(layout))
        raise EngineIncompatible("this engine computes from copies of its weights")


def test_a_seeded_mirror_shows_its_seed_to_the_check_before_anything_else(run: ds.MemoryStore) -> None:
    engine, refuse = Engine(_state(0)), Refuse()
    with pytest.raises(EngineIncompatible, match="copies of its weights"):
        _mirror(run, engine, check=refuse)
    assert refuse.layouts == [LAYOUT] and engine.loads == []


def test_an_unseeded_mirror_shows_the_run_s_inventory_to_the_check_before_the_first_load(run: ds.MemoryStore) -> None:
    engine, refuse = Engine(_state(0)), Refuse()
    m = EngineMirror(ds.DeltaFetcher(run), engine.load, MirrorOptions(check=refuse))
    with pytest.raises(EngineIncompatible):
        m.prepare(2).result()
    with pytest.raises(EngineIncompatible, match="copies of its weights"):  # itself, not UpdateRolledBack
        m.commit(2)
    assert refuse.layouts == [LAYOUT, LAYOUT]
    assert engine.loads == [] and _equal(engine.weights, _state(0))
    assert m.status().state == "serving" and m.serving is None
    assert "EngineIncompatible" in (m.status().last_error or "")


def test_a_check_that_accepts_the_engine_changes_nothing(run: ds.MemoryStore) -> None:
    engine, seen = Engine(_state(0)), []
    m = _mirror(run, engine, check=seen.append)
    m.commit(3)
    assert _equal(engine.weights, _state(3)) and seen == [LAYOUT]


# ---------------------------------------------------------------- journal


def test_journal_rolls_a_forward_sync_back_and_the_fetcher_follows(run: ds.MemoryStore) -> None:
    f = ds.DeltaFetcher(run)
    target = {k: v.clone() for k, v in _state(0).items()}
    f.sync(target, 1)
    j = SyncJournal()
    f.sync(target, 3, journal=j)
    assert j.step == 3 and j.base_step == 1 and set(j.names) == {NAMES[2], NAMES[3], NAMES[4]}
    assert f.last_stats is not None and f.last_stats.steps == 2 and f.last_stats.nbytes > 0
    j.rollback()
    assert _equal(target, _state(1)) and f.current_step(target) == 1
    f.sync(target, 5)
    assert _equal(target, _state(5))


def test_journal_of_an_anchor_sync_names_only_tensors_that_changed(run: ds.MemoryStore) -> None:
    f = ds.DeltaFetcher(run)
    target = {k: v.clone() for k, v in _state(2).items()}
    j = SyncJournal()
    f.sync(target, 3, journal=j)  # nothing proves the target's step: anchor + 3 patches
    assert j.base_step is None and set(j.names) == {NAMES[3], NAMES[4]}
    j.rollback()
    assert _equal(target, _state(2)) and f.current_step(target) is None


# ------------------------------------------------------------ tensor parallel


def _ranks(n: int) -> Any:
    """An all-gather between ``n`` threads (what torch.distributed gives a TP group)."""
    import threading

    barrier = threading.Barrier(n, timeout=30)
    slots: list[Any] = [None] * n

    def agree_for(rank: int) -> Any:
        def agree(mine: Any) -> list[Any]:
            slots[rank] = mine
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return agree

    return agree_for


def _commit_all(mirrors: list[EngineMirror], step: int) -> list[BaseException | None]:
    from concurrent.futures import ThreadPoolExecutor

    def one(m: EngineMirror) -> BaseException | None:
        try:
            m.commit(step)
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None

    with ThreadPoolExecutor(len(mirrors)) as pool:
        return list(pool.map(one, mirrors))


def test_a_rank_that_refuses_the_load_makes_every_rank_undo(run: ds.MemoryStore) -> None:
    agree_for = _ranks(2)
    engines = [Engine(_state(0)), Engine(_state(0))]
    mirrors = [_mirror(run, e, agree=agree_for(r)) for r, e in enumerate(engines)]
    assert _commit_all(mirrors, 1) == [None, None]
    engines[1].fail_after, engines[1].fail_calls = 1, {1}
    errs = _commit_all(mirrors, 3)
    assert all(isinstance(e, UpdateRolledBack) and "rank 1" in str(e) for e in errs)
    assert all(_equal(e.weights, _state(1)) for e in engines)  # rank 0 loaded step 3 and was put back
    assert _commit_all(mirrors, 4) == [None, None]
    assert all(_equal(e.weights, _state(4)) for e in engines)


def test_a_rank_that_cannot_prepare_stops_every_rank_before_the_pause(run: ds.MemoryStore) -> None:
    bad = _copy(run)
    key = file_key(2, ds.DeltaFetcher(bad).manifest(2).files[0].path)
    data = bytearray(bad.get(key))
    data[-1] ^= 1
    bad.put(key, bytes(data))
    agree_for = _ranks(2)
    engines = [Engine(_state(0)), Engine(_state(0))]
    mirrors = [_mirror(s, e, agree=agree_for(r)) for r, (s, e) in enumerate(zip([run, bad], engines, strict=True))]
    errs = _commit_all(mirrors, 2)
    assert all(isinstance(e, UpdateRolledBack) and "rank 1: ChecksumMismatch" in str(e) for e in errs)
    assert all(_equal(e.weights, _state(0)) and e.loads == [] for e in engines)


def test_metrics_count_the_engine_step_not_the_prepared_one(run: ds.MemoryStore) -> None:
    from deltasync.fetcher.metrics import SyncMetrics

    clock = iter(float(t) for t in range(1000, 2000))
    metrics = SyncMetrics(clock=lambda: next(clock))
    engine = Engine(_state(0))
    m = _mirror(run, engine, metrics=metrics)
    metrics.observe_head(3)
    m.prepare(3).result()
    assert metrics.applied_step is None  # prepared, but the engine still serves step 0
    m.commit(3)
    assert metrics.applied_step == 3 and metrics.staleness()[0] == 0
    text = metrics.render()
    assert "deltasync_pause_seconds_count 1" in text
    assert 'deltasync_sync_phase_seconds_count{phase="verify"} 1' in text
    assert "deltasync_downloaded_bytes_total 0" not in text


def test_uploader_and_fetcher_take_a_url(tmp_path: Any) -> None:
    with ds.DeltaUploader(str(tmp_path / "run"), anchor_bytes_fraction=0) as up:
        up.push(_state(0), 0).result()
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    assert ds.DeltaFetcher((tmp_path / "run").as_uri()).sync(target) == 0
    assert _equal(target, _state(0))


# ---------------------------------------------------------------- tied names


def _tied_state(step: int, *, part_at: int | None = None) -> dict[str, Any]:
    """A tied model's state dict: ``head`` is ``embed`` (both names, as ``model.state_dict()`` of a
    tied transformers model holds them); from step ``part_at`` on, ``head`` gets changes of its own."""
    out = _state(step)
    embed = out["layer0.w"].clone()
    for s in range(1, step + 1):
        embed[(3 * s) % 64, 4:] -= 0.25
    out["embed"] = embed
    out["head"] = embed.clone()
    if part_at is not None and step >= part_at:
        out["head"][0, 0] += 1.0
    return out


class TiedEngine(Engine):
    """One parameter under two names, and a loader that skips ``head`` when ``embed`` comes along and
    refuses it alone (what vLLM's ``load_weights`` does for ``lm_head.weight`` of a tied model)."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__({k: v for k, v in state.items() if k != "head"})
        self.weights["head"] = self.weights["embed"]

    def load(self, pairs: Iterable[tuple[str, Any]]) -> None:
        pairs = list(pairs)
        names = {n for n, _ in pairs}
        if "head" in names and "embed" not in names:
            raise ValueError("'head' was skipped because it is tied to 'embed', but 'embed' was not found")
        super().load([(n, t) for n, t in pairs if n != "head"])


def _tied_run(part_at: int | None = None) -> ds.MemoryStore:
    store = ds.MemoryStore("tied")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(STEPS):
            up.push(_tied_state(s, part_at=part_at), s).result()
    return store


def test_a_tied_name_is_updated_through_the_name_it_is_tied_to() -> None:
    store = _tied_run()
    engine = TiedEngine(_tied_state(0))
    m = _mirror(store, engine, check=lambda layout: {"head": "embed"})
    for step in range(1, STEPS):
        m.commit(step)
        assert _equal(engine.weights, _tied_state(step)) and m.serving == step
    assert all("head" not in names for names in engine.loads)
    assert any("embed" in names for names in engine.loads)


def test_a_run_whose_tied_names_part_is_refused_before_the_engine_is_touched() -> None:
    store = _tied_run(part_at=3)
    engine = TiedEngine(_tied_state(0))
    m = _mirror(store, engine, check=lambda layout: {"head": "embed"})
    m.commit(2)
    loads = len(engine.loads)
    with pytest.raises(EngineIncompatible, match=r"different values in head and embed.*still serves step 2"):
        m.commit(3)
    assert len(engine.loads) == loads and _equal(engine.weights, _tied_state(2)) and m.serving == 2
    with pytest.raises(EngineIncompatible):
        m.prepare(4).result()
    assert m.status().state == "serving" and m.serving == 2


# ------------------------------------------------------------------ prepare latency and starved builds (issue 34)


class _Clock:
    """A mirror's clock that a test moves (no sleeping)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_prepare_reports_its_latency_and_each_update_whether_it_was_prepared(run: ds.MemoryStore) -> None:
    from deltasync.fetcher.metrics import SyncMetrics

    clock, metrics = _Clock(), SyncMetrics()
    m = _mirror(run, Engine(_state(0)), metrics=metrics, clock=clock)
    reports: list[PrepareReport] = []
    m.on_prepared = reports.append
    m.seen(1)  # the commit is heard of (a poll or a signal)
    clock.now += 3.0  # the prefetch asks 3 s later
    assert m.prepare(1).result() == 1
    assert reports == [m.last_prepare] and reports[0].step == 1 and reports[0].ok
    assert reports[0].latency_s == 3.0 and not reports[0].starved
    assert m.commit(1).prepared
    m.commit(2)  # not prepared: built in the pause
    text = metrics.render()
    assert "deltasync_prepare_seconds_count 1" in text and "deltasync_last_prepare_seconds 3.0" in text
    assert 'deltasync_engine_updates_total{prepared="true"} 1' in text
    assert 'deltasync_engine_updates_total{prepared="false"} 1' in text
    assert "deltasync_prepared_pause_seconds_count 1" in text
    assert "deltasync_prepare_starved_total 0" in text


def test_a_prepare_far_longer_than_its_build_is_reported_as_starved(
    run: ds.MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The build's own work is its CPU seconds; a prepare whose wall time is far beyond them waited for
    CPU, a lock or a leader: a warning and ``deltasync_prepare_starved_total``."""
    from deltasync.fetcher.metrics import SyncMetrics

    clock, metrics = _Clock(), SyncMetrics()
    m = _mirror(run, Engine(_state(0)), metrics=metrics, clock=clock)
    ensure = m.node.ensure

    def slow_ensure(step: int) -> Any:
        clock.now += 60.0  # what a build starved of CPU looks like from the worker
        return ensure(step)

    m.node.ensure = slow_ensure  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="deltasync.mirror"):
        assert m.prepare(1).result() == 1
    assert m.last_prepare is not None and m.last_prepare.starved, m.last_prepare
    assert "deltasync_prepare_starved_total 1" in metrics.render()
    assert any("was starved" in r.getMessage() for r in caplog.records)
