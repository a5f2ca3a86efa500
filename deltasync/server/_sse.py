"""The Server-Sent Events stream of a run's commits (``GET /v1/runs/{run}/events``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import lru_cache

from deltasync.server._db import Commit
from deltasync.server._relay import CommitRelay

__all__ = ["commit_stream", "sse_frame"]


@lru_cache(maxsize=1024)
def sse_frame(c: Commit) -> bytes:
    """One ``commit`` event (id = step); encoded once per commit, not once per subscriber."""
    data = json.dumps(c.to_dict(), separators=(",", ":"))
    return f"id: {c.step}\nevent: commit\ndata: {data}\n\n".encode()


async def commit_stream(
    relay: CommitRelay, run: str, after: int, limit: int | None, heartbeat: float
) -> AsyncIterator[bytes]:
    """Every commit of ``run`` newer than ``after``, then each new one; a comment after ``heartbeat`` idle seconds.

    Ends after ``limit`` events, or when the relay closes its streams (shutdown).
    """
    relay.subscribers[run] = relay.subscribers.get(run, 0) + 1
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
            try:
                await asyncio.wait_for(ev.wait(), heartbeat)
            except asyncio.TimeoutError:
                yield b": keepalive\n\n"
    finally:
        relay.subscribers[run] -= 1
