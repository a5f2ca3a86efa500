"""The garbage collector's full passes, paused while a hot path allocates many small objects.

A node build or a first sync of an 18k-tensor target makes ~10 objects per tensor. Each batch of
them counts towards CPython's next full collection, and a full collection walks every tracked object
of the process: with the tensors, views and inventories of a large model held, one pass takes tens
of milliseconds, and one such path set off enough of them to take 370 of 500 ms (TargetViews.of on
18,432 fresh tensors, this project's 2-core machine). :func:`paused` turns the collector off for
the duration of such a path and back on after it (once every nested or concurrent pause is over);
what became garbage meanwhile is collected by the next pass as usual. A process that turned the
collector off itself keeps it off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_turned_off = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off while the block runs (re-entrant, and safe across threads)."""
    global _depth, _turned_off
    with _lock:
        if _depth == 0:
            _turned_off = gc.isenabled()
            if _turned_off:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _turned_off:
                _turned_off = False
                gc.enable()
