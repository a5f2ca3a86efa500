"""``deltasync.__all__`` is the public API: pinned here name by name (like httpx's test of the same name)."""

from __future__ import annotations

import deltasync

#: the public names, sorted; changing this list is changing the public API
EXPORTED = [
    "CommitInfo",
    "DeltaFetcher",
    "DeltaUploader",
    "HFBucketStore",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "RunReader",
    "Store",
    "UploaderConfig",
    "__version__",
    "errors",
    "open_store",
]


def test_all_is_the_pinned_public_api() -> None:
    assert sorted(deltasync.__all__) == EXPORTED
    assert len(set(deltasync.__all__)) == len(deltasync.__all__), "__all__ repeats a name"


def test_every_exported_name_resolves() -> None:
    for name in deltasync.__all__:
        assert getattr(deltasync, name) is not None, name


def test_exported_members_belong_to_deltasync() -> None:
    """Each exported class or function is deltasync's own (re-exported from a deltasync module)."""
    for name in deltasync.__all__:
        member = getattr(deltasync, name)
        if name == "__version__":
            assert isinstance(member, str) and member
        elif name == "errors":
            assert member.__name__ == "deltasync.errors"
        else:
            assert member.__module__.split(".")[0] == "deltasync", f"{name} comes from {member.__module__}"


def test_star_import_gives_exactly_the_exported_names() -> None:
    namespace: dict[str, object] = {}
    exec("from deltasync import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == EXPORTED
