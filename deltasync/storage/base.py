"""The Store ABC: a small, batch-first, synchronous object store interface.

Object stores are latency-bound per request, so every method takes or returns
many objects at once; backends are free to parallelise inside. Keys are
``/``-separated relative paths (see :func:`validate_key`).
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Literal

from deltasync.errors import DeltaSyncError, InvalidKey, ObjectTooLarge, StorageError

__all__ = ["Data", "ObjectInfo", "PutMode", "Store", "check_limit", "map_os_errors", "too_large", "validate_key"]

PutMode = Literal["overwrite", "create"]
Data = bytes | bytearray | memoryview | Path


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A listed object: its key, its size in bytes and, where the backend reports it, ``mtime``:
    when it was last written, in unix seconds (the store's clock; not part of equality)."""

    key: str
    size: int
    mtime: float | None = field(default=None, compare=False)


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidKey."""
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise InvalidKey(f"invalid key {key!r}: keys are non-empty strings of at most 1024 characters")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(f"invalid key {key!r}: keys are relative, '/'-separated, without backslashes")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKey(f"invalid key {key!r}: empty, '.' or '..' path segments are not allowed")
    return key


def data_size(data: Data) -> int:
    """Size in bytes of a put payload."""
    if isinstance(data, Path):
        return data.stat().st_size
    return memoryview(data).nbytes


def too_large(url: str, key: str, size: int | None, limit: int) -> ObjectTooLarge:
    """The error of an object over ``limit`` bytes (``size``: its size where known, else "more than")."""
    held = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ObjectTooLarge(
        f"{url}: {key} holds {held}, over the {limit}-byte limit of what it may hold; refused before reading it "
        "(a damaged or hostile object: delete or rewrite it)"
    )


def check_limit(limit: int) -> int:
    """``limit`` if it is a non-negative int (bools refused), else ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"a read limit is a non-negative number of bytes, got {limit!r}")
    return limit


@contextmanager
def map_os_errors(what: str) -> Iterator[None]:
    """Translate OSError into StorageError (deltasync errors pass through)."""
    try:
        yield
    except DeltaSyncError:
        raise
    except OSError as exc:
        raise StorageError(f"{what}: {exc.strerror or exc}") from exc


class Store(ABC):
    """Batch-first object store. Subclasses implement the five abstract methods."""

    #: True when ``put_many(mode="create")`` is atomic against concurrent writers.
    supports_conditional_put: ClassVar[bool] = False
    #: A URL that :func:`deltasync.open_store` accepts and that names this store.
    url: str = ""

    @abstractmethod
    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        """Write objects; each object appears atomically (whole or not at all).

        ``mode="create"`` raises AlreadyExists for a key that already exists
        (objects before it in ``items`` may already be written). The batch as a
        whole is not transactional.
        """

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Read objects; a missing key raises ObjectNotFound."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (plain text match), sorted by key."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete objects; missing keys are ignored."""

    def list_after(self, prefix: str, start_after: str | None) -> builtins.list[ObjectInfo]:
        """Like :meth:`list`, but only keys sorting strictly after ``start_after``.

        Readers use it to list only what is new since their last listing. The
        default filters a full listing; backends whose API can start a listing
        at a key (S3 ``start-after``) override it so the request costs only
        the new keys.
        """
        found = self.list(prefix)
        return found if start_after is None else [o for o in found if o.key > start_after]

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object (the default reads it whole)."""
        return self.get(key)[start:end]

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        """Read objects that may each hold at most ``limits[key]`` bytes.

        An object over its limit raises :class:`~deltasync.errors.ObjectTooLarge` (naming it, its
        size and the limit) and a missing one ObjectNotFound. The backends of deltasync learn the
        size first (``fstat``, the first ranged GET's ``Content-Range``, the bucket's path info)
        and never read more than ``limit + 1`` bytes of an object; this default, for stores that
        do not override it, reads through :meth:`get_many` and checks after.
        """
        for limit in limits.values():
            check_limit(limit)
        out = self.get_many(list(limits))
        for key, blob in out.items():
            if len(blob) > limits[key]:
                raise too_large(self.url, key, len(blob), limits[key])
        return out

    def get_bounded(self, key: str, limit: int) -> bytes:
        """Read one object of at most ``limit`` bytes (see :meth:`get_many_bounded`)."""
        return self.get_many_bounded({key: limit})[key]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads. The default does nothing."""

    # -- conveniences built on the batch methods --------------------------

    def get(self, key: str) -> bytes:
        """Read one object."""
        return self.get_many([key])[key]

    def put(self, key: str, data: Data, *, mode: PutMode = "overwrite") -> None:
        """Write one object."""
        self.put_many({key: data}, mode=mode)

    def exists(self, key: str) -> bool:
        """Whether an object exists under ``key``."""
        validate_key(key)
        return any(o.key == key for o in self.list(key))

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
