"""Hypothesis strategies and payloads the store conformance suite feeds a store.

Keys of the state machine: directory and leaf names are disjoint, so no stored key is ever a
path prefix of another (see :mod:`deltasync.testing.store`).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from deltasync.storage.base import Data

__all__ = ["ALL_KEYS", "INVALID_KEYS", "PAYLOAD_KINDS", "as_payload", "data", "keys", "prefixes", "random_bytes"]

#: Keys that every method must refuse with InvalidKey.
INVALID_KEYS: tuple[Any, ...] = (
    "",
    "../x",
    "a/../../x",
    "..",
    ".",
    "/abs",
    "/",
    "a//b",
    "a/./b",
    "a/",
    "a\\b",
    "..\\x",
    "a\x00b",
    "k" * 1025,
    None,
    b"bytes-key",
)

PAYLOAD_KINDS = ("bytes", "bytearray", "memoryview", "path")


def random_bytes(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return random.Random(seed).randbytes(n)


def as_payload(kind: str, content: bytes, tmp_path: Path) -> Data:
    """``content`` as a put payload of the given kind."""
    if kind == "bytes":
        return bytes(content)
    if kind == "bytearray":
        return bytearray(content)
    if kind == "memoryview":
        return memoryview(content)
    if kind == "path":
        path = tmp_path / f"payload-{len(list(tmp_path.glob('payload-*')))}.bin"
        path.write_bytes(content)
        return path
    raise AssertionError(f"unknown payload kind {kind!r}")


_DIRS = ("d0", "d1", "steps")
_LEAVES = ("f0", "f1", "manifest.json", "HEAD")
ALL_KEYS = [
    "/".join([*dirs, leaf])
    for dirs in [(), *itertools.product(_DIRS, repeat=1), *itertools.product(_DIRS, repeat=2)]
    for leaf in _LEAVES
]
#: any key of the state machine
keys = st.sampled_from(ALL_KEYS)
#: an object's content
data = st.binary(max_size=64)
#: a listing prefix: a cut key, or any short text
prefixes = st.one_of(
    st.tuples(keys, st.integers(0, 30)).map(lambda t: t[0][: t[1]]),
    st.text(alphabet="d01/stepf.", max_size=5),
)
