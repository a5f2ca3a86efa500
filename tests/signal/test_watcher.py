"""The one step watcher: store polling, the SSE stream with resume and the shared reconnect backoff,
driven with an injected clock and wait (no sleeping, no wall-clock asserts)."""

from __future__ import annotations

import json
import threading

import httpx

from deltasync._util.retry import RetryPolicy
from deltasync.errors import StorageError
from deltasync.protocol import Head
from deltasync.protocol.keys import HEAD_KEY
from deltasync.signal import StepSeen, StepWatcher, StorePoller
from deltasync.storage import MemoryStore


class FakeTime:
    """A clock that only moves when the watcher waits; stops the watch after ``waits`` waits."""

    def __init__(self, stop: threading.Event, waits: int) -> None:
        self.t = 0.0
        self.stop = stop
        self.left = waits
        self.waited: list[float] = []

    def clock(self) -> float:
        return self.t

    def wait(self, seconds: float) -> None:
        self.waited.append(seconds)
        self.t += seconds
        self.left -= 1
        if self.left <= 0:
            self.stop.set()


def test_without_a_signal_url_it_polls_every_interval_and_a_failed_poll_sees_nothing() -> None:
    answers: list[int | None | Exception] = [None, 3, StorageError("store down"), 5]

    def poll() -> int | None:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    stop = threading.Event()
    t = FakeTime(stop, 3)
    w = StepWatcher(poll, poll_interval=2.0, stop=stop, wait=t.wait, clock=t.clock)
    seen = list(w.watch())
    assert seen == [StepSeen("store", None), StepSeen("store", 3), StepSeen("store", None), StepSeen("store", 5)]
    assert t.waited == [2.0, 2.0, 2.0]


def test_the_stream_reconnects_with_a_growing_backoff_and_resumes_after_the_held_step() -> None:
    asked: list[str | None] = []
    commit = {"run": "r", "step": 7, "manifest_digest": "d" * 64, "time": 1234.5}

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("last-event-id"))
        if len(asked) <= 2:
            return httpx.Response(503, json={"detail": "starting"})
        body = f": hb\n\nevent: commit\nid: 7\ndata: {json.dumps(commit)}\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    stop = threading.Event()
    t = FakeTime(stop, 3)
    w = StepWatcher(
        lambda: 4,
        signal_url="http://signal.test",
        run="r",
        poll_interval=10.0,
        reconnect=RetryPolicy(retries=0, backoff=1.0, max_backoff=4.0),
        transport=httpx.MockTransport(server),
        stop=stop,
        wait=t.wait,
        clock=t.clock,
    )
    seen = list(w.watch(resume=lambda: 4))
    w.close()
    kinds = [(s.kind, s.step) for s in seen]
    assert kinds == [
        ("store", 4),
        ("lost", None),  # 503: poll, and try again after 1 s (not after the 10 s poll interval)
        ("store", 4),
        ("lost", None),  # again: 2 s
        ("store", 4),
        ("heartbeat", None),  # connected: the backoff starts over
        ("signal", 7),
        ("lost", None),  # the stream ended: 1 s
        ("store", 4),
    ]
    assert seen[6].committed_at == 1234.5
    assert t.waited == [1.0, 2.0, 1.0]
    assert asked == ["4", "4", "4"]  # every connect resumes after the step held


def test_the_store_poller_reads_head_and_lists_every_tenth_poll() -> None:
    store = MemoryStore("w")
    listed: list[int] = []

    def latest() -> int | None:
        listed.append(1)
        return 9

    p = StorePoller(store, latest)
    # no HEAD.json: every poll falls back to the listing
    assert [p() for _ in range(3)] == [9, 9, 9] and len(listed) == 3
    store.put(HEAD_KEY, Head(step=8, manifest_digest="d" * 32, run_id="r").to_json())
    listed.clear()
    got = [p() for _ in range(10)]  # polls 4 .. 13: the 11th is a listing
    assert listed == [1] and got.count(9) == 1 and got.count(8) == 9
