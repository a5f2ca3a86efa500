"""The signal server's state: :class:`CommitRelay` records each run's commits and relays them.

It holds the runs' heads and commit history (in SQLite, with a cache of recent commits), wakes
the SSE streams and long-polls waiting on a run, delivers webhooks (retried with the one
:class:`~deltasync._util.retry.RetryPolicy`, whose waits the server's shutdown cuts short), and checks
published steps against the store. Store checks read through one
:class:`~deltasync.run.RunReader` per store, so a manifest is read once for the server's life
(manifests are immutable), except where the cache disagrees with a publisher or is about to
name a run's head: then the store is asked again (:meth:`RunReader.revalidate`), because a
store can be emptied and written again under the server (the demo's ``--loop`` does that,
with new content at the same steps). A publish is accepted only for the digest of the
manifest the store holds now.

All mutation happens on the event loop without an ``await`` inside the critical
section, so two concurrent publishes of one run cannot both pass the checks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx

from deltasync._util.retry import RetryPolicy
from deltasync.errors import DeltaSyncError, ObjectNotFound, StorageError
from deltasync.protocol import Committed
from deltasync.run import RunReader
from deltasync.server._db import Commit, Database, Webhook
from deltasync.server._metrics import Metrics
from deltasync.server._settings import Settings
from deltasync.server.webhooks import DELIVERY_HEADER, EVENT_HEADER, sign_webhook
from deltasync.storage import Store

__all__ = ["CommitRelay", "Conflict", "NotInStore", "StoreUnavailable"]

log = logging.getLogger("deltasync.server")
_RECENT = 256
#: the longest wait between two attempts of a webhook delivery
WEBHOOK_MAX_BACKOFF_S = 60.0


class Conflict(Exception):
    """A publish contradicts the run's history (409)."""


class StoreUnavailable(Exception):
    """The configured store could not be read to check a publish (503: the publisher retries)."""


class NotInStore(Exception):
    """A published step has no manifest in the configured store (422)."""


