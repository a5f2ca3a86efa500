"""How many threads a pool of deltasync's may use (the CPUs this process may run on), and a map
over a pool of that many (:func:`parallel_map`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["parallel_map", "usable_cpus"]

T = TypeVar("T")
R = TypeVar("R")


def usable_cpus() -> int:
    """The CPUs the process may run on (its affinity mask, which a container's cpuset narrows),
    else ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int | None = None) -> list[R]:
    """``fn`` of every item, in order, on a pool of up to ``threads`` threads (default:
    :func:`usable_cpus`) that lives for the call; on this thread when one would do. Raises the
    first failing item's error (after every item has run). For work whose calls release the GIL."""
    n = min(len(items), threads if threads is not None else usable_cpus())
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(n, thread_name_prefix="deltasync-pool") as pool:
        return list(pool.map(fn, items))
