"""What one sync did: timings for metrics, and a journal to undo it after the fact.

A live engine applies a step in two moves: the fetcher brings a host mirror to the
step (in the background), then the engine loads the tensors that changed. When the
engine refuses them, the mirror must go back to the step the engine still serves:
:class:`SyncJournal` keeps the old bits of every element the sync wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from deltasync.fetcher._apply import Slot, Undo, alias_groups
from deltasync.fetcher._identity import Held

__all__ = ["SyncJournal", "SyncStats"]


@dataclass(slots=True)
class SyncStats:
    """Where one sync's time went, in seconds, and what it downloaded.

    ``base_step`` is the step the target held when the plan started from it (None: an anchor was
    loaded); ``steps`` the committed steps the plan applied; ``download_s`` includes file checksums,
    ``verify_s`` the tensor digest proofs, ``apply_s`` the writes into the target; ``spans`` the
    plan's elements that were spans, ``span_fallbacks`` plans through spans that failed and were
    made again without them.
    """

    step: int
    base_step: int | None = None
    steps: int = 0
    spans: int = 0
    span_fallbacks: int = 0
    nbytes: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    verify_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """Add the time spent in the block to the ``<what>_s`` field."""
        t0 = self.clock()
        try:
            yield
        finally:
            setattr(self, f"{what}_s", getattr(self, f"{what}_s") + self.clock() - t0)


class SyncJournal:
    """Pass one to :meth:`DeltaFetcher.sync` to be able to undo that sync later.

    After the sync, ``names`` are the tensors whose bits it wrote (tied names included), ``step``
    the step reached, ``base_step`` the step the target held before (None when unknown) and
    ``stats`` its :class:`SyncStats`.
    :meth:`rollback` restores the old bits and the fetcher's record of what the target holds. Roll
    back journals newest first; a journal rolls back once.
    """

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.step: int | None = None
        self.base_step: int | None = None
        #: timings and bytes of the sync (set when it returns)
        self.stats: SyncStats | None = None
        self._undo = Undo()
        self._restore: Callable[[], None] | None = None

    def _record(
        self,
        undo: Undo,
        slots: Mapping[str, Slot],
        step: int,
        base: int | None,
        restore: Callable[[], None],
    ) -> None:
        self._undo.extend(undo)
        written = self._undo.names
        self.names = tuple(sorted(n for n, primary in alias_groups(slots).items() if primary in written))
        self.step, self.base_step, self._restore = step, base, restore

    def rollback(self) -> None:
        """Put every element the sync wrote back as it was."""
        self._undo.rollback()
        if self._restore is not None:
            self._restore()
            self._restore = None
        self.names = ()


def restore_held(held: dict[int, Held], key: int, before: Held | None, target: Any, live: Any, slots: Any) -> None:
    """After a rollback: the target holds ``before``'s step again (re-recorded, since writes may have
    bumped version counters), or nothing this fetcher knows of."""
    if before is None:
        held.pop(key, None)
    else:
        held[key] = Held.record(before.step, before.digest, target, live, slots)
