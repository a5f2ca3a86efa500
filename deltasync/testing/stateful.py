"""The Hypothesis state machine of the store conformance suite: a store checked step by step
against a plain ``dict`` model (run by :meth:`deltasync.testing.store.StoreTests.test_state_machine`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from deltasync.errors import AlreadyExists, ObjectNotFound
from deltasync.storage.base import ObjectInfo, Store
from deltasync.testing import strategies as sts

__all__ = ["StoreStateMachine", "checked_listing"]


def checked_listing(store: Store, prefix: str = "") -> dict[str, int]:
    """``store.list(prefix)`` as ``{key: size}``, after checking it is sorted, without repeats, of ObjectInfo."""
    infos = store.list(prefix)
    assert all(isinstance(o, ObjectInfo) for o in infos)
    keys = [o.key for o in infos]
    assert keys == sorted(keys), f"list({prefix!r}) is not sorted by key: {keys}"
    assert len(set(keys)) == len(keys), f"list({prefix!r}) repeats keys: {keys}"
    return {o.key: o.size for o in infos}


class StoreStateMachine(RuleBasedStateMachine):
    """A store checked step by step against a plain ``dict`` model."""

    def __init__(
        self,
        store: Store,
        raw_get: Callable[[Any, str], bytes | None],
        raw_put: Callable[[Any, str, bytes], None],
    ) -> None:
        super().__init__()
        self.store = store
        self.raw_get = raw_get
        self.raw_put = raw_put
        self.model: dict[str, bytes] = {}

    def teardown(self) -> None:
        self.store.close()

    @rule(key=sts.keys, data=sts.data)
    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)
        self.model[key] = data

    @rule(items=st.dictionaries(sts.keys, sts.data, max_size=4))
    def put_many(self, items: dict[str, bytes]) -> None:
        self.store.put_many({k: bytearray(v) for k, v in items.items()})
        self.model.update(items)

    @rule(key=sts.keys, data=sts.data)
    def create(self, key: str, data: bytes) -> None:
        if key in self.model:
            with pytest.raises(AlreadyExists):
                self.store.put(key, data, mode="create")
        else:
            self.store.put(key, memoryview(data), mode="create")
            self.model[key] = data

    @rule(keys=st.lists(sts.keys, max_size=4))
    def delete_many(self, keys: list[str]) -> None:
        self.store.delete_many(keys)
        for key in keys:
            self.model.pop(key, None)

    @rule(key=sts.keys, data=sts.data)
    def raw_write(self, key: str, data: bytes) -> None:
        self.raw_put(self.store, key, data)
        self.model[key] = data

    @rule(key=sts.keys)
    def get(self, key: str) -> None:
        if key in self.model:
            assert self.store.get(key) == self.model[key]
        else:
            with pytest.raises(ObjectNotFound):
                self.store.get(key)

    @rule(keys=st.lists(sts.keys, max_size=5, unique=True))
    def get_many(self, keys: list[str]) -> None:
        if all(k in self.model for k in keys):
            assert self.store.get_many(keys) == {k: self.model[k] for k in keys}
        else:
            with pytest.raises(ObjectNotFound):
                self.store.get_many(keys)

    @rule(key=sts.keys, start=st.integers(0, 70), length=st.integers(0, 70))
    def get_range(self, key: str, start: int, length: int) -> None:
        if key in self.model:
            assert self.store.get_range(key, start, start + length) == self.model[key][start : start + length]
        else:
            with pytest.raises(ObjectNotFound):
                self.store.get_range(key, start, start + length)

    @rule(key=sts.keys)
    def exists(self, key: str) -> None:
        assert self.store.exists(key) == (key in self.model)

    @rule(key=sts.keys)
    def raw_read(self, key: str) -> None:
        assert self.raw_get(self.store, key) == self.model.get(key)

    @rule(prefix=sts.prefixes)
    def list_prefix(self, prefix: str) -> None:
        expected = {k: len(v) for k, v in sorted(self.model.items()) if k.startswith(prefix)}
        assert checked_listing(self.store, prefix) == expected

    @invariant()
    def listing_matches_model(self) -> None:
        assert checked_listing(self.store) == {k: len(v) for k, v in self.model.items()}
