"""The exception tree: pickling, builtin parents, and the tree drawn in the module docstring."""

from __future__ import annotations

import builtins
import copy
import inspect
import pickle
import re

import pytest

import deltasync.errors as errors
from deltasync.errors import DeltaSyncError

ALL_CLASSES: list[type[DeltaSyncError]] = [getattr(errors, name) for name in errors.__all__]

#: Each class and the builtin exceptions it must also be.
BUILTIN_PARENTS: dict[str, tuple[type[BaseException], ...]] = {
    "DeltaSyncError": (Exception,),
    "StorageError": (Exception,),
    "ObjectNotFound": (FileNotFoundError, OSError),
    "RunNotFound": (FileNotFoundError, OSError),
    "AlreadyExists": (FileExistsError, OSError),
    "PreconditionFailed": (Exception,),
    "TransientStorageError": (Exception,),
    "InvalidKey": (ValueError,),
    "ProtocolError": (ValueError,),
    "UnsupportedVersion": (ValueError,),
    "ObjectTooLarge": (ValueError,),
    "ChecksumMismatch": (Exception,),
    "SignatureMismatch": (Exception,),
    "InventoryMismatch": (ValueError,),
    "AdapterMismatch": (ValueError,),
    "UnsupportedAdapter": (ValueError,),
    "AllocationFailed": (MemoryError,),
    "ChainBroken": (Exception,),
    "CommitFailed": (Exception,),
    "WriterFenced": (Exception,),
    "SignalError": (Exception,),
    "SignalUnavailable": (Exception,),
    "SignalRejected": (Exception,),
    "SignalConflict": (Exception,),
    "WebhookVerificationError": (ValueError,),
    "DemoError": (ValueError,),
    "UpdateRolledBack": (Exception,),
    "WorkerNeedsReplacement": (Exception,),
    "EngineIncompatible": (Exception,),
    "UnsafePath": (Exception,),
    "ServerError": (Exception,),
    "ServerUnreachable": (Exception,),
    "MalformedAnswer": (ValueError,),
    "PrefixCacheNotReset": (Exception,),
    "StalenessTimeout": (TimeoutError, OSError),
}

#: Each class and its deltasync parent.
TREE_PARENTS: dict[str, str | None] = {
    "DeltaSyncError": None,
    "StorageError": "DeltaSyncError",
    "ObjectNotFound": "StorageError",
    "RunNotFound": "ObjectNotFound",
    "AlreadyExists": "StorageError",
    "PreconditionFailed": "StorageError",
    "TransientStorageError": "StorageError",
    "InvalidKey": "StorageError",
    "ProtocolError": "DeltaSyncError",
    "UnsupportedVersion": "ProtocolError",
    "ObjectTooLarge": "ProtocolError",
    "ChecksumMismatch": "DeltaSyncError",
    "SignatureMismatch": "ChecksumMismatch",
    "InventoryMismatch": "DeltaSyncError",
    "AdapterMismatch": "InventoryMismatch",
    "UnsupportedAdapter": "DeltaSyncError",
    "AllocationFailed": "DeltaSyncError",
    "ChainBroken": "DeltaSyncError",
    "CommitFailed": "DeltaSyncError",
    "WriterFenced": "CommitFailed",
    "SignalError": "DeltaSyncError",
    "SignalUnavailable": "SignalError",
    "SignalRejected": "SignalError",
    "SignalConflict": "SignalRejected",
    "WebhookVerificationError": "SignalError",
    "DemoError": "DeltaSyncError",
    "UpdateRolledBack": "DeltaSyncError",
    "WorkerNeedsReplacement": "DeltaSyncError",
    "EngineIncompatible": "DeltaSyncError",
    "UnsafePath": "DeltaSyncError",
    "ServerError": "DeltaSyncError",
    "ServerUnreachable": "ServerError",
    "MalformedAnswer": "ServerError",
    "PrefixCacheNotReset": "ServerError",
    "StalenessTimeout": "DeltaSyncError",
}

ids = [cls.__name__ for cls in ALL_CLASSES]


def test_all_is_sorted_and_complete() -> None:
    assert errors.__all__ == sorted(errors.__all__)
    public = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and not name.startswith("_")
    }
    assert public == set(errors.__all__)
    assert set(errors.__all__) == set(BUILTIN_PARENTS) == set(TREE_PARENTS)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=ids)
@pytest.mark.parametrize(
    "message", ["steps/000000000007/manifest.json: no object", "", "ünïcode ✓ 'quoted' \n two lines"]
)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_to_same_type_and_message(cls: type[DeltaSyncError], message: str, protocol: int) -> None:
    exc = cls(message)
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(back) is cls
    assert str(back) == message == str(exc)
    assert back.message == message
    assert back.args == exc.args


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=ids)
def test_pickles_after_being_raised(cls: type[DeltaSyncError]) -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise cls("outer message") from inner
    except DeltaSyncError as exc:
        back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == "outer message"
    assert repr(back).startswith(cls.__name__)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=ids)
