"""Digests: xxh3-128 for files and tensors, HMAC-SHA256 for optional signatures."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

import numpy as np
import xxhash

__all__ = ["hmac_sign", "hmac_verify", "xxh3_128", "xxh3_128_array", "xxh3_128_chunks"]


def xxh3_128(data: bytes | bytearray | memoryview) -> str:
    """Lower-case hex xxh3-128 (32 characters) of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def xxh3_128_array(arr: np.ndarray[Any, Any]) -> str:
    """xxh3-128 of an array's raw bytes in C order (copies only if not contiguous)."""
    a = np.ascontiguousarray(arr).reshape(-1)
    return xxhash.xxh3_128_hexdigest(a.view(np.uint8).data) if a.size else xxhash.xxh3_128_hexdigest(b"")


def xxh3_128_chunks(chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    """xxh3-128 of the concatenation of ``chunks`` (streamed, no copy)."""
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def hmac_sign(key: bytes, payload: bytes) -> str:
    """Hex HMAC-SHA256 of ``payload``."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def hmac_verify(key: bytes, payload: bytes, signature: str) -> bool:
    """Constant-time check of an HMAC-SHA256 signature (a non-ASCII one simply does not match)."""
    if not signature.isascii():
        return False
    return hmac.compare_digest(hmac_sign(key, payload), signature)
