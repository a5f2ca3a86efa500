"""Follower (``DeltaFetcher.follow``'s class): each concern driven on its own, with an injected watcher.

The watcher is a real :class:`~deltasync.signal.StepWatcher` polling a memory store, on a fake clock:
its ``wait`` advances the clock and plays the trainer (commits the next step) or ends the follow, so
nothing sleeps and nothing depends on timing. The fleet reports go to an ``httpx.MockTransport``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import ObjectNotFound, SignalRejected, SignalUnavailable, StorageError  # noqa: E402
from deltasync.fetcher import DeltaFetcher, Follower, FollowOptions, FollowStats, SyncStats  # noqa: E402
from deltasync.fetcher.metrics import SyncMetrics  # noqa: E402
from deltasync.signal import StepSeen, StepWatcher  # noqa: E402


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    w.view(-1)[: step * 5] += 1
    return {"w": w, "b": torch.arange(8, dtype=torch.float32) + step}


class Trainer:
    """A fake clock and ``wait`` for the watcher: each wait commits the next of ``steps`` (if any
    is left), runs ``each`` and advances the clock; the follow stops after ``ticks`` waits."""

    def __init__(self, store: ds.MemoryStore, steps: list[int], ticks: int) -> None:
        self.store = store
        self.steps = list(steps)
        self.ticks = ticks
        self.now = 0.0
        self.waits = 0
        self.stop = threading.Event()
        self.each: Callable[[], None] = lambda: None

    def clock(self) -> float:
        return self.now

    def push(self, step: int) -> None:
        with ds.DeltaUploader(self.store, anchor_every=100, on_backlog="block") as up:
            up.push(_state(step), step=step).result()

    def wait(self, timeout: float) -> bool:
        assert timeout > 0, "the follower must never spin"
        self.waits += 1
        self.now += timeout
        self.each()
        if self.steps:
            self.push(self.steps.pop(0))
        if self.waits >= self.ticks:
            self.stop.set()
        return self.stop.is_set()

    def watcher(self, follower: Follower) -> StepWatcher:
        return StepWatcher(follower.store_latest, poll_interval=0.5, stop=self.stop, wait=self.wait, clock=self.clock)


def _target() -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in _state(0).items()}


def _bits(t: Any) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def test_a_follower_applies_each_step_counts_it_and_records_it() -> None:
    store = ds.MemoryStore("follower-apply")
    trainer = Trainer(store, [1, 2, 3], ticks=50)
    trainer.push(0)
    target, reached = _target(), list[int]()
    clock = iter(float(i) for i in range(10_000))
    metrics = SyncMetrics(clock=lambda: next(clock))
    follower = Follower(
        DeltaFetcher(store),
        target,
        FollowOptions(until_step=3),
        stop=trainer.stop,
        on_step=reached.append,
        metrics=metrics,
    )
    assert follower.run(trainer.watcher(follower)) == 3
    assert reached == [0, 1, 2, 3] and follower.current == 3  # one step per poll: each applied as it came
    assert all(_bits(target[k]) == _bits(v) for k, v in _state(3).items())  # bit-exact
    st = follower.stats
    assert (st.applied, st.apply_failures, st.signals, st.signal_failures) == (4, 0, 0, 0)
    assert st.polls == trainer.waits + 2  # the watcher's first poll, then one before each wait and the last
    assert metrics.applied_step == 3 and metrics.head_step == 3 and metrics.staleness()[0] == 0
    assert "deltasync_syncs_total 4" in metrics.render()


class _Flaky:
    """A fetcher whose first sync of ``bad`` fails (the store lost a file for a while)."""

    def __init__(self, fetcher: DeltaFetcher, bad: int) -> None:
        self.fetcher, self.bad, self.failed = fetcher, bad, False
        self.store, self.reader = fetcher.store, fetcher.reader
        self.last_stats: SyncStats | None = None

    def sync(self, target: Any, step: int | None = None) -> int:
        if step == self.bad and not self.failed:
            self.failed = True
            raise StorageError(f"step {step}: a file is not there yet")
        reached = self.fetcher.sync(target, step)
        self.last_stats = self.fetcher.last_stats
        return reached

    def materialize(self, out_dir: Any, step: int | None = None, *, config_from: Any = None) -> Path:
        return self.fetcher.materialize(out_dir, step, config_from=config_from)

    def latest_step(self) -> int | None:
        return self.fetcher.latest_step()

    def current_step(self, target: Any) -> int | None:
        return self.fetcher.current_step(target)


def test_a_failed_apply_is_counted_reported_failed_to_the_fleet_and_retried() -> None:
    store = ds.MemoryStore("follower-fleet")
    trainer = Trainer(store, [1], ticks=50)
    trainer.push(0)
    bodies: list[dict[str, Any]] = []

    def signal_server(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            body = json.loads(request.content)
            bodies.append(body)
            return httpx.Response(200, json={"replica": "r0", **body})
        return httpx.Response(200, json={})

    metrics = SyncMetrics()
    options = FollowOptions(signal_url="http://signal.test", run="r", until_step=1, replica="r0")
    follower = Follower(
        _Flaky(DeltaFetcher(store), bad=1),
        _target(),
        options,
        stop=trainer.stop,
        metrics=metrics,
        transport=httpx.MockTransport(signal_server),
    )
    served: list[tuple[int | None, str, str | None]] = []

    def look() -> None:  # what the replica reports after each observation, once it reached the server
        reporter = follower.reporter
        assert reporter is not None and reporter.wait_reported(30)
        s = reporter.served
        if not served or served[-1] != (s.step, s.state, s.last_error):
            served.append((s.step, s.state, s.last_error))

    trainer.each = look
    assert follower.run(trainer.watcher(follower)) == 1
    assert served[0] == (0, "serving", None)
    assert served[1][:2] == (0, "failed") and "StorageError: step 1: a file is not there yet" in (served[1][2] or "")
    assert follower.stats.apply_failures == 1 and follower.stats.applied == 2  # step 0, then step 1 retried
    assert 'deltasync_sync_failures_total{kind="apply"} 1' in metrics.render()
    sent = [(b["step"], b["state"]) for b in bodies if b["state"] != "starting"]  # "starting": the reporter's first
    changes = [s for i, s in enumerate(sent) if i == 0 or s != sent[i - 1]]  # heartbeats repeat a state
    # each reached the server in turn (the last one may not before the replica leaves: it is not waited for)
    assert changes in ([(0, "serving"), (0, "failed")], [(0, "serving"), (0, "failed"), (1, "serving")])
    assert follower.reporter is not None and follower.reporter.served.step == 1  # closed with the step reached


def test_a_refused_stream_is_said_once_then_quietly_until_it_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    follower = Follower(DeltaFetcher(ds.MemoryStore("follower-signal")), {}, FollowOptions(poll_interval=0.25))
    refused = StepSeen("lost", error=SignalRejected("HTTP 403: the token does not grant 'subscribe'"))
    with caplog.at_level(logging.DEBUG, logger="deltasync.follow"):
        for seen in (refused, refused, StepSeen("heartbeat"), StepSeen("signal", 4, 12.0), StepSeen("store", 4)):
            follower.observe(seen)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "deltasync.follow"]
    assert said[0][0] == logging.WARNING and "polling the store every 0.25 s" in said[0][1]
    assert said[1][0] == logging.DEBUG and "still refuses" in said[1][1]
    assert said[2] == (logging.WARNING, "signal server accepts the stream now: following its signals")
    st = follower.stats
    assert (st.signal_failures, st.signals, st.connected) == (2, 1, True)


def test_a_signal_server_that_never_answers_is_said_once_with_the_polling_that_replaces_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = FollowOptions(signal_url="http://127.0.0.1:9", poll_interval=0.25)
    follower = Follower(DeltaFetcher(ds.MemoryStore("follower-dead-signal")), {}, options)
    dead = StepSeen("lost", error=SignalUnavailable("connection refused"))
    with caplog.at_level(logging.DEBUG, logger="deltasync.follow"):
        for seen in (dead, StepSeen("store", 1), dead, dead, StepSeen("heartbeat")):
            follower.observe(seen)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "deltasync.follow"]
    assert said[0] == (
        logging.WARNING,
        "signal server http://127.0.0.1:9 does not answer (connection refused); following by polling the store "
        "every 0.25 s until it answers",
    )
    assert [lvl for lvl, _ in said[1:3]] == [logging.DEBUG, logging.DEBUG]  # not said again while it is down
    assert said[3] == (logging.WARNING, "signal server accepts the stream now: following its signals")


def test_config_files_and_foreign_dirs_are_checked_before_anything_is_followed(tmp_path: Path) -> None:
    fetcher = DeltaFetcher(ds.MemoryStore("follower-config"))
    with pytest.raises(ValueError, match="directory target only"):
        Follower(fetcher, {}, FollowOptions(config_from=tmp_path))
    with pytest.raises(ObjectNotFound, match="no config.json"):
        Follower(fetcher, tmp_path / "out", FollowOptions(config_from=tmp_path))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    with pytest.raises(StorageError, match="refusing to follow"):
        Follower(fetcher, foreign)
    assert (foreign / "mine.txt").read_text() == "keep"


def test_a_dir_target_gets_every_version_with_the_config_files(tmp_path: Path) -> None:
    store = ds.MemoryStore("follower-dir")
    trainer = Trainer(store, [4], ticks=50)
    trainer.push(3)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "toy"}')
    out = tmp_path / "out"
    stats, metrics = FollowStats(), SyncMetrics()
    follower = Follower(
        DeltaFetcher(store),
        out,
        FollowOptions(until_step=4, config_from=model),
        stop=trainer.stop,
        stats=stats,
        metrics=metrics,
    )
    assert follower.out == out and follower.current is None
    assert follower.run(trainer.watcher(follower)) == 4
    assert (out / "config.json").read_text() == '{"model_type": "toy"}'
    assert json.loads((out / ".deltasync.json").read_text())["step"] == 4
    assert stats is follower.stats and stats.applied == 2 and metrics.applied_step == 4
    # a second follower of the same dir starts where it is: nothing to apply
    again = Follower(DeltaFetcher(store), out, FollowOptions(until_step=4, config_from=model))
    assert again.current == 4 and again.run(Trainer(store, [], ticks=3).watcher(again)) == 4


def test_follow_keeps_its_keywords_and_reads_them_into_the_options() -> None:
    options = FollowOptions(poll_interval=10.0, reconnect_backoff=(0.25, 8.0))
    assert options.keepalive == 5.0 and FollowOptions(poll_interval=0.1).keepalive == 0.2
    assert FollowOptions(heartbeat=1.5).keepalive == 1.5
    assert (options.reconnect.backoff, options.reconnect.max_backoff) == (0.25, 8.0)
    stop = threading.Event()
    stop.set()
    store = ds.MemoryStore("follower-keywords")
    Trainer(store, [], ticks=1).push(2)
    target = _target()
    assert DeltaFetcher(store).follow(target, until_step=2, stop=stop, poll_interval=0.01) is None  # stopped first
    assert DeltaFetcher(store).follow(target, until_step=2, poll_interval=0.01) == 2
