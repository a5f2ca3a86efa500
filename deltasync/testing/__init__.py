"""Test helpers that ship with deltasync, for backends and for users' own stores.

* :mod:`deltasync.testing.store`: :class:`~deltasync.testing.store.StoreTests`, the one
  conformance suite every :class:`~deltasync.storage.Store` backend runs;
* :mod:`deltasync.testing.stateful`: its Hypothesis state machine (a store against a ``dict``);
* :mod:`deltasync.testing.strategies`: the keys, payloads and prefixes the suite feeds a store;
* :mod:`deltasync.testing.counting`: a store that counts round trips (a
  :class:`~deltasync.storage.WrapperStore`, the one base of every store that wraps another);
* :mod:`deltasync.testing.seaweedfs`: a local S3 server for tests.

The suite modules import pytest and Hypothesis, so they are imported explicitly, only from
tests; this package itself imports nothing, and ``import deltasync`` never needs them.
"""

from __future__ import annotations

__all__: list[str] = []
