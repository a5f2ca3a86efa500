"""The uploader's chain state: where the run's chain stands and what the next push must be.

:class:`ChainState` is the one owner of what was last pushed and committed, whether the
next push must be an anchor, the pushes and patch bytes since the anchor, the steps still
in flight and the failure state. The caller's thread (``push``), the commit stage and the
sharded path all read and change it through its methods, under its one lock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from deltasync.errors import WriterFenced
from deltasync.protocol import Committed
from deltasync.run import RunReader

__all__ = ["ChainState"]


class ChainState:
    """Thread-safe chain bookkeeping of one uploader (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._last_committed: Committed | None = None
        self._last_step: int | None = None  # the newest step pushed (or committed in the store at start)
        self._last_ok = True  # the newest commit attempt succeeded (a patch needs its parent)
        self._needs_anchor = True
        self._pushes_since_anchor = 0
        self._bytes_since_anchor = 0
        self._anchor_bytes = 0
        self._inflight = 0
        self._failures = 0
        self._fenced: WriterFenced | None = None
        self._resumed = False  # resume() was called, or a first push proved the store's head

    # ------------------------------------------------------------------ reading

    @property
    def last_committed(self) -> Committed | None:
        """The newest step committed by this uploader (or found in the store)."""
        with self._cond:
            return self._last_committed

    @property
    def last_step(self) -> int | None:
        """The newest step pushed, or the store's newest step before any push."""
        with self._cond:
            return self._last_step

    @property
    def inflight(self) -> int:
        """Pushed steps whose Futures are not resolved yet."""
        with self._cond:
            return self._inflight

    @property
    def failures(self) -> int:
        """Steps that failed to commit."""
        with self._cond:
            return self._failures

    @property
    def failed(self) -> bool:
        """The newest commit attempt failed: the next push must be an anchor."""
        with self._cond:
            return not self._last_ok

    @property
    def needs_anchor(self) -> bool:
        """The next push must be an anchor (first push, failed commit, unproven resume)."""
        with self._cond:
            return self._needs_anchor

    @property
    def resumed(self) -> bool:
        """resume() ran, or a first push proved the store's head."""
        with self._cond:
            return self._resumed

    def raise_if_fenced(self) -> None:
        """Raise the WriterFenced that stopped this uploader, if one did."""
        with self._cond:
            fenced = self._fenced
        if fenced is not None:
            raise fenced

    def anchor_due(self, anchor_every: int, bytes_fraction: float) -> bool:
        """Whether the next push is an anchor by the chain's history (not by its inventory)."""
        with self._cond:
            if self._needs_anchor or self._pushes_since_anchor + 1 >= anchor_every:
                return True
            return bool(
                bytes_fraction and self._anchor_bytes and self._bytes_since_anchor > bytes_fraction * self._anchor_bytes
            )

    # ------------------------------------------------------------------ the store's view

    def load_head(self, reader: RunReader) -> None:
        """Take the store's newest committed step (skipping a fenced writer's late commits)."""
        latest = reader.latest_step()
        if latest is not None:
            committed = reader.committed(latest)
            with self._cond:
                self._last_committed, self._last_step = committed, latest

    def set_view(self, committed: Committed | None, last_step: int | None) -> None:
        """Take another rank's view of the run (a sharded push starts from rank 0's)."""
        with self._cond:
            self._last_committed, self._last_step = committed, last_step

    def skip_to(self, step: int) -> None:
        """Steps up to ``step`` are taken (an older uploader committed them, or another rank pushed
        it): push after it."""
        with self._cond:
            self._last_step = step if self._last_step is None else max(self._last_step, step)

    def adopt(self, committed: Committed, pushes_since_anchor: int) -> None:
        """``committed`` is proven to be the trainer's state: the chain continues from it."""
        with self._cond:
            self._last_committed = committed
            self._last_step = committed.manifest.step
            self._last_ok = True
            self._needs_anchor = False
            self._pushes_since_anchor = pushes_since_anchor

    def mark_resumed(self) -> None:
        """resume() ran (or a first push proved the store's head)."""
        with self._cond:
            self._resumed = True

    def require_anchor(self) -> None:
        """The next push must be an anchor."""
        with self._cond:
            self._needs_anchor = True

    # ------------------------------------------------------------------ pushes

    def begin_anchor(self) -> None:
        """An anchor was pushed: counts restart from it (not from its commit: no double anchors)."""
        with self._cond:
            self._needs_anchor = False
            self._pushes_since_anchor = 0
            self._bytes_since_anchor = 0

    def count_patch(self) -> None:
        """A patch was pushed."""
        with self._cond:
            self._pushes_since_anchor += 1

    def pushed(self, step: int | None) -> None:
        """``step`` was pushed: it is the newest step and in flight until resolved (None: a refused
        push of a sharded uploader, in flight until every rank has heard of it)."""
        with self._cond:
            if step is not None:
                self._last_step = step
            self._inflight += 1

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        """Wait until no pushed step is in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)

    # ------------------------------------------------------------------ outcomes

    def committed(self, committed: Committed, resolved: int, *, count_pushes: bool = False) -> None:
        """A commit landed, resolving ``resolved`` pushed steps.

        ``count_pushes``: the push did not count the step (a sharded push decides its kind
        with every rank at commit time), so count it here.
        """
        m = committed.manifest
        with self._cond:
            self._last_committed = committed
            self._last_ok = True
            if count_pushes:
                self._needs_anchor = False
                self._pushes_since_anchor = 0 if m.kind == "anchor" else self._pushes_since_anchor + 1
            if m.kind == "anchor":
                self._anchor_bytes, self._bytes_since_anchor = m.stats.nbytes, 0
            else:
                self._bytes_since_anchor += m.stats.nbytes
            self._inflight -= resolved
            self._cond.notify_all()

    def resumed_head(self, resolved: int) -> None:
        """Every rank of a sharded push re-pushed the committed head: nothing was written; the next
        push is an anchor (a sharded state cannot be proven)."""
        with self._cond:
            self._resumed = True
            self._needs_anchor = True
            self._inflight -= resolved
            self._cond.notify_all()

    def failed_step(self, futures: list[tuple[int, Future[Any]]], err: BaseException) -> None:
        """A step did not commit: the next push is an anchor; ``err`` goes to its Futures."""
        with self._cond:
            self._failures += 1
            if isinstance(err, WriterFenced):
                self._fenced = err
            self._last_ok = False
            self._needs_anchor = True
            self._inflight -= len(futures)
            self._cond.notify_all()
        for _, fut in futures:
            fut.set_exception(err)
