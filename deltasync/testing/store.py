"""The one conformance suite that every :class:`~deltasync.storage.Store` backend runs.

Subclass :class:`StoreTests` in a ``tests/test_*.py`` module (the name must start
with ``Test`` for pytest to collect it) and implement three hooks::

    from deltasync.testing.store import StoreTests

    class TestMyStore(StoreTests[MyStore]):
        def make_store(self, path: Path) -> MyStore:
            return MyStore(path)              # a new, empty store

        def raw_get(self, store: MyStore, key: str) -> bytes | None:
            ...                               # read behind the store's back; None if absent

        def raw_put(self, store: MyStore, key: str, data: bytes) -> None:
            ...                               # write behind the store's back

``make_store(path)``
    Return a new, empty store. ``path`` is a fresh directory name under pytest's
    ``tmp_path`` that does not exist yet; a backend may use it as its root, or as a
    unique bucket prefix, or ignore it. The suite's ``store`` fixture calls it once
    per test and closes the store afterwards. It is a factory method rather than
    a ``store_kwargs`` fixture because the Hypothesis state machine needs a fresh
    store for every example, and a function-scoped fixture gives one per test.

``raw_get(store, key)`` / ``raw_put(store, key, data)``
    Bypass hooks: read or write the object under ``key`` the way the backend
    really stores it (a file under the root, the dict of a memory store, a raw
    S3 request), so that tests check what is really stored, not only what the
    store says. ``raw_get`` returns ``None`` when no object is there.

Optional knobs: ``big_object_size`` (bytes of the multi-MB round trip) and
``state_machine_settings`` (Hypothesis settings of the state machine test).

What the suite pins down, beyond the docstrings of :class:`~deltasync.storage.Store`:

* payloads may be ``bytes``, ``bytearray``, ``memoryview`` (any C-contiguous
  buffer: its raw bytes are stored) or a :class:`~pathlib.Path` to a file; the
  store copies the payload, so changing it after ``put`` changes nothing;
* a missing key raises :class:`~deltasync.errors.ObjectNotFound` (also a
  ``FileNotFoundError``) from ``get``, ``get_many`` and ``get_range``; a missing
  ``Path`` payload is a :class:`~deltasync.errors.StorageError` but *not* an
  ``ObjectNotFound``;
* every key-taking method raises :class:`~deltasync.errors.InvalidKey` (also a
  ``ValueError``) for a malformed key before it touches anything; ``list`` takes
  a plain-text prefix, not a key, so any prefix is allowed and simply matches
  nothing outside the store;
* ``list`` shows objects only: no temp files, no directories, sorted by key;
* ``get_bounded`` / ``get_many_bounded`` return objects of at most their limit and
  raise :class:`~deltasync.errors.ObjectTooLarge` (a ``ProtocolError``) naming the key,
  its size and the limit for one over it, whatever its size (a multi-MB object
  against a 1 KiB limit too);
* with ``supports_conditional_put``, ``mode="create"`` has exactly one winner
  among racing writers; every backend keeps each object whole under racing
  overwrites.

The suite never stores a key that is also a path prefix of another stored key
(``a`` next to ``a/b``): a directory-backed store cannot hold both, and the
protocol never needs them.
"""

from __future__ import annotations

import itertools
import random
import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from deltasync.errors import (
    AlreadyExists,
    DeltaSyncError,
    InvalidKey,
    ObjectNotFound,
    ObjectTooLarge,
    ProtocolError,
    StorageError,
)
from deltasync.storage.base import ObjectInfo, Store
from deltasync.testing.stateful import StoreStateMachine, checked_listing
from deltasync.testing.strategies import INVALID_KEYS, PAYLOAD_KINDS, as_payload, random_bytes

__all__ = ["StoreStateMachine", "StoreTests"]

S = TypeVar("S", bound=Store)