def test_copies(cls: type[DeltaSyncError]) -> None:
    exc = cls("copied")
    for dup in (copy.copy(exc), copy.deepcopy(exc)):
        assert type(dup) is cls
        assert str(dup) == "copied"


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=ids)
def test_parents(cls: type[DeltaSyncError]) -> None:
    assert issubclass(cls, DeltaSyncError)
    for builtin in BUILTIN_PARENTS[cls.__name__]:
        assert issubclass(cls, builtin), f"{cls.__name__} must also be a {builtin.__name__}"
    parent = TREE_PARENTS[cls.__name__]
    if parent is not None:
        assert getattr(errors, parent) in cls.__bases__
    exc = cls("caught by its builtin parent")
    with pytest.raises(BUILTIN_PARENTS[cls.__name__][0]):
        raise exc


def test_builtin_parents_catch_as_documented() -> None:
    with pytest.raises(FileNotFoundError):
        raise errors.ObjectNotFound("no object k")
    with pytest.raises(FileExistsError):
        raise errors.AlreadyExists("k exists")
    with pytest.raises(ValueError):
        raise errors.InvalidKey("bad key")
    with pytest.raises(ValueError):
        raise errors.UnsupportedVersion("format 99")
    with pytest.raises(errors.ProtocolError):
        raise errors.UnsupportedVersion("format 99")
    with pytest.raises(errors.ChecksumMismatch):
        raise errors.SignatureMismatch("bad hmac")
    with pytest.raises(errors.StorageError):
        raise errors.PreconditionFailed("etag changed")
    assert not issubclass(errors.ChecksumMismatch, ValueError)
    assert not issubclass(errors.PreconditionFailed, OSError)


def test_oserror_children_keep_their_message() -> None:
    exc = errors.ObjectNotFound("memory://x: no object k")
    assert str(exc) == "memory://x: no object k"
    assert exc.errno is None
    assert exc.message == "memory://x: no object k"


_TREE_LINE = re.compile(r"^(?P<indent>(?:[│ ]   )*)(?:[├└]── )?(?P<name>[A-Z][A-Za-z]+)\b(?P<rest>.*)$")


def _docstring_tree() -> list[tuple[int, str, str]]:
    """(depth, class name, rest of line) for every line of the tree in the module docstring."""
    doc = errors.__doc__
    assert doc is not None
    lines = inspect.cleandoc(doc).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "DeltaSyncError")
    out: list[tuple[int, str, str]] = []
    base_indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[start:]:
        if not line.strip():
            break
        m = _TREE_LINE.match(line[base_indent:])
        assert m, f"unparsable tree line: {line!r}"
        depth = 0 if line.strip() == "DeltaSyncError" else len(m["indent"]) // 4 + 1
        out.append((depth, m["name"], m["rest"]))
    return out


def test_docstring_tree_names_every_class() -> None:
    names = [name for _, name, _ in _docstring_tree()]
    assert sorted(names) == sorted(errors.__all__)
    assert len(names) == len(set(names))


def test_docstring_tree_matches_the_hierarchy() -> None:
    stack: list[str] = []
    for depth, name, rest in _docstring_tree():
        del stack[depth:]
        cls = getattr(errors, name)
        if stack:
            assert getattr(errors, stack[-1]) in cls.__bases__, f"the tree draws {name} under {stack[-1]}"
        stack.append(name)
        also = re.search(r"\(also (\w+)\)", rest)
        if also:
            builtin = getattr(builtins, also[1])
            assert issubclass(cls, builtin), f"the tree says {name} is also a {also[1]}"


# ------------------------------------------------------------------------------ codes on a wire


def _tree() -> list[type[errors.DeltaSyncError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.DeltaSyncError)]


def test_every_class_has_a_code_of_its_own() -> None:
    tree = _tree()
    assert all("code" in cls.__dict__ for cls in tree), [c.__name__ for c in tree if "code" not in c.__dict__]
    codes = [cls.code for cls in tree]
    assert len(set(codes)) == len(codes)
    assert all(c.replace("_", "").isalpha() and c.islower() for c in codes)


@pytest.mark.parametrize("cls", _tree(), ids=lambda c: c.__name__)
def test_an_error_crosses_a_wire_as_its_code_and_comes_back_as_its_class(cls: type[errors.DeltaSyncError]) -> None:
    sent = cls("step 4: it broke")
    back = errors.from_code(errors.error_code(sent), str(sent))
    assert type(back) is cls and str(back) == "step 4: it broke"


def test_unknown_codes_and_foreign_errors_are_plain_deltasync_errors() -> None:
    assert errors.error_code(RuntimeError("x")) == "deltasync_error"
    back = errors.from_code("a_code_from_a_newer_peer", "what happened")
    assert type(back) is errors.DeltaSyncError and str(back) == "what happened"
    assert type(errors.from_code(None, "m")) is errors.DeltaSyncError
