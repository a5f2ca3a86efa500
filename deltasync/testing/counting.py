"""CountingStore: a Store wrapper that counts round trips, for request-cost tests and benchmarks."""

from __future__ import annotations

import builtins
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

from deltasync.storage.base import Data, ObjectInfo, PutMode, Store
from deltasync.storage.wrapper import WrapperStore

__all__ = ["CountingStore"]


class CountingStore(WrapperStore[Store]):
    """Delegates to ``inner`` and counts each call as one round trip (``calls``, by method) and
    the objects it read (``objects_read``). A ``get_many`` batch is one round trip: backends
    send its keys concurrently, so its latency is one request's."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.objects_read = 0
        self._lock = threading.Lock()

    def _count(self, method: str, objects: int = 0) -> None:
        with self._lock:
            self.calls[method] += 1
            self.objects_read += objects

    @property
    def requests(self) -> int:
        """Round trips so far."""
        return sum(self.calls.values())

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.calls.clear()
            self.objects_read = 0

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        self._count("put_many")
        self.inner.put_many(items, mode=mode)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        self._count("get_many", len(keys))
        return self.inner.get_many(keys)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        self._count("list")
        return self.inner.list(prefix)

    def list_after(self, prefix: str, start_after: str | None) -> builtins.list[ObjectInfo]:
        # docstring inherited
        self._count("list")
        return self.inner.list_after(prefix, start_after)

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        self._count("delete_many")
        self.inner.delete_many(keys)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        self._count("get_range", 1)
        return self.inner.get_range(key, start, end)

    def exists(self, key: str) -> bool:
        # docstring inherited
        self._count("exists")
        return self.inner.exists(key)
