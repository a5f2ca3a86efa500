"""MirrorMetrics: what an EngineMirror records, through the protocol only (no probing for methods).

A mirror given no recorder records into :class:`NoMetrics` and works the same; a recording
:class:`MirrorMetrics` sees each prepare, commit, undo and failure with its figures. The engine is a
dict of tensors behind a loader, the run a memory store; the clock is the test's (no sleeping).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import UpdateRolledBack  # noqa: E402
from deltasync.fetcher import SyncStats  # noqa: E402
from deltasync.fetcher.metrics import SyncMetrics  # noqa: E402
from deltasync.serving.engine.mirror import EngineMirror, MirrorOptions  # noqa: E402
from deltasync.serving.engine.mirror_metrics import MirrorMetrics, NoMetrics  # noqa: E402

NAMES = [f"layer{i}.w" for i in range(4)]


def _state(step: int) -> dict[str, Any]:
    """Step s changes a few elements of layer s % 4 only."""
    g = torch.Generator().manual_seed(5)
    out = {n: torch.randn(32, 8, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        out[NAMES[s % 4]][s, :2] += 0.5
    return out


@pytest.fixture(scope="module")
def run() -> ds.MemoryStore:
    store = ds.MemoryStore("mirror-metrics")
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(4):
            up.push(_state(s), s).result()
    return store


class Engine:
    """Live weights behind a loader; ``refuse`` makes its next load fail half-way."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.weights = {k: v.clone() for k, v in state.items()}
        self.refuse = False

    def load(self, pairs: Iterable[tuple[str, Any]]) -> None:
        for i, (name, t) in enumerate(pairs):
            if self.refuse and i == 1:
                self.refuse = False
                raise RuntimeError("the engine refused this tensor")
            self.weights[name].copy_(t)


class Recording:
    """A MirrorMetrics that keeps every call, as (method, arguments)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def named(self, method: str) -> list[dict[str, Any]]:
        return [args for m, args in self.calls if m == method]

    def observe_sync(self, stats: SyncStats, *, pause_s: float | None = None) -> None:
        self.calls.append(("observe_sync", {"step": stats.step, "pause_s": pause_s}))

    def observe_applied(self, step: int, *, seconds: float | None = None) -> None:
        self.calls.append(("observe_applied", {"step": step, "seconds": seconds}))

    def observe_pause(self, seconds: float) -> None:
        self.calls.append(("observe_pause", {"seconds": seconds}))

    def observe_failure(self, kind: str) -> None:
        self.calls.append(("observe_failure", {"kind": kind}))

    def observe_node(self, *, nbytes: int, built: bool, pinned: int | None = None) -> None:
        self.calls.append(("observe_node", {"nbytes": nbytes, "built": built, "pinned": pinned}))

    def observe_prepare(self, seconds: float, *, starved: bool = False) -> None:
        self.calls.append(("observe_prepare", {"seconds": seconds, "starved": starved}))

    def observe_update(self, *, prepared: bool, pause_s: float) -> None:
        self.calls.append(("observe_update", {"prepared": prepared, "pause_s": pause_s}))

    def observe_load(self, *, loaded: int, scattered: int = 0, elements: int = 0) -> None:
        self.calls.append(("observe_load", {"loaded": loaded, "scattered": scattered, "elements": elements}))

    def observe_param_audit(self, *, ok: int, mismatched: int) -> None:
        self.calls.append(("observe_param_audit", {"ok": ok, "mismatched": mismatched}))


class Clock:
    """The mirror's clock: each reading is 0.5 s after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def _mirror(run: ds.MemoryStore, engine: Engine, metrics: MirrorMetrics | None) -> EngineMirror:
    options = MirrorOptions(seed={k: v.clone() for k, v in engine.weights.items()}, seed_step=0)
    return EngineMirror(ds.DeltaFetcher(run), engine.load, options, metrics=metrics, clock=Clock())


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_the_recorders_are_mirror_metrics() -> None:
    """Checked by mypy (strict): SyncMetrics and NoMetrics have every method of the protocol."""
    recorders: list[MirrorMetrics] = [SyncMetrics(), NoMetrics(), Recording()]
    for m in recorders:
        m.observe_failure("prepare")
        m.observe_param_audit(ok=1, mismatched=0)
    assert 'deltasync_sync_failures_total{kind="prepare"} 1' in recorders[0].render()  # type: ignore[attr-defined]


def test_a_mirror_without_metrics_prepares_commits_and_undoes_the_same(run: ds.MemoryStore) -> None:
    engine = Engine(_state(0))
    m = _mirror(run, engine, None)
    assert isinstance(m.metrics, NoMetrics)
    assert m.prepare(1).result(timeout=60) == 1 and m.last_prepare is not None and m.last_prepare.ok
    report = m.commit(1)
    assert (report.step, report.previous, report.tensors, report.prepared) == (1, 0, 1, True)
    assert _equal(engine.weights, _state(1))
    engine.refuse = True
    with pytest.raises(UpdateRolledBack, match="restored"):
        m.commit(3)  # steps 2 and 3 change two tensors: the second is refused, both are restored
    assert _equal(engine.weights, _state(1)) and m.serving == 1 and m.status().state == "serving"
    assert m.commit(3).step == 3 and _equal(engine.weights, _state(3))
    m.close()


def test_a_recording_mirror_metrics_sees_each_prepare_commit_and_failure(run: ds.MemoryStore) -> None:
    engine, rec = Engine(_state(0)), Recording()
    m = _mirror(run, engine, rec)
    assert m.metrics is rec
    m.seen(1)
    assert m.prepare(1).result(timeout=60) == 1
    (prepared,) = rec.named("observe_prepare")
    assert prepared["seconds"] > 0 and prepared["starved"] is False
    (node,) = rec.named("observe_node")
    assert node["built"] is True and node["nbytes"] > 0 and node["pinned"] is None  # this worker's request built it
    rec.calls.clear()
    m.commit(1)
    assert [c for c, _ in rec.calls] == ["observe_update", "observe_load", "observe_sync"]
    update, load, sync = (args for _, args in rec.calls)
    assert update["prepared"] is True and update["pause_s"] == sync["pause_s"] > 0
    assert load == {"loaded": 1, "scattered": 0, "elements": 0} and sync["step"] == 1
    rec.calls.clear()
    engine.refuse = True
    with pytest.raises(UpdateRolledBack):
        m.commit(3)  # prepared in the pause (not ahead), then refused by the engine
    assert rec.named("observe_failure") == [{"kind": "load"}] and not rec.named("observe_update")
    rec.calls.clear()
    with pytest.raises(UpdateRolledBack, match="was not applied"):
        m.commit(99)  # no such step: the engine is never touched
    assert rec.named("observe_failure") == [{"kind": "prepare"}]
    rec.calls.clear()
    report = m.commit(3)
    assert report.prepared is False and rec.named("observe_update")[0]["prepared"] is False
    assert rec.named("observe_load") == [{"loaded": 2, "scattered": 0, "elements": 0}]
    assert _equal(engine.weights, _state(3))
    m.close()
