"""Digests: xxh3-128 for files and tensors, HMAC-SHA256 for optional signatures.

A tensor's digest depends on the manifest format it is written in (SPEC.md "Digests"): in format 1
it is the xxh3-128 of the tensor's raw bytes; in format 2 a tensor of more than :data:`DIGEST_CHUNK`
bytes digests as the xxh3-128 of its chunks' digests, so its chunks hash on several threads and no
single pass over it is needed. :func:`tensor_digests` cuts a whole state into tasks and runs them
through the caller's ``mapper`` (a thread pool's ``map``): this package starts no threads.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np
import xxhash

__all__ = [
    "DIGEST_CHUNK",
    "TASK_BYTES",
    "ByteSource",
    "Digestible",
    "Mapper",
    "digests_comparable",
    "hmac_sign",
    "hmac_verify",
    "is_tree_digest",
    "tensor_digest",
    "tensor_digests",
    "xxh3_128",
    "xxh3_128_array",
    "xxh3_128_chunks",
]

#: format 2: a tensor of more bytes than this digests as the xxh3-128 of its chunks' digests (SPEC "Digests")
DIGEST_CHUNK = 1 << 24
#: :func:`tensor_digests` hashes small tensors in tasks of at least this many bytes (a pool task costs
#: tens of microseconds, more than hashing a small tensor)
TASK_BYTES = 1 << 20


def xxh3_128(data: bytes | bytearray | memoryview) -> str:
    """Lower-case hex xxh3-128 (32 characters) of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def xxh3_128_array(arr: np.ndarray[Any, Any]) -> str:
    """xxh3-128 of an array's raw bytes in C order (copies only if not contiguous): a tensor's
    digest in format 1 (see :func:`tensor_digest` for any format)."""
    a = np.ascontiguousarray(arr).reshape(-1)
    return xxhash.xxh3_128_hexdigest(a.view(np.uint8).data) if a.size else xxhash.xxh3_128_hexdigest(b"")


def xxh3_128_chunks(chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    """xxh3-128 of the concatenation of ``chunks`` (streamed, no copy)."""
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


# ------------------------------------------------------------------ tensor digests


class ByteSource(Protocol):
    """A tensor's raw bytes (row-major, little-endian elements) read in ranges: what a tensor that is
    not in host memory (an accelerator's) offers to :func:`tensor_digests`. ``read`` returns a host
    buffer of bytes ``start:stop`` (at most :data:`DIGEST_CHUNK` of them are asked for at once)."""

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""

    def read(self, start: int, stop: int) -> bytes | memoryview:
        """Bytes ``start:stop`` of the tensor, in host memory."""


Digestible: TypeAlias = "np.ndarray[Any, Any] | ByteSource"


def is_tree_digest(nbytes: int, format_version: int) -> bool:
    """Whether a tensor of ``nbytes`` digests as the xxh3-128 of its chunks' digests (format 2, large)."""
    return format_version >= 2 and nbytes > DIGEST_CHUNK


def digests_comparable(nbytes: int, format_a: int, format_b: int) -> bool:
    """Whether the digests of one tensor of ``nbytes`` in manifests of formats ``format_a`` and
    ``format_b`` are equal exactly when its bytes are (a large tensor's differ between formats 1 and 2)."""
    return is_tree_digest(nbytes, format_a) == is_tree_digest(nbytes, format_b)


class _HostBytes:
    """A host array as a :class:`ByteSource` (views, no copy)."""

    __slots__ = ("_flat", "nbytes")

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self._flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)  # copies only if not contiguous
        self.nbytes = int(self._flat.size)

    def read(self, start: int, stop: int) -> bytes | memoryview:
        return self._flat[start:stop].data


def _source(x: Digestible) -> ByteSource:
    return _HostBytes(x) if isinstance(x, np.ndarray) else x


