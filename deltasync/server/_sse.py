"""The Server-Sent Events stream of a run's commits (``GET /v1/runs/{run}/events``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from functools import lru_cache

from deltasync.server._db import Commit
from deltasync.server._relay import CommitRelay

__all__ = ["WAVES", "commit_stream", "sse_frame"]

#: the streams of a run are woken by a commit in this many waves, one loop pass apart (a stream's wave
#: is its rank among the run's subscribers, modulo this): 1,000 followers written in one pass held the
#: event loop ~50 ms, and every request arriving meanwhile (a heartbeat, ``/healthz``, GET fleet) waited
#: behind it; in waves, a request waits behind one wave at most
WAVES = 8


@lru_cache(maxsize=1024)
def sse_frame(c: Commit) -> bytes:
    """One ``commit`` event (id = step); encoded once per commit, not once per subscriber."""
    data = json.dumps(c.to_dict(), separators=(",", ":"))
    return f"id: {c.step}\nevent: commit\ndata: {data}\n\n".encode()


if sys.version_info >= (3, 11):

    async def _set_within(ev: asyncio.Event, timeout: float) -> bool:
        """Whether ``ev`` is set within ``timeout`` seconds. One timer per wait: ``wait_for`` (3.11) also
        wraps the wait in a task of its own, at every commit for every stream."""
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return False
        return True

else:  # pragma: no cover - Python 3.10

    async def _set_within(ev: asyncio.Event, timeout: float) -> bool:
        """Whether ``ev`` is set within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


async def commit_stream(
    relay: CommitRelay, run: str, after: int, limit: int | None, heartbeat: float
) -> AsyncIterator[bytes]:
    """Every commit of ``run`` newer than ``after``, then each new one; a comment after ``heartbeat`` idle seconds.

    Ends after ``limit`` events, or when the relay closes its streams (shutdown).
    """
    relay.subscribers[run] = relay.subscribers.get(run, 0) + 1
    wave = relay.subscribers[run] % WAVES
    sent = 0
    last = after
    try:
        yield b"retry: 1000\n\n"
        while not relay.closing:
            ev = relay.changed(run)
            for c in relay.commits_after(run, last):
                yield sse_frame(c)
                relay.metrics.inc("deltasync_sse_events_sent_total")
                last = c.step
                sent += 1
                if limit is not None and sent >= limit:
                    return
            if not await _set_within(ev, heartbeat):
                yield b": keepalive\n\n"
                continue
            for _ in range(wave):  # woken: let the waves before this one write first (see WAVES)
                await asyncio.sleep(0)
    finally:
        relay.subscribers[run] -= 1