class CommitRelay:
    """Records each run's commits (heads, history) and relays them to SSE streams, long-polls and webhooks."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        store_for: Callable[[str], Store] | None,
        metrics: Metrics,
        webhook_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.store_for = store_for
        self.metrics = metrics
        self.webhook_transport = webhook_transport
        self.subscribers: dict[str, int] = {}
        self._recent: dict[str, deque[Commit]] = {}
        self._events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # one cached reader per store (manifests are immutable); keyed by id, holding the store alive
        self._readers: dict[int, tuple[Store, RunReader]] = {}
        self._readers_lock = threading.Lock()
        self.closing = False
        #: the retries of a webhook delivery: ``webhook_attempts`` in all, backoff doubling from
        #: ``webhook_backoff_s`` up to a minute
        self.webhook_retry = RetryPolicy(
            retries=settings.webhook_attempts - 1,
            backoff=max(0.0, settings.webhook_backoff_s),
            max_backoff=WEBHOOK_MAX_BACKOFF_S,
        )
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # see _stop_event

    # --------------------------------------------------------------- reads

    def _cache(self, run: str) -> deque[Commit]:
        cache = self._recent.get(run)
        if cache is None:
            n = min(_RECENT, self.settings.history)
            head = self.db.head(run)
            rows = self.db.after(run, head.step - n, n) if head else []
            cache = self._recent[run] = deque(rows, maxlen=n)
        return cache

    def head(self, run: str) -> Commit | None:
        """The newest signalled commit of ``run``."""
        cache = self._cache(run)
        return cache[-1] if cache else None

    def commits_after(self, run: str, step: int | None, limit: int = 1000) -> list[Commit]:
        """Commits newer than ``step`` (all retained ones when None), oldest first."""
        cache = self._cache(run)
        floor = -1 if step is None else step
        if cache and floor >= cache[0].step - 1:
            newer = []
            for c in reversed(cache):  # from the newest: a follower asks for the last one or two
                if c.step <= floor:
                    break
                newer.append(c)
            newer.reverse()
            return newer[:limit]
        return self.db.after(run, floor, limit)

    def changed(self, run: str) -> asyncio.Event:
        """An Event set at the next commit of ``run`` (fresh after each commit)."""
        loop = asyncio.get_running_loop()
        cur = self._events.get(run)
        if cur is None or cur[0] is not loop:
            cur = self._events[run] = (loop, asyncio.Event())
        return cur[1]

    async def wait_after(self, run: str, after: int, timeout: float) -> Commit | None:
        """The head once it is newer than ``after``, or None after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            ev = self.changed(run)
            head = self.head(run)
            if head is not None and head.step > after:
                return head
            if self.closing:
                return None
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                return None

    # --------------------------------------------------------------- store

    def reader(self, run: str) -> RunReader:
        """The :class:`~deltasync.run.RunReader` of ``run``'s store (one per store, cached; thread-safe)."""
        assert self.store_for is not None
        store = self.store_for(run)
        with self._readers_lock:
            held = self._readers.get(id(store))
            if held is None or held[0] is not store:
                held = self._readers[id(store)] = (store, RunReader(store))
            return held[1]

    def _read_manifest(self, run: str, step: int, digest: str | None = None) -> Committed | None:
        """Step ``step``'s manifest (None when not committed). When the cached one's digest is not
        ``digest``, the store is asked again: a legit publish after the store was emptied and
        rewritten matches the store's manifest now; a wrong digest still matches nothing."""
        reader = self.reader(run)
        try:
            found = reader.committed(step)
            if digest is not None and found.digest != digest and not reader.revalidate(step):
                found = reader.committed(step)  # the store was rewritten: its manifest now
        except ObjectNotFound:
            return None
        return found

    def _latest_in_store(self, run: str) -> Committed | None:
        reader = self.reader(run)
        step = reader.latest_step()  # newest committed step that no newer writer claim fences off
        if step is not None and not reader.revalidate(step):
            step = reader.latest_step()  # the store was emptied (and written again) under the cache
        return None if step is None else self._read_manifest(run, step)

    async def check_in_store(self, run: str, step: int, digest: str) -> None:
        """Raise NotInStore / Conflict unless the store holds manifest ``step`` with ``digest``."""
        if self.store_for is None:
            return
        try:
            found = await asyncio.to_thread(self._read_manifest, run, step, digest)
        except StorageError as exc:
            raise StoreUnavailable(f"cannot read step {step}'s manifest from the store: {exc}") from exc
        except DeltaSyncError as exc:
            raise NotInStore(f"step {step}'s manifest in the store is not valid: {exc}") from exc
        if found is None:
            raise NotInStore(f"step {step} is not committed in the store (no manifest)")
        if found.digest != digest:
            raise Conflict(f"step {step}'s manifest in the store has digest {found.digest}, not {digest}")

    async def rederive(self, run: str) -> Commit | None:
        """Record the store's newest committed step as the head when it is newer than ours.

        "Newest" is :meth:`RunReader.latest_step`: a step that a newer writer's claim
        fences off does not count.
        """
        if self.store_for is None:
            return self.head(run)
        found = await asyncio.to_thread(self._latest_in_store, run)
        if found is not None:
            m = found.manifest
            head = self.head(run)
            if head is None or m.step > head.step:
                self._record(run, m.step, found.digest, m.run_id, m.kind, source="store")
        return self.head(run)

    async def head_or_derive(self, run: str) -> Commit | None:
        """The head; for a run we know nothing of, derived from the store when one is configured."""
        head = self.head(run)
        if head is None and self.store_for is not None:
            try:
                head = await self.rederive(run)
            except DeltaSyncError as exc:
                log.warning("cannot derive the head of run %s from the store: %s", run, exc)
        return head

    # ------------------------------------------------------------- publish

    def publish(self, run: str, step: int, digest: str, run_id: str | None, kind: str | None) -> tuple[Commit, bool]:
        """Record a commit; returns it and whether it is new. Idempotent for the same (step, digest)."""
        existing = self.db.get_commit(run, step)
        if existing is not None:
            if existing.manifest_digest != digest:
                self.metrics.inc("deltasync_commits_rejected_total", reason="digest")
                raise Conflict(
                    f"step {step} of run {run!r} was already published with digest {existing.manifest_digest}"
                )
            return existing, False
        head = self.head(run)
        if head is not None and step < head.step:
            self.metrics.inc("deltasync_commits_rejected_total", reason="stale")
            raise Conflict(f"step {step} is older than run {run!r}'s head step {head.step}")
        return self._record(run, step, digest, run_id, kind, source="publish"), True

    def _record(self, run: str, step: int, digest: str, run_id: str | None, kind: str | None, source: str) -> Commit:
        c = Commit(run, step, digest, run_id, kind, time.time())
        self.db.add_commit(c, self.settings.history)
        self._cache(run).append(c)
        self.metrics.inc("deltasync_commits_total", source=source)
        self.metrics.set("deltasync_head_step", step, run=run)
        ev = self._events.pop(run, None)
        if ev is not None and ev[0] is asyncio.get_running_loop():
            ev[1].set()  # an Event of another (finished) loop has nobody waiting on it
        for hook in self.db.webhooks(run):
            self._spawn(self._deliver(hook, c))
        return c

    # ------------------------------------------------------------ webhooks

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, hook: Webhook, c: Commit) -> None:
        delivery = secrets.token_hex(16)
        body = json.dumps({"event": "commit", "delivery": delivery, **c.to_dict()}, separators=(",", ":")).encode()
        backoff = self.webhook_retry.backoff_state()
        attempts = self.webhook_retry.retries + 1
        async with httpx.AsyncClient(
            timeout=self.settings.webhook_timeout_s, transport=self.webhook_transport
        ) as client:
            for attempt in range(1, attempts + 1):
                headers = {
                    "Content-Type": "application/json",
                    EVENT_HEADER: "commit",
                    DELIVERY_HEADER: delivery,
                    **sign_webhook(hook.secret, body),
                }
                try:
                    r = await client.post(hook.url, content=body, headers=headers)
                    if r.status_code < 300:
                        self.metrics.inc("deltasync_webhook_deliveries_total", outcome="ok")
                        return
                    retry = r.status_code >= 500 or r.status_code in (408, 425, 429)
                    why = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    retry, why = True, f"{type(exc).__name__}: {exc}"
                self.metrics.inc("deltasync_webhook_attempts_failed_total")
                if not retry or attempt == attempts:
                    log.warning(
                        "webhook %s (%s) gave up on step %d after %d attempts: %s",
                        hook.id,
                        hook.url,
                        c.step,
                        attempt,
                        why,
                    )
                    self.metrics.inc("deltasync_webhook_deliveries_total", outcome="failed")
                    return
                if await self._stopped_within(backoff.next_delay()):
                    log.info("webhook %s (%s): delivery of step %d dropped at shutdown", hook.id, hook.url, c.step)
                    return

    def _stop_event(self) -> asyncio.Event:
        """The running loop's shutdown event (set by :meth:`close_streams` and :meth:`aclose`)."""
        loop = asyncio.get_running_loop()
        cur = self._stop
        if cur is None or cur[0] is not loop:
            cur = self._stop = (loop, asyncio.Event())
            if self.closing:
                cur[1].set()
        return cur[1]

    async def _stopped_within(self, delay: float) -> bool:
        """Wait ``delay`` seconds (a retry backoff); True when the server shuts down first."""
        stop = self._stop_event()
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            return False
        return True

    def close_streams(self) -> None:
        """Make every open SSE stream and long-poll return now, and webhook retries give up (server
        shutdown). Thread-safe."""
        self.closing = True
        stop = self._stop
        for loop, ev in [*self._events.values(), *([stop] if stop is not None else [])]:
            if not loop.is_closed():
                loop.call_soon_threadsafe(ev.set)

    async def aclose(self) -> None:
        """Stop retrying deliveries and cancel those still running."""
        self._stop_event().set()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