class StoreTests(ABC, Generic[S]):
    """Conformance tests for a :class:`~deltasync.storage.Store` backend (see the module docstring)."""

    #: size of the multi-MB object of the round-trip tests
    big_object_size: ClassVar[int] = 3 * 1024 * 1024 + 7
    #: Hypothesis settings of :meth:`test_state_machine`
    state_machine_settings: ClassVar[settings] = settings(
        max_examples=100,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

    # -- hooks ------------------------------------------------------------

    @abstractmethod
    def make_store(self, path: Path) -> S:
        """A new, empty store; ``path`` is a fresh, not yet existing directory it may use."""

    @abstractmethod
    def raw_get(self, store: S, key: str) -> bytes | None:
        """The bytes really stored under ``key``, read behind the store's back; None if absent."""

    @abstractmethod
    def raw_put(self, store: S, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` behind the store's back."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[S]:
        """A new, empty store, closed after the test."""
        store = self.make_store(tmp_path / "store")
        try:
            yield store
        finally:
            store.close()

    # -- the bypass hooks themselves ----------------------------------------

    def test_raw_hooks_agree_with_store(self, store: S) -> None:
        assert self.raw_get(store, "steps/000000000001/raw.bin") is None
        self.raw_put(store, "steps/000000000001/raw.bin", b"written behind its back")
        assert store.get("steps/000000000001/raw.bin") == b"written behind its back"
        assert store.exists("steps/000000000001/raw.bin")
        assert checked_listing(store) == {"steps/000000000001/raw.bin": 23}
        store.put("HEAD.json", b"{}")
        assert self.raw_get(store, "HEAD.json") == b"{}"

    # -- put / get ----------------------------------------------------------

    @pytest.mark.parametrize("kind", PAYLOAD_KINDS)
    @pytest.mark.parametrize("size", [0, 1, 4099, -1], ids=["empty", "1B", "4KiB", "multi-MB"])
    def test_put_get_roundtrip(self, store: S, tmp_path: Path, kind: str, size: int) -> None:
        n = self.big_object_size if size < 0 else size
        content = random_bytes(n, seed=n)
        key = "steps/000000000007/model-00001-of-00002.safetensors"
        store.put(key, as_payload(kind, content, tmp_path))
        got = store.get(key)
        assert type(got) is bytes
        assert got == content
        assert self.raw_get(store, key) == content
        assert store.get_many([key]) == {key: content}
        assert checked_listing(store) == {key: n}
        assert store.exists(key)

    @pytest.mark.parametrize("kind", PAYLOAD_KINDS)
    def test_put_many_mixed_payloads(self, store: S, tmp_path: Path, kind: str) -> None:
        items = {f"steps/000000000001/f{i}.bin": random_bytes(i * 100, seed=i) for i in range(5)}
        store.put_many({k: as_payload(kind, v, tmp_path) for k, v in items.items()})
        assert store.get_many(list(items)) == items
        assert checked_listing(store) == {k: len(v) for k, v in items.items()}
        for k, v in items.items():
            assert self.raw_get(store, k) == v

    def test_memoryview_payloads_store_raw_bytes(self, store: S) -> None:
        ints = array("I", range(1000))
        store.put("typed", memoryview(ints))
        assert store.get("typed") == ints.tobytes()
        assert checked_listing(store) == {"typed": 4000}
        buf = bytearray(random_bytes(1000))
        store.put("sliced", memoryview(buf)[3:517])
        assert store.get("sliced") == bytes(buf[3:517])
        store.put("empty-view", memoryview(b"abc")[1:1])
        assert store.get("empty-view") == b""

    def test_put_copies_the_payload(self, store: S, tmp_path: Path) -> None:
        buf = bytearray(b"original")
        store.put("from-bytearray", buf)
        buf[:] = b"mutated!"
        src = tmp_path / "src.bin"
        src.write_bytes(b"original file")
        store.put("from-path", src)
        src.write_bytes(b"changed file, longer")
        assert store.get("from-bytearray") == b"original"
        assert store.get("from-path") == b"original file"

    def test_put_missing_path_payload_is_a_storage_error(self, store: S, tmp_path: Path) -> None:
        with pytest.raises(StorageError) as info:
            store.put("k", tmp_path / "no-such-file.bin")
        assert not isinstance(info.value, ObjectNotFound), "a missing source file is not a missing object"
        assert not store.exists("k")
        assert checked_listing(store) == {}

    def test_get_many_many_keys(self, store: S) -> None:
        items = {f"steps/{i % 7:012d}/shard-{i:04d}.bin": random_bytes(i % 50, seed=i) for i in range(300)}
        store.put_many(items)
        keys = list(items)
        random.Random(1).shuffle(keys)
        got = store.get_many(keys)
        assert got == items
        assert set(got) == set(keys)
        assert store.get_many([]) == {}
        assert store.get_many(keys[:1]) == {keys[0]: items[keys[0]]}

    # -- missing objects ----------------------------------------------------

    def test_missing_key_raises_object_not_found(self, store: S) -> None:
        store.put("present", b"x")
        calls: list[Callable[[], object]] = [
            lambda: store.get("steps/000000000001/manifest.json"),
            lambda: store.get_many(["present", "steps/000000000001/manifest.json"]),
            lambda: store.get_range("steps/000000000001/manifest.json", 0, 10),
        ]
        for call in calls:
            with pytest.raises(ObjectNotFound, match="manifest.json") as info:
                call()
            assert isinstance(info.value, FileNotFoundError)
            assert isinstance(info.value, StorageError)
            assert isinstance(info.value, DeltaSyncError)
            with pytest.raises(FileNotFoundError):
                call()
        assert not store.exists("steps/000000000001/manifest.json")

    def test_prefixes_and_extensions_of_keys_are_not_objects(self, store: S) -> None:
        store.put("steps/000000000001/manifest.json", b"{}")
        for key in ("steps", "steps/000000000001", "steps/000000000001/manifest.json/x", "steps/000000000001/m"):
            assert not store.exists(key), key
            with pytest.raises(ObjectNotFound):
                store.get(key)
            with pytest.raises(ObjectNotFound):
                store.get_range(key, 0, 1)
            store.delete_many([key])  # not an object: ignored
        assert store.get("steps/000000000001/manifest.json") == b"{}"

    # -- put modes ----------------------------------------------------------

    def test_create_on_existing_key_raises_and_keeps_old_content(self, store: S) -> None:
        store.put("HEAD.json", b"old", mode="create")
        with pytest.raises(AlreadyExists, match="HEAD.json") as info:
            store.put("HEAD.json", b"new content", mode="create")
        assert isinstance(info.value, FileExistsError)
        assert isinstance(info.value, StorageError)
        assert store.get("HEAD.json") == b"old"
        assert self.raw_get(store, "HEAD.json") == b"old"
        assert checked_listing(store) == {"HEAD.json": 3}

    def test_create_in_a_batch(self, store: S) -> None:
        store.put("steps/000000000002/b.bin", b"old")
        with pytest.raises(AlreadyExists):
            store.put_many({"steps/000000000002/a.bin": b"a", "steps/000000000002/b.bin": b"new"}, mode="create")
        assert store.get("steps/000000000002/b.bin") == b"old"
        store.put_many({"steps/000000000003/a.bin": b"a", "steps/000000000003/b.bin": b"b"}, mode="create")
        assert store.get_many(["steps/000000000003/a.bin", "steps/000000000003/b.bin"]) == {
            "steps/000000000003/a.bin": b"a",
            "steps/000000000003/b.bin": b"b",
        }

    def test_create_after_delete_succeeds(self, store: S) -> None:
        store.put("k", b"1", mode="create")
        store.delete_many(["k"])
        store.put("k", b"2", mode="create")
        assert store.get("k") == b"2"

    def test_overwrite(self, store: S) -> None:
        key = "HEAD.json"
        store.put(key, b"first version, rather long")
        store.put(key, b"second")
        assert store.get(key) == b"second"
        assert self.raw_get(store, key) == b"second"
        assert checked_listing(store) == {key: 6}
        store.put(key, b"third", mode="overwrite")
        assert store.get(key) == b"third"
        store.put_many({key: b""}, mode="overwrite")
        assert store.get(key) == b""
        assert checked_listing(store) == {key: 0}
        self.raw_put(store, key, b"behind its back")
        store.put(key, b"fourth")
        assert store.get(key) == b"fourth"

    # -- list -----------------------------------------------------------------

    def test_list_with_prefix(self, store: S) -> None:
        items = {
            "HEAD.json": b"{}",
            "steps/000000000001/manifest.json": b"m1",
            "steps/000000000001/patch.safetensors": b"p" * 17,
            "steps/000000000002/manifest.json": b"m22",
            "steps/000000000002/deep/er/file.bin": b"",
            "steps10/other": b"o",
            "stepsX": b"xx",
            "zz": b"z",
        }
        store.put_many(items)

        def keys_with(prefix: str) -> dict[str, int]:
            return {k: len(v) for k, v in items.items() if k.startswith(prefix)}

        for prefix in (
            "",
            "s",
            "steps",
            "steps/",
            "steps/0000",
            "steps/000000000001/",
            "steps/000000000001/manifest.json",
            "steps/000000000002/deep",
            "steps/000000000002/deep/er/",
            "steps1",
            "H",
            "nope",
            "nope/",
            "steps/000000000003/",
            "zz/",
        ):
            assert checked_listing(store, prefix) == keys_with(prefix), prefix
        assert [o.key for o in store.list()] == sorted(items)
        assert store.list() == store.list("")

    def test_list_after(self, store: S) -> None:
        """``list_after`` is ``list`` minus every key at or before ``start_after`` (readers list only what is new)."""
        items = {
            "steps/000000000001/manifest.json": b"m1",
            "steps/000000000001/patch.safetensors": b"p",
            "steps/000000000002/manifest.json": b"m2",
            "steps/000000000002/model.safetensors": b"a" * 5,
            "steps/000000000010/manifest.json": b"m10",
            "steps10/other": b"o",
            "writers/000000000001.json": b"w1",
            "writers/000000000002.json": b"w2",
        }
        store.put_many(items)
        for prefix, after in (
            ("steps/", None),
            ("steps/", "steps/000000000001/manifest.json"),
            ("steps/", "steps/000000000002"),
            ("steps/", "steps/000000000002/manifest.json"),
            ("steps/", "steps/000000000010/manifest.json"),
            ("steps/", "steps/9"),
            ("steps/", ""),
            ("writers/", "writers/000000000001.json"),
            ("writers/", "writers/000000000000.json"),
            ("writers/", "a"),
            ("writers/", "z"),
            ("nope/", "a"),
        ):
            want = {k: len(v) for k, v in items.items() if k.startswith(prefix) and (after is None or k > after)}
            got = store.list_after(prefix, after)
            assert {o.key: o.size for o in got} == want, (prefix, after)
            assert [o.key for o in got] == sorted(want), (prefix, after)

    def test_list_shows_only_objects(self, store: S, tmp_path: Path) -> None:
        store.put("a/b/c", b"1")
        store.put("a/b/d", as_payload("path", b"22", tmp_path))
        store.put("a/e", b"333", mode="create")
        with pytest.raises(AlreadyExists):
            store.put("a/e", b"4444", mode="create")
        store.put("f", b"55555")
        store.put("f", b"666666")
        store.put("g/h", b"x")
        store.delete_many(["g/h"])
        assert checked_listing(store) == {"a/b/c": 1, "a/b/d": 2, "a/e": 3, "f": 6}
        assert checked_listing(store, ".") == {}
        assert checked_listing(store, "g") == {}
        for key in checked_listing(store):
            store.get(key)

    def test_list_reports_when_objects_were_written(self, store: S) -> None:
        # gc ages orphan files by it (a day of slack for a store whose clock differs from ours)
        import time

        store.put("m/a", b"1")
        store.put("m/b", b"22")
        for o in store.list("m/"):
            assert o.mtime is not None and abs(o.mtime - time.time()) < 86400, o
        assert ObjectInfo("m/a", 1, 5.0) == ObjectInfo("m/a", 1)  # not part of equality

    def test_list_prefix_never_escapes(self, store: S) -> None:
        store.put("inside", b"x")
        for prefix in ("../", "..", "/", "/inside", "./inside", "a//", "\\"):
            assert checked_listing(store, prefix) == {}, prefix

    def test_list_empty_store(self, store: S) -> None:
        assert store.list() == []
        assert store.list("steps/") == []

    # -- delete -----------------------------------------------------------------

    def test_delete_many(self, store: S) -> None:
        store.put_many({"a/1": b"1", "a/2": b"2", "b/3": b"3", "c": b"4"})
        store.delete_many(["a/1", "missing", "a/nope/deeper", "c"])
        assert checked_listing(store) == {"a/2": 1, "b/3": 1}
        assert self.raw_get(store, "a/1") is None
        assert self.raw_get(store, "c") is None
        with pytest.raises(ObjectNotFound):
            store.get("a/1")
        store.delete_many([])
        store.delete_many(["a/1", "a/1"])
        assert checked_listing(store) == {"a/2": 1, "b/3": 1}
        store.delete_many(["a/2", "b/3"])
        assert store.list() == []

    # -- get_range / exists ---------------------------------------------------------

    def test_get_range(self, store: S) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        for start, end in [(0, 10), (10, 20), (0, 1024), (1000, 2000), (1023, 1024), (1024, 1030), (5, 5), (7, 3)]:
            got = store.get_range("r", start, end)
            assert type(got) is bytes
            assert got == data[start:end], (start, end)
        store.put("empty", b"")
        assert store.get_range("empty", 0, 10) == b""

    def test_exists(self, store: S) -> None:
        assert not store.exists("steps/000000000001/manifest.json")
        store.put("steps/000000000001/manifest.json", b"{}")
        assert store.exists("steps/000000000001/manifest.json")
        assert not store.exists("steps/000000000001")
        store.put("empty", b"")
        assert store.exists("empty")
        store.delete_many(["steps/000000000001/manifest.json"])
        assert not store.exists("steps/000000000001/manifest.json")

    # -- bounded reads ---------------------------------------------------------------

    def test_get_bounded_within_the_limit(self, store: S) -> None:
        store.put_many({"probes.json": b"x" * 100, "empty": b"", "HEAD.json": b"{}"})
        assert store.get_bounded("probes.json", 100) == b"x" * 100  # exactly the limit
        assert store.get_bounded("probes.json", 1 << 20) == b"x" * 100
        assert store.get_bounded("empty", 0) == b""
        got = store.get_many_bounded({"probes.json": 100, "empty": 0, "HEAD.json": 2})
        assert got == {"probes.json": b"x" * 100, "empty": b"", "HEAD.json": b"{}"}
        assert all(type(v) is bytes for v in got.values())
        assert store.get_many_bounded({}) == {}

    def test_get_bounded_refuses_an_object_over_its_limit(self, store: S) -> None:
        big = random_bytes(self.big_object_size, seed=11)
        store.put_many({"probes.json": b"x" * 101, "big.bin": big, "ok": b"fine"})
        for call in (
            lambda: store.get_bounded("probes.json", 100),
            lambda: store.get_many_bounded({"ok": 4, "probes.json": 100}),
        ):
            with pytest.raises(ObjectTooLarge) as info:
                call()
            assert isinstance(info.value, ProtocolError)
            assert "probes.json" in str(info.value) and "100" in str(info.value)
        with pytest.raises(ObjectTooLarge, match=rf"big\.bin.*{self.big_object_size} bytes.*1024"):
            store.get_bounded("big.bin", 1024)
        with pytest.raises(ObjectTooLarge):
            store.get_bounded("ok", 0)
        assert store.get_bounded("big.bin", self.big_object_size) == big
        assert store.get("probes.json") == b"x" * 101, "a refused read changes nothing"

    def test_get_bounded_of_a_missing_key_or_a_bad_limit(self, store: S) -> None:
        store.put("ok", b"fine")
        with pytest.raises(ObjectNotFound):
            store.get_bounded("steps/000000000001/manifest.json", 10)
        with pytest.raises(ObjectNotFound):
            store.get_many_bounded({"ok": 10, "missing": 10})
        for bad in (-1, True, 1.5):
            with pytest.raises(ValueError, match="read limit"):
                store.get_bounded("ok", bad)  # type: ignore[arg-type]

    # -- invalid keys ---------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=ascii)
    def test_invalid_key_rejected_everywhere(self, store: S, tmp_path: Path, key: Any) -> None:
        store.put("ok", b"fine")
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put(key, b"x"),
            "put(create)": lambda: store.put(key, b"x", mode="create"),
            "put_many": lambda: store.put_many({key: b"x"}),
            "put_many(create)": lambda: store.put_many({key: b"x"}, mode="create"),
            "get": lambda: store.get(key),
            "get_many": lambda: store.get_many(["ok", key]),
            "get_range": lambda: store.get_range(key, 0, 1),
            "get_bounded": lambda: store.get_bounded(key, 10),
            "get_many_bounded": lambda: store.get_many_bounded({"ok": 10, key: 10}),
            "exists": lambda: store.exists(key),
            "delete_many": lambda: store.delete_many([key]),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidKey) as info:
                call()
            assert isinstance(info.value, ValueError), name
            assert isinstance(info.value, StorageError), name
            assert str(info.value), name
        if isinstance(key, str) and key:
            assert checked_listing(store, key) == {}, "list() takes any prefix; this one matches nothing"
        assert checked_listing(store) == {"ok": 4}
        assert store.get("ok") == b"fine"
        assert not (tmp_path / "x").exists(), "a '../x' key escaped the store"

    # -- lifecycle ------------------------------------------------------------------

    def test_close_and_context_manager(self, store: S) -> None:
        calls: list[str] = []
        close = store.close

        def counting_close() -> None:
            calls.append("close")
            close()

        store.close = counting_close  # type: ignore[method-assign]
        with store as entered:
            assert entered is store
            entered.put("k", b"v")
            assert entered.get("k") == b"v"
        assert calls == ["close"]
        with pytest.raises(KeyError, match="boom"), store:
            raise KeyError("boom")  # exceptions propagate through __exit__
        assert calls == ["close", "close"]
        store.close = close  # type: ignore[method-assign]
        store.close()  # idempotent
        store.close()

    def test_url_and_repr(self, store: S) -> None:
        assert isinstance(store.url, str) and store.url
        assert store.url in repr(store)
        assert type(store).__name__ in repr(store)

    # -- concurrency ----------------------------------------------------------------

    def test_concurrent_create_has_exactly_one_winner(self, store: S) -> None:
        if not store.supports_conditional_put:
            pytest.skip(f"{type(store).__name__} does not support conditional puts")
        n = 16
        for round_ in range(5):
            key = f"steps/{round_:012d}/manifest.json"
            barrier = threading.Barrier(n)

            def attempt(i: int, key: str = key, barrier: threading.Barrier = barrier) -> bytes | None:
                payload = f"writer {i:02d};".encode() * (1000 + i)
                barrier.wait(timeout=60)
                try:
                    store.put(key, payload, mode="create")
                except AlreadyExists:
                    return None
                return payload

            with ThreadPoolExecutor(max_workers=n) as pool:
                results = list(pool.map(attempt, range(n)))
            winners = [r for r in results if r is not None]
            assert len(winners) == 1, f"round {round_}: {len(winners)} create-only writers won"
            assert store.get(key) == winners[0]
            assert self.raw_get(store, key) == winners[0]
        assert len(store.list()) == 5

    def test_concurrent_overwrites_keep_objects_whole(self, store: S) -> None:
        n = 16
        payloads = [bytes([i]) * (256 * 1024 + i) for i in range(n)]
        barrier = threading.Barrier(n)

        def attempt(i: int) -> None:
            barrier.wait(timeout=60)
            store.put("HEAD.json", payloads[i])

        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(attempt, range(n)))
        assert store.get("HEAD.json") in payloads
        assert checked_listing(store) == {"HEAD.json": len(store.get("HEAD.json"))}

    # -- state machine --------------------------------------------------------------

    def test_single_writer_per_run_prefix(self, store: S) -> None:
        """A second uploader on the same prefix fences the first off; fetchers follow the newer writer."""
        torch = pytest.importorskip("torch")
        from deltasync.errors import WriterFenced
        from deltasync.fetcher import DeltaFetcher
        from deltasync.uploader import DeltaUploader

        def state(seed: int) -> dict[str, Any]:
            g = torch.Generator().manual_seed(seed)
            return {"w": torch.randn(64, generator=g).to(torch.bfloat16), "b": torch.zeros(3)}

        first = DeltaUploader(store, anchor_every=100)
        try:
            assert first.push(state(0), 0).result(60).kind == "anchor"
            assert first.push(state(1), 1).result(60).kind == "patch"
            second = DeltaUploader(store, anchor_every=100)  # claims the run on its first push
            try:
                assert second.epoch == 0
                assert second.push(state(2), 2).result(60).kind == "anchor"  # takes over after step 1
                assert second.epoch == first.epoch + 1
                with pytest.raises(WriterFenced, match="took over"):
                    first.push(state(3), 3).result(60)  # its data files are written, its manifest is not
                with pytest.raises(WriterFenced):
                    first.push(state(4), 4)  # fenced for good: push refuses at once
                assert second.push(state(5), 3).result(60).kind == "patch"  # over first's leftovers
            finally:
                second.close()
        finally:
            first.close()
        target = state(0)
        fetcher = DeltaFetcher(store)
        assert fetcher.latest_step() == 3
        assert fetcher.sync(target) == 3
        assert torch.equal(target["w"], state(5)["w"])

    def test_state_machine(self, tmp_path: Path) -> None:
        paths = (tmp_path / f"example-{i}" for i in itertools.count())
        suite = self

        class Machine(StoreStateMachine):
            def __init__(self) -> None:  # a fresh store for every example
                super().__init__(suite.make_store(next(paths)), suite.raw_get, suite.raw_put)

        run_state_machine_as_test(Machine, settings=self.state_machine_settings)
