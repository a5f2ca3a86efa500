"""What one sync did: :class:`SyncStats` (a leaf module: the metrics recorder imports it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["SyncStats"]


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
