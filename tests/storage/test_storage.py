"""Stores: every backend runs the conformance suite, plus open_store and LocalStore specifics."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import deltasync.storage._local as local_mod
from deltasync.errors import AlreadyExists, InvalidKey, ObjectNotFound, StorageError
from deltasync.storage import LocalStore, MemoryStore, Store, open_store
from deltasync.storage._local import TMP_DIR
from deltasync.testing.store import StoreTests

# -- the conformance suite, once per backend ---------------------------------------


class TestLocalStore(StoreTests[LocalStore]):
    def make_store(self, path: Path) -> LocalStore:
        return LocalStore(path)

    def raw_get(self, store: LocalStore, key: str) -> bytes | None:
        path = store.root.joinpath(*key.split("/"))
        return path.read_bytes() if path.is_file() else None

    def raw_put(self, store: LocalStore, key: str, data: bytes) -> None:
        path = store.root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestMemoryStore(StoreTests[MemoryStore]):
    def make_store(self, path: Path) -> MemoryStore:
        return MemoryStore(path.name)

    def raw_get(self, store: MemoryStore, key: str) -> bytes | None:
        return store._objects.get(key)

    def raw_put(self, store: MemoryStore, key: str, data: bytes) -> None:
        store._objects[key] = bytes(data)


# -- open_store -------------------------------------------------------------------


def test_open_store_plain_path(tmp_path: Path) -> None:
    root = tmp_path / "run-1" / "nested"
    with open_store(str(root)) as store:
        assert isinstance(store, LocalStore)
        assert store.root == root
        assert not root.exists()  # created by the first write, not by opening
        store.put("k", b"v")
    assert (root / "k").read_bytes() == b"v"
    with open_store(root) as again:  # os.PathLike
        assert isinstance(again, LocalStore)
        assert again.get("k") == b"v"


def test_open_store_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("rel/run")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "rel" / "run"
    assert store.root.is_absolute()


@pytest.mark.parametrize("name", ["plain", "with space", "per%20cent", "ünï", "a:b", "q?x#y"])
def test_open_store_file_url_roundtrips(tmp_path: Path, name: str) -> None:
    root = tmp_path / name
    store = open_store(root.as_uri())
    assert isinstance(store, LocalStore)
    assert store.root == root
    store.put("a/b", b"payload")
    again = open_store(store.url)
    assert isinstance(again, LocalStore)
    assert again.root == root
    assert again.get("a/b") == b"payload"


def test_open_store_file_url_localhost(tmp_path: Path) -> None:
    store = open_store(f"file://localhost{tmp_path.as_posix()}/x")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "x"


def test_open_store_file_url_with_remote_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="local path"):
        open_store("file://otherhost/data/run")


def test_open_store_memory() -> None:
    a = open_store("memory://run-1")
    b = open_store("memory://run-1")
    assert isinstance(a, MemoryStore)
    assert isinstance(b, MemoryStore)
    assert a.url == "memory://run-1"
    a.put("k", b"v")
    assert not b.exists("k"), "memory:// stores are not shared between open_store calls"
    bare = open_store("memory://")
    assert isinstance(bare, MemoryStore)
    assert bare.url == "memory://"


@pytest.mark.parametrize("url", ["ftp://host/run", "gopher://x/y", "gs://bucket/prefix", "http://example.com/r"])
def test_open_store_unsupported_scheme(url: str) -> None:
    scheme = url.split("://")[0]
    with pytest.raises(StorageError, match="unsupported store scheme") as info:
        open_store(url)
    message = str(info.value)
    assert repr(scheme) in message
    assert url in message
    assert "file://" in message and "memory://" in message  # says what is supported


@pytest.mark.parametrize(
    ("url", "meant"),
    [
        ("s3:/mybucket/r1", "s3://mybucket/r1"),
        ("s3:mybucket/r1", "s3://mybucket/r1"),
        ("hf:/buckets/ns/b/r1", "hf://buckets/ns/b/r1"),
        ("hf:buckets/ns/b", "hf://buckets/ns/b"),
        ("HF:/buckets/ns/b", "hf://buckets/ns/b"),
        ("memory:x", "memory://x"),
        ("file:/abs/run", "file:///abs/run"),
        ("S3:/b", "s3://b"),
    ],
)
def test_open_store_refuses_a_malformed_scheme_and_creates_nothing(
    url: str, meant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # these used to open a local folder named after the scheme (./s3:/mybucket/r1), written by the first push
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match="malformed store URL") as info:
        open_store(url)
    assert str(info.value).startswith(f"{url}: ") and f"did you mean {meant}?" in str(info.value)
    assert "s3://<bucket>" in str(info.value) and "./x:y" in str(info.value)  # the supported forms
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["x:y", "runs:r1/a", "c:run", "2024:01", "runs/r1://x", "://x", " s3://b"])
def test_open_store_refuses_other_url_like_strings(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match="this build supports") as info:
        open_store(url)
    assert str(info.value).startswith(f"{url}: ") and "./x:y for a name with a colon" in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("S3://bucket/r1", "s3://bucket/r1"),
        ("Hf://buckets/ns/b/r1", "hf://buckets/ns/b/r1"),
        ("MEMORY://m", "memory://m"),
    ],
)
def test_open_store_scheme_is_case_insensitive(url: str, canonical: str) -> None:
    # RFC 3986: schemes are case-insensitive; the store's URL is written in lower case
    with open_store(url) as store:
        assert store.url == canonical


def test_open_store_file_scheme_is_case_insensitive(tmp_path: Path) -> None:
    with open_store("FILE://" + (tmp_path / "r").as_posix()) as store:
        assert isinstance(store, LocalStore) and store.root == tmp_path / "r"


def test_open_store_paths_with_a_colon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a colon after the first "/" is a plain path; before it, ./ makes it one; a Path is always one
    monkeypatch.chdir(tmp_path)
    for url, root in [
        ("./x:y", tmp_path / "x:y"),
        ("runs/r1:a", tmp_path / "runs" / "r1:a"),
        (str(tmp_path / "a:b"), tmp_path / "a:b"),
        (Path("s3:") / "b", tmp_path / "s3:" / "b"),
    ]:
        with open_store(url) as store:
            assert isinstance(store, LocalStore) and store.root == root, url
    assert os.listdir(tmp_path) == []  # opening creates nothing


def test_open_store_file_url_with_query_or_fragment_is_refused() -> None:
    for url in ("file:///data/run?x=1", "file:///data/run#frag"):
        with pytest.raises(StorageError, match="local path"):
            open_store(url)


@pytest.mark.parametrize("url", ["", None, 42])
def test_open_store_rejects_non_urls(url: Any) -> None:
    with pytest.raises(StorageError, match="non-empty string"):
        open_store(url)


# -- LocalStore specifics ------------------------------------------------------------


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalStore]:
    store = LocalStore(tmp_path / "store")
    with store:
        yield store


def _tmp_files(store: LocalStore) -> list[Path]:
    return sorted((store.root / TMP_DIR).iterdir())


def test_local_temp_files_are_hidden_and_cleaned_up(local: LocalStore) -> None:
    local.put("a", b"1")
    local.put("a", b"2")
    local.put("b/c", b"3", mode="create")
    with pytest.raises(AlreadyExists):
        local.put("b/c", b"4", mode="create")
    assert _tmp_files(local) == []
    assert (local.root / TMP_DIR).is_dir()
    assert [o.key for o in local.list()] == ["a", "b/c"]


def test_local_stray_temp_files_are_invisible(local: LocalStore) -> None:
    """A temp file left by a crashed writer is neither listed nor reachable as a key."""
    local.put("k", b"v")
    stray = local.root / TMP_DIR / "0123abcd"
    stray.write_bytes(b"half a file")
    assert [o.key for o in local.list()] == ["k"]
    for prefix in (".", TMP_DIR, f"{TMP_DIR}/", f"{TMP_DIR}/0123"):
        assert local.list(prefix) == [], prefix
    key = f"{TMP_DIR}/0123abcd"
    for call in (
        lambda: local.get(key),
        lambda: local.get_range(key, 0, 4),
        lambda: local.exists(key),
        lambda: local.put(key, b"x"),
        lambda: local.delete_many([key]),
    ):
        with pytest.raises(InvalidKey, match="reserved"):
            call()
    assert stray.read_bytes() == b"half a file"


def test_local_write_is_atomic(local: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the moment an object appears, its bytes are complete; until then readers see the old state."""
    local.put("HEAD.json", b"old head")
    new = os.urandom(1 << 20)
    seen: list[str] = []
    real_replace, real_link = os.replace, os.link

    def check(src: Any, dst: Any) -> None:
        src, dst = Path(src), Path(dst)
        assert src.parent == local.root / TMP_DIR, "writes must go through the temp directory"
        assert src.read_bytes() == new, "the temp file is complete before it is renamed into place"
        assert [o.key for o in local.list()] == ["HEAD.json"], "the temp file is not listed"
        assert local.get("HEAD.json") == b"old head", "readers still see the old object"

    def spy_replace(src: Any, dst: Any) -> None:
        check(src, dst)
        seen.append("replace")
        real_replace(src, dst)

    def spy_link(src: Any, dst: Any) -> None:
        check(src, dst)
        assert not Path(dst).exists()
        seen.append("link")
        real_link(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(os, "link", spy_link)
    local.put("HEAD.json", new)
    assert local.get("HEAD.json") == new
    monkeypatch.setattr(os, "replace", real_replace)
    local.put("HEAD.json", b"old head")
    monkeypatch.setattr(os, "replace", spy_replace)
    local.put("steps/000000000001/manifest.json", new, mode="create")
    assert seen == ["replace", "link"]
    assert local.get("HEAD.json") == b"old head"
    assert local.get("steps/000000000001/manifest.json") == new
    assert _tmp_files(local) == []


class _HalfWriter:
    """A binary file whose write() writes half of the data, then fails as a full disk would."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def __enter__(self) -> _HalfWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def write(self, data: Any) -> int:
        raw = bytes(data)
        self._f.write(raw[: len(raw) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _inject_failure(monkeypatch: pytest.MonkeyPatch, fail_at: str, mode: str) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    if fail_at == "fsync":
        monkeypatch.setattr(os, "fsync", boom)
    elif fail_at == "rename":
        monkeypatch.setattr(os, "link" if mode == "create" else "replace", boom)
    else:  # a write that dies half way, leaving a partial temp file
        real_open = open

        def half_open(file: Any, fmode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(file, fmode, *args, **kwargs)
            return _HalfWriter(f) if "w" in fmode else f

        def half_copyfile(src: Any, dst: Any, **kwargs: Any) -> None:
            with half_open(dst, "wb") as out:
                out.write(Path(src).read_bytes())

        monkeypatch.setattr(local_mod, "open", half_open, raising=False)
        monkeypatch.setattr(shutil, "copyfile", half_copyfile)


@pytest.mark.parametrize("kind", ["bytes", "path"])
@pytest.mark.parametrize("mode", ["overwrite", "create"])
@pytest.mark.parametrize("fail_at", ["write", "fsync", "rename"])
def test_local_write_failure_leaves_no_object(
    local: LocalStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fail_at: str, mode: str, kind: str
) -> None:
    local.put("existing", b"old content")
    src = tmp_path / "src.bin"
    src.write_bytes(b"new content")
    payload: Any = src if kind == "path" else b"new content"
    _inject_failure(monkeypatch, fail_at, mode)
    with pytest.raises(StorageError, match="injected") as info:
        local.put("fresh/key", payload, mode=mode)  # type: ignore[arg-type]
    assert not isinstance(info.value, (ObjectNotFound, AlreadyExists))
    assert isinstance(info.value.__cause__, OSError)
    if mode == "overwrite":
        with pytest.raises(StorageError, match="injected"):
            local.put("existing", payload)
    monkeypatch.undo()
    assert not local.exists("fresh/key")
    assert local.get("existing") == b"old content"
    assert [o.key for o in local.list()] == ["existing"]
    assert _tmp_files(local) == [], "a failed write must not leave its temp file behind"


def test_local_create_onto_directory_is_not_already_exists(local: LocalStore) -> None:
    """``a`` is no object when only ``a/b`` exists; a create there fails, but not as AlreadyExists."""
    local.put("a/b", b"x")
    assert not local.exists("a")
    for mode in ("create", "overwrite"):
        with pytest.raises(StorageError, match="directory") as info:
            local.put("a", b"y", mode=mode)
        assert not isinstance(info.value, AlreadyExists)
    assert [o.key for o in local.list()] == ["a/b"]
    assert _tmp_files(local) == []


def test_local_key_under_an_object_is_a_storage_error(local: LocalStore) -> None:
    local.put("a", b"file")
    with pytest.raises(StorageError):
        local.put("a/b", b"x")
    assert local.get("a") == b"file"
    assert [o.key for o in local.list()] == ["a"]
    assert _tmp_files(local) == []


def test_local_store_creates_nothing_until_its_first_write(tmp_path: Path) -> None:
    """Reading a missing (mistyped) root is an empty store and leaves no directory behind."""
    root = tmp_path / "runs" / "typo"
    store = open_store(str(root))
    assert store.list() == [] and store.list("steps/") == []
    assert not store.exists("HEAD.json")
    with pytest.raises(ObjectNotFound):
        store.get("HEAD.json")
    with pytest.raises(ObjectNotFound):
        store.get_range("HEAD.json", 0, 4)
    store.delete_many(["HEAD.json"])
    with pytest.raises(InvalidKey):
        store.put_many({"ok": b"1", "../escape": b"2"})  # an invalid batch creates nothing either
    store.close()
    assert not (tmp_path / "runs").exists()
    store.put("steps/k", b"v")  # the first write makes the root and the temp dir
    assert (root / TMP_DIR).is_dir() and store.get("steps/k") == b"v"
    shutil.rmtree(root)  # removed behind the store's back: the next write makes it again
    store.put("k", b"v")
    assert [o.key for o in store.list()] == ["k"]


def test_local_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create store directory"):
        LocalStore(tmp_path / "afile")
    with pytest.raises(StorageError):
        open_store(str(tmp_path / "afile" / "below"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_local_read_only_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ro")
    store.put("k", b"v")
    os.chmod(store.root, 0o555)
    try:
        with pytest.raises(StorageError, match="cannot write"):
            store.put("new", b"x")
        with pytest.raises(StorageError, match="cannot write"):
            store.put("sub/new", b"x")
        with pytest.raises(StorageError, match="cannot delete"):
            store.delete_many(["k"])
        assert store.get("k") == b"v"
    finally:
        os.chmod(store.root, 0o755)
    assert [o.key for o in store.list()] == ["k"]


def test_local_read_error_is_a_storage_error(local: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    local.put("k", b"v")
    real_open = os.open

    def boom(path: Any, *args: Any, **kwargs: Any) -> int:
        if Path(path) == local.root / "k":
            raise PermissionError(errno.EACCES, "Permission denied (injected)")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", boom)
    with pytest.raises(StorageError, match="Permission denied") as info:
        local.get("k")
    assert not isinstance(info.value, ObjectNotFound)
    assert isinstance(info.value.__cause__, PermissionError)


def test_local_list_error_is_a_storage_error(local: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable directory must fail the listing, not silently shorten it."""
    local.put("steps/000000000001/manifest.json", b"{}")
    local.put("steps/000000000002/manifest.json", b"{}")
    real_scandir = os.scandir
    bad = local.root / "steps" / "000000000002"

    def scandir(path: Any = ".") -> Any:
        if Path(path) == bad:
            raise PermissionError(errno.EACCES, "Permission denied (injected)", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(StorageError, match="cannot list"):
        local.list("steps/")
    monkeypatch.undo()
    assert len(local.list("steps/")) == 2


def test_local_delete_error_is_a_storage_error(local: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    local.put("k", b"v")

    def boom(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(errno.EACCES, "Permission denied (injected)")

    monkeypatch.setattr(Path, "unlink", boom)
    with pytest.raises(StorageError, match="cannot delete"):
        local.delete_many(["k"])


def test_local_without_fsync(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "nofsync", fsync=False)
    store.put("a", b"1")
    store.put("b", memoryview(b"22"), mode="create")
    src = tmp_path / "src"
    src.write_bytes(b"333")
    store.put("c", src)
    assert store.get_many(["a", "b", "c"]) == {"a": b"1", "b": b"22", "c": b"333"}


def test_local_create_race_between_store_instances(tmp_path: Path) -> None:
    """Two processes opening the same directory race through the file system, not a lock."""
    n = 16
    stores = [LocalStore(tmp_path / "shared") for _ in range(n)]
    barrier = threading.Barrier(n)

    def attempt(i: int) -> bool:
        barrier.wait(timeout=60)
        try:
            stores[i].put("HEAD.json", f"{i}".encode(), mode="create")
        except AlreadyExists:
            return False
        return True

    with ThreadPoolExecutor(max_workers=n) as pool:
        won = list(pool.map(attempt, range(n)))
    assert won.count(True) == 1
    assert stores[0].get("HEAD.json") == str(won.index(True)).encode()


def test_local_sees_objects_written_by_another_instance(tmp_path: Path) -> None:
    a = LocalStore(tmp_path / "s")
    b = LocalStore(tmp_path / "s")
    a.put("steps/000000000001/manifest.json", b"{}")
    assert b.exists("steps/000000000001/manifest.json")
    assert b.list("steps/") == a.list("steps/")


# -- MemoryStore specifics -----------------------------------------------------------


def test_memory_stores_are_independent() -> None:
    a, b = MemoryStore("x"), MemoryStore("x")
    a.put("k", b"v")
    assert not b.exists("k")
    assert b.list() == []


def test_stores_are_stores(tmp_path: Path) -> None:
    assert isinstance(LocalStore(tmp_path / "s"), Store)
    assert isinstance(MemoryStore(), Store)
    assert LocalStore.supports_conditional_put
    assert MemoryStore.supports_conditional_put
