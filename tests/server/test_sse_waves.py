"""A commit wakes a run's SSE streams in waves (``deltasync.server._sse.WAVES``), one loop pass apart,
so that a request arriving meanwhile waits behind one wave, not behind every follower.

The streams run on a stand-in of the relay (the three things ``commit_stream`` uses of it: the
subscriber count, the run's change event and its commits); the order in which they write the
commit is recorded, no clock is read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from deltasync.server._db import Commit
from deltasync.server._sse import WAVES, commit_stream


class _Metrics:
    def inc(self, name: str, **labels: Any) -> None:
        pass


@dataclass
class _Relay:
    commits: list[Commit] = field(default_factory=list)
    subscribers: dict[str, int] = field(default_factory=dict)
    closing: bool = False
    metrics: _Metrics = field(default_factory=_Metrics)
    event: asyncio.Event | None = None

    def changed(self, run: str) -> asyncio.Event:
        if self.event is None:
            self.event = asyncio.Event()
        return self.event

    def commits_after(self, run: str, step: int | None) -> list[Commit]:
        return [c for c in self.commits if step is None or c.step > step]


def _commit(step: int) -> Commit:
    return Commit(run="r", step=step, manifest_digest="0" * 32, run_id=None, kind="patch", time=0.0)


def test_every_stream_gets_the_commit_wave_by_wave() -> None:
    n = 3 * WAVES + 1
    relay = _Relay(commits=[_commit(0)])
    order: list[int] = []
    passes: list[int] = []

    async def follow(i: int, ready: asyncio.Event) -> None:
        stream = commit_stream(relay, "r", 0, 1, heartbeat=3600.0)  # type: ignore[arg-type]
        assert await anext(stream) == b"retry: 1000\n\n"
        ready.set()
        frame = await anext(stream)
        assert b"id: 1\n" in frame
        order.append(i)
        passes.append(counter[0])
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator

    counter = [0]

    async def count_passes() -> None:
        while len(order) < n:
            counter[0] += 1
            await asyncio.sleep(0)

    async def main() -> None:
        readies = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.create_task(follow(i, readies[i])) for i in range(n)]
        for r in readies:
            await r.wait()
        await asyncio.sleep(0)  # every stream is waiting on the run's event
        relay.commits.append(_commit(1))
        assert relay.event is not None
        relay.event.set()
        ticker = asyncio.create_task(count_passes())
        await asyncio.gather(*tasks)
        await ticker

    asyncio.run(main())
    assert sorted(order) == list(range(n))  # every follower got the commit
    waves = [(i + 1) % WAVES for i in order]  # the i-th subscriber's wave (its rank, counted from 1)
    assert waves == sorted(waves), waves  # written wave after wave
    assert len(set(passes)) == WAVES  # one loop pass per wave: other work runs between them
    assert relay.subscribers["r"] == 0
