"""WrapperStore: the one base of every store that wraps another (spies, fault injectors, counters).

In the spirit of zarr-python's ``storage/_wrapper.py``: :class:`WrapperStore` delegates every
method of :class:`~deltasync.storage.Store` and its capability flag to ``inner``, so a subclass
overrides only what it observes or changes (``put_many`` to fail or hold writes, ``get_many`` and
``get_range`` to record reads, ...).

The conveniences ``get``, ``get_bounded``, ``put`` and ``exists`` are *not* delegated: they stay built on the batch
methods of the wrapper (as :class:`~deltasync.storage.Store` builds them), so a subclass that
overrides ``get_many`` or ``put_many`` sees the single-object calls too.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from deltasync.storage.base import Data, ObjectInfo, PutMode, Store

__all__ = ["WrapperStore"]

S = TypeVar("S", bound=Store)


class WrapperStore(Store, Generic[S]):
    """A :class:`~deltasync.storage.Store` that passes everything through to ``inner``.

    ``url`` and ``supports_conditional_put`` are the inner store's. Subclasses call
    ``super().__init__(inner)`` and override the methods they observe.
    """

    def __init__(self, inner: S) -> None:
        self.inner = inner
        self.url = inner.url
        # the capability flag is a class constant of the inner store's type: copied once
        self.supports_conditional_put = inner.supports_conditional_put  # type: ignore[misc]

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        self.inner.put_many(items, mode=mode)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        return self.inner.get_many(keys)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        return self.inner.list(prefix)

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        self.inner.delete_many(keys)

    def list_after(self, prefix: str, start_after: str | None) -> builtins.list[ObjectInfo]:
        # docstring inherited
        return self.inner.list_after(prefix, start_after)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        return self.inner.get_range(key, start, end)

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        """The inner store's bounded read; through this wrapper's ``get_many`` (then checked) when a
        subclass overrides ``get_many`` (to observe or fail reads), so that it sees these reads too."""
        if type(self).get_many is not WrapperStore.get_many:
            return super().get_many_bounded(limits)
        return self.inner.get_many_bounded(limits)

    def close(self) -> None:
        # docstring inherited
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
