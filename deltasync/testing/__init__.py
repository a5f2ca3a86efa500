"""Test helpers that ship with deltasync, for backends and for users' own stores.

:mod:`deltasync.testing.store` holds :class:`~deltasync.testing.store.StoreTests`,
the one conformance suite every :class:`~deltasync.storage.Store` backend runs.
It imports pytest and Hypothesis, so it is imported explicitly, only from tests;
this package itself imports nothing, and ``import deltasync`` never needs them.
"""

from __future__ import annotations

__all__: list[str] = []
