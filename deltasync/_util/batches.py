"""Many small tasks on a thread pool as a few batches: a pool task costs tens of microseconds of
Python (a Future, a lock, a queue), which at 18k tensors a step costs more than the work itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

__all__ = ["BATCHES", "map_batched", "results", "split_even"]

T = TypeVar("T")
R = TypeVar("R")

#: batches per call: enough to balance 16+ threads, few enough that the pool's cost is nothing
BATCHES = 64


def split_even(weights: Sequence[int], parts: int) -> list[range]:
    """Contiguous index ranges covering ``weights`` in order, about ``sum / parts`` weight each."""
    n = len(weights)
    if n == 0:
        return []
    total = max(1, sum(weights))
    out: list[range] = []
    start, acc, k = 0, 0, 1
    for i, w in enumerate(weights):
        acc += w
        if acc * parts >= k * total and i + 1 < n:
            out.append(range(start, i + 1))
            start = i + 1
            while acc * parts >= k * total:
                k += 1
    out.append(range(start, n))
    return out


def map_batched(
    pool: Executor | None,
    fn: Callable[[T], R],
    items: Sequence[T],
    weights: Sequence[int] | None = None,
    *,
    parts: int = BATCHES,
) -> list[tuple[R | None, BaseException | None]]:
    """``fn`` of every item, in order, as (result, None) or (None, the error it raised): every item
    runs even when another fails. Items go to ``pool`` in about ``parts`` batches of even weight."""

    def run(r: range) -> list[tuple[R | None, BaseException | None]]:
        out: list[tuple[R | None, BaseException | None]] = []
        for i in r:
            try:
                out.append((fn(items[i]), None))
            except Exception as exc:  # noqa: BLE001 - handed to the caller with its item
                out.append((None, exc))
        return out

    ranges = split_even(weights if weights is not None else [1] * len(items), parts)
    if pool is None or len(ranges) < 2:
        return [x for r in ranges for x in run(r)]
    futures = [pool.submit(run, r) for r in ranges]
    return [x for f in futures for x in f.result()]


def results(outcomes: Sequence[tuple[R | None, BaseException | None]]) -> list[R]:
    """The results of :func:`map_batched`, or the first failing item's error raised."""
    out: list[R] = []
    for value, err in outcomes:
        if err is not None:
            raise err
        out.append(value)  # type: ignore[arg-type]
    return out
