"""In-memory store: a dict behind a lock. For tests and single-process use."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from deltasync.errors import AlreadyExists, ObjectNotFound
from deltasync.storage.base import Data, ObjectInfo, PutMode, Store, map_os_errors, validate_key

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """Objects held in this process's memory; every instance is independent."""

    supports_conditional_put = True

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._mtimes: dict[str, float] = {}
        self._lock = threading.Lock()

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        for key, data in items.items():
            validate_key(key)
            if isinstance(data, Path):
                with map_os_errors(f"{self.url}: cannot read the payload of {key} from {data}"):
                    blob = data.read_bytes()
            else:
                blob = bytes(data)
            with self._lock:
                if mode == "create" and key in self._objects:
                    raise AlreadyExists(f"{self.url}: {key} already exists (create-only write)")
                self._objects[key] = blob
                self._mtimes[key] = time.time()

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        out: dict[str, bytes] = {}
        with self._lock:
            for key in keys:
                validate_key(key)
                try:
                    out[key] = self._objects[key]
                except KeyError:
                    raise ObjectNotFound(f"{self.url}: no object {key}") from None
        return out

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        with self._lock:
            return sorted(
                (ObjectInfo(k, len(v), self._mtimes.get(k)) for k, v in self._objects.items() if k.startswith(prefix)),
                key=lambda o: o.key,
            )

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        with self._lock:
            for key in keys:
                self._objects.pop(validate_key(key), None)
                self._mtimes.pop(key, None)

    def exists(self, key: str) -> bool:
        # docstring inherited
        with self._lock:
            return validate_key(key) in self._objects