def _digest(src: ByteSource, start: int, stop: int) -> bytes:
    """The 16-byte xxh3-128 of bytes ``start:stop``, read at most :data:`DIGEST_CHUNK` at a time."""
    if stop - start <= DIGEST_CHUNK:
        return xxhash.xxh3_128_digest(src.read(start, stop))
    h = xxhash.xxh3_128()
    for a in range(start, stop, DIGEST_CHUNK):
        h.update(src.read(a, min(stop, a + DIGEST_CHUNK)))
    return h.digest()


#: one task of :func:`tensor_digests`: (result slot, source, start, stop) pieces, each one digest
_Task = tuple[tuple[int, ByteSource, int, int], ...]


def _run(task: _Task) -> list[bytes]:
    return [_digest(src, a, b) for _, src, a, b in task]


def tensor_digest(arr: Digestible, format_version: int) -> str:
    """A tensor's digest in a manifest of ``format_version`` (SPEC.md "Digests"), on this thread."""
    return tensor_digests({"": arr}, format_version)[""]


Mapper = Callable[[Callable[[_Task], list[bytes]], Sequence[_Task]], Iterable[list[bytes]]]


def tensor_digests(arrays: Mapping[str, Digestible], format_version: int, *, mapper: Mapper = map) -> dict[str, str]:
    """Each tensor's digest in a manifest of ``format_version`` (SPEC.md "Digests"), by name.

    The work is cut into tasks: each :data:`DIGEST_CHUNK` of a tensor that format 2 digests by
    chunks, one task per other large tensor (format 1: one pass), and the small tensors in batches of
    at least :data:`TASK_BYTES`. ``mapper`` runs them (``map``: on this thread; a thread pool's
    ``map``: at once, as xxhash releases the GIL). Host arrays are hashed in place (a non-contiguous
    one is copied first); a :class:`ByteSource` is read one chunk at a time.
    """
    names = list(arrays)
    # slots: one per small tensor or one-pass tensor, one per chunk of a tree-digested tensor
    plan: list[tuple[int, int]] = []  # per name: (first slot, number of chunk slots; 0: one digest)
    tasks: list[_Task] = []
    batch: list[tuple[int, ByteSource, int, int]] = []
    batch_bytes = 0
    slots = 0
    for name in names:
        src = _source(arrays[name])
        n = int(src.nbytes)
        if is_tree_digest(n, format_version):
            chunks = [(slots + i, src, a, min(n, a + DIGEST_CHUNK)) for i, a in enumerate(range(0, n, DIGEST_CHUNK))]
            plan.append((slots, len(chunks)))
            tasks.extend((c,) for c in chunks)
            slots += len(chunks)
            continue
        plan.append((slots, 0))
        if n > DIGEST_CHUNK:
            tasks.append(((slots, src, 0, n),))
        else:
            batch.append((slots, src, 0, n))
            batch_bytes += n
            if batch_bytes >= TASK_BYTES:
                tasks.append(tuple(batch))
                batch, batch_bytes = [], 0
        slots += 1
    if batch:
        tasks.append(tuple(batch))
    found: list[bytes] = [b""] * slots
    for task, digests in zip(tasks, mapper(_run, tasks), strict=True):
        for (slot, _, _, _), d in zip(task, digests, strict=True):
            found[slot] = d
    out: dict[str, str] = {}
    for name, (first, nchunks) in zip(names, plan, strict=True):
        if nchunks:
            out[name] = xxhash.xxh3_128_hexdigest(b"".join(found[first : first + nchunks]))
        else:
            out[name] = found[first].hex()
    return out


# ------------------------------------------------------------------ signatures


def hmac_sign(key: bytes, payload: bytes) -> str:
    """Hex HMAC-SHA256 of ``payload``."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def hmac_verify(key: bytes, payload: bytes, signature: str) -> bool:
    """Constant-time check of an HMAC-SHA256 signature (a non-ASCII one simply does not match)."""
    if not signature.isascii():
        return False
    return hmac.compare_digest(hmac_sign(key, payload), signature)
