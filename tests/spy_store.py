"""SpyStore: a store wrapper that records the keys read and written and can hold or fail writes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from deltasync.errors import StorageError
from deltasync.storage import Store
from deltasync.storage.base import Data, PutMode
from deltasync.storage.wrapper import WrapperStore

GATE_TIMEOUT = 60.0  # a gated write that waits this long means a test forgot to open its gate


class SpyStore(WrapperStore[Store]):
    """Wraps a store: records every key read and written, and can hold or fail writes.

    ``gate``: when set to an Event, ``put_many`` waits for it (so a test controls exactly
    when the uploader's writes may proceed). ``fail``: a predicate over the keys of a
    ``put_many`` call; when it returns True the call raises StorageError instead.
    ``delay``: seconds every ``put_many`` sleeps first. Writer claims (``writers/``, written
    by an uploader's first push) pass straight through, unrecorded.
    """

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gate: threading.Event | None = None
        self.fail: Callable[[Sequence[str]], bool] | None = None
        self.delay = 0.0
        self.gets: list[str] = []
        self.puts: list[str] = []
        self.blocked = threading.Event()  # set while a put_many waits on the gate
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget the recorded keys."""
        with self._lock:
            self.gets.clear()
            self.puts.clear()

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        keys = list(items)
        if all(k.startswith("writers/") for k in keys):
            self.inner.put_many(items, mode=mode)
            return
        if self.delay:
            time.sleep(self.delay)
        gate = self.gate
        if gate is not None and not gate.is_set():
            self.blocked.set()
            if not gate.wait(GATE_TIMEOUT):
                raise StorageError("SpyStore: gate never opened (test bug)")
        if self.fail is not None and self.fail(keys):
            raise StorageError(f"SpyStore: injected write failure for {keys[0]}")
        self.inner.put_many(items, mode=mode)
        with self._lock:
            self.puts.extend(keys)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        with self._lock:
            self.gets.extend(keys)
        return self.inner.get_many(keys)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        with self._lock:
            self.gets.append(key)
        return self.inner.get_range(key, start, end)

    def close(self) -> None:
        """Leaves the inner store open: tests read it back after the uploader is done."""

    def data_gets(self) -> list[str]:
        """Keys of data files read (manifests and HEAD left out)."""
        with self._lock:
            return [k for k in self.gets if k.startswith("steps/") and not k.endswith("/manifest.json")]


def step_of_key(key: str) -> int:
    """The step number in ``steps/000000000012/...``."""
    return int(key.split("/")[1])
