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
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, cast

import numpy as np
import xxhash

__all__ = [
    "DIGEST_CHUNK",
    "GIL_HELD_BYTES",
    "TASK_BYTES",
    "ByteSource",
    "Digestible",
    "Mapper",
    "digests_comparable",
    "hmac_sign",
    "hmac_verify",
    "is_tree_digest",
    "packed_digests",
    "tensor_digest",
    "tensor_digests",
    "xxh3_128",
    "xxh3_128_array",
    "xxh3_128_chunks",
    "hex_words",
    "words_hex",
    "xxh3_128_ranges",
    "xxh3_128_words",
]

#: format 2: a tensor of more bytes than this digests as the xxh3-128 of its chunks' digests (SPEC "Digests")
DIGEST_CHUNK = 1 << 24
#: :func:`tensor_digests` hashes small tensors in tasks of at least this many bytes: a pool task costs
#: tens of microseconds, more than hashing a small tensor (at 18k tensors of 58 kB on 2 threads, tasks
#: of 1 MiB took 1.4x the time of tasks of 4 MiB: benchmarks/bench_digest.py)
TASK_BYTES = 4 << 20
#: python-xxhash (4.x) hashes an input of at most this many bytes holding the GIL: such tensors hash
#: one at a time whatever the threads, so :func:`tensor_digests` puts them all in one task (on two
#: threads, batches of them fighting over the GIL took 1.1x the time of one thread)
GIL_HELD_BYTES = 64 << 10


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


def xxh3_128_words(
    addrs: np.ndarray[Any, Any], lens: np.ndarray[Any, Any], *, mapper: Mapper = map
) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
    """The xxh3-128 of the ``lens[i]`` bytes at host address ``addrs[i]`` (int64 arrays) as an
    ``(n, 2)`` uint64 array (:func:`hex_words`); None where the compiled hasher cannot run (no numba,
    or a python-xxhash that does not export its C function): the caller hashes its buffers itself
    then. One compiled loop over the ranges that calls xxhash's C function and releases the GIL, cut
    into tasks of about :data:`TASK_BYTES` run through ``mapper``. The caller keeps the memory alive
    and vouches for the ranges: this reads raw memory."""
    k = _compiled_hasher()
    if k is None:
        return None
    n = int(addrs.size)
    addrs = np.ascontiguousarray(addrs, dtype=np.int64)
    lens = np.ascontiguousarray(lens, dtype=np.int64)
    order = None
    if n > 1 and bool((addrs[1:] < addrs[:-1]).any()):
        # hashed in address order: ranges asked for in another order (names sorted, a model's tensors
        # allocated in module order) jump about memory, and each jump restarts the prefetchers (18k
        # tensors of 21 kB in name order hashed at 0.6x the speed of the same in address order)
        order = np.argsort(addrs, kind="stable")
        addrs, lens = addrs[order], lens[order]
    out = np.empty((n, 2), dtype=np.uint64)
    total = int(lens.sum())
    # cut where the running byte count crosses each multiple of TASK_BYTES
    ends = np.searchsorted(np.cumsum(lens), np.arange(TASK_BYTES, total + TASK_BYTES, TASK_BYTES), side="right")
    cuts = sorted({0, n, *(int(e) for e in ends if 0 < e < n)})

    def run(span: tuple[int, int]) -> None:
        k.xxh3_ranges(addrs, lens, span[0], span[1], out)

    for _ in cast(Any, mapper)(run, list(zip(cuts[:-1], cuts[1:], strict=True))):
        pass
    if order is not None:
        back = np.empty_like(out)
        back[order] = out
        return back
    return out


#: whether the compiled hasher gave python-xxhash's digests on this platform (checked once per process)
_HASHER_OK: list[bool] = []


def _compiled_hasher() -> Any:
    """The kernel module when its batch hasher runs here and agrees with python-xxhash on a probe
    (the C function's struct return is read per the platform's ABI: a disagreement turns it off
    rather than write wrong digests); None otherwise."""
    from deltasync.protocol import kernels

    k = kernels.impl()
    if k is None or not k.HAVE_XXH3:
        return None
    if not _HASHER_OK:
        probe = np.frombuffer(bytes(range(256)) * 5, dtype=np.uint8)
        lens = np.array([0, 17, 240, 1280], dtype=np.int64)
        out = np.empty((lens.size, 2), dtype=np.uint64)
        k.xxh3_ranges(np.full(lens.size, probe.ctypes.data, dtype=np.int64), lens, 0, lens.size, out)
        want = [xxhash.xxh3_128_hexdigest(probe[:n].tobytes()) for n in lens.tolist()]
        _HASHER_OK.append(words_hex(out) == want)
        if not _HASHER_OK[0]:
            logging.getLogger(__name__).warning(
                "deltasync: the compiled xxh3 loop disagrees with python-xxhash on this platform; hashing through python-xxhash"
            )
    return k if _HASHER_OK[0] else None


def xxh3_128_ranges(
    addrs: np.ndarray[Any, Any], lens: np.ndarray[Any, Any], *, mapper: Mapper = map
) -> list[str] | None:
    """:func:`xxh3_128_words` as hex digests (what :func:`xxh3_128` gives for each range's bytes)."""
    words = xxh3_128_words(addrs, lens, mapper=mapper)
    return None if words is None else words_hex(words)


def words_hex(words: np.ndarray[Any, Any]) -> list[str]:
    """Hex digests from their ``(n, 2)`` uint64 form (:func:`hex_words`)."""
    text = np.ascontiguousarray(words, dtype=">u8").tobytes().hex()
    return [text[i : i + 32] for i in range(0, len(text), 32)]


def hex_words(hexes: Sequence[str]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Hex xxh3-128 digests as an ``(n, 2)`` uint64 array: row ``i`` is digest ``i``'s canonical
    (big-endian) bytes read as two big-endian words, high half first, so rows are equal exactly when
    the digests' values are. ValueError unless each is 32 hex characters."""
    if hexes and set(map(len, hexes)) != {32}:
        raise ValueError("an xxh3-128 hex digest is 32 characters")
    raw = bytes.fromhex("".join(hexes))  # ValueError: not hex
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64).reshape(-1, 2)


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


def _digest(src: np.ndarray[Any, Any] | ByteSource, start: int, stop: int) -> bytes:
    """The 16-byte xxh3-128 of bytes ``start:stop`` of ``src`` (a flat uint8 array, or a source read
    at most :data:`DIGEST_CHUNK` bytes at a time)."""
    if isinstance(src, np.ndarray):
        return xxhash.xxh3_128_digest(src[start:stop].data)
    if stop - start <= DIGEST_CHUNK:
        return xxhash.xxh3_128_digest(src.read(start, stop))
    h = xxhash.xxh3_128()
    for a in range(start, stop, DIGEST_CHUNK):
        h.update(src.read(a, min(stop, a + DIGEST_CHUNK)))
    return h.digest()


#: one piece of a task of :func:`tensor_digests`: (name, chunk index or -1 for the whole tensor,
#: C-contiguous array or source, start, stop); a task is a few pieces
_Piece = tuple[str, int, "np.ndarray[Any, Any] | ByteSource", int, int]
_Task = tuple[_Piece, ...]


def _run(task: _Task) -> list[str | bytes]:
    """A whole small host array's hex digest straight from xxhash (the per-tensor cost is all of it at
    18k tensors); every other piece's 16-byte digest."""
    out: list[str | bytes] = []
    for _, chunk, src, a, b in task:
        if chunk < 0 and isinstance(src, np.ndarray) and b <= DIGEST_CHUNK:
            out.append(xxhash.xxh3_128_hexdigest(cast(Any, src)))  # C-contiguous: its buffer is its bytes
        else:
            out.append(_digest(src, a, b))
    return out


def tensor_digest(arr: Digestible, format_version: int) -> str:
    """A tensor's digest in a manifest of ``format_version`` (SPEC.md "Digests"), on this thread."""
    return tensor_digests({"": arr}, format_version)[""]


Mapper = Callable[[Callable[[_Task], list[str | bytes]], Sequence[_Task]], Iterable[list[str | bytes]]]


def tensor_digests(arrays: Mapping[str, Digestible], format_version: int, *, mapper: Mapper = map) -> dict[str, str]:
    """Each tensor's digest in a manifest of ``format_version`` (SPEC.md "Digests"), by name.

    The work is cut into tasks: each :data:`DIGEST_CHUNK` of a tensor that format 2 digests by
    chunks, one task per other large tensor (format 1: one pass), the small tensors in batches of
    at least :data:`TASK_BYTES`, and the tiny ones (:data:`GIL_HELD_BYTES` or less) in one task.
    ``mapper`` runs them (``map``: on this thread; a thread pool's ``map``: at once, as
    python-xxhash releases the GIL while it hashes more than 64 kB in one call). Host arrays are
    hashed in place (a non-contiguous one is copied first); a :class:`ByteSource` is read one chunk
    at a time.
    """
    tasks: list[_Task] = []
    trees: dict[str, list[bytes]] = {}  # name -> its chunks' digests (format 2, large)
    batch: list[_Piece] = []
    batch_bytes = 0
    tiny: list[_Piece] = []  # hashed with the GIL held: one task, beside the others
    total = 0
    for name, x in arrays.items():
        src: np.ndarray[Any, Any] | ByteSource
        if isinstance(x, np.ndarray):
            src = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            n = src.nbytes
        else:
            src, n = x, int(x.nbytes)
        total += n
        if n <= GIL_HELD_BYTES:
            tiny.append((name, -1, src, 0, n))
            continue
        if n <= DIGEST_CHUNK:
            batch.append((name, -1, src, 0, n))
            batch_bytes += n
            if batch_bytes >= TASK_BYTES:
                tasks.append(tuple(batch))
                batch, batch_bytes = [], 0
            continue
        if isinstance(src, np.ndarray):
            src = src.reshape(-1).view(np.uint8)  # a view: the array is contiguous
        if not is_tree_digest(n, format_version):
            tasks.append(((name, -1, src, 0, n),))
            continue
        starts = range(0, n, DIGEST_CHUNK)
        trees[name] = [b""] * len(starts)
        tasks.extend(((name, i, src, a, min(n, a + DIGEST_CHUNK)),) for i, a in enumerate(starts))
    if batch:
        tasks.append(tuple(batch))
    if tiny:
        tasks.insert(0, tuple(tiny))  # first: the longest task a pool should start early
    found = dict.fromkeys(arrays, "")  # in the caller's order
    if total <= TASK_BYTES:
        mapper = map  # a pool's threads cost more to start than hashing this little here
    for task, digests in zip(tasks, mapper(_run, tasks), strict=True):
        for (name, chunk, _, _, _), d in zip(task, digests, strict=True):
            if isinstance(d, str):
                found[name] = d
            elif chunk < 0:
                found[name] = d.hex()  # canonical bytes: the same hex as hexdigest()
            else:
                trees[name][chunk] = d
    for name, chunks in trees.items():
        found[name] = xxhash.xxh3_128_hexdigest(b"".join(chunks))
    return found


def packed_digests(
    buf: np.ndarray[Any, Any],
    names: Sequence[str],
    starts: Sequence[int],
    stops: Sequence[int],
    format_version: int,
    *,
    mapper: Mapper = map,
) -> dict[str, str]:
    """The digests of tensors laid end to end in one C-contiguous host buffer, tensor ``names[i]``
    at bytes ``starts[i]:stops[i]``: what :func:`tensor_digests` gives for those slices, without a
    piece per tensor. Tensors of at most :data:`GIL_HELD_BYTES` (hashed holding the GIL whatever the
    threads) are hashed in one loop on this thread; the others go through :func:`tensor_digests`.
    (Parallel lists, not tuples: 18k tuples kept for a call set off the garbage collector.)"""
    if not buf.flags.c_contiguous:
        raise ValueError("packed_digests needs a C-contiguous buffer")
    flat = buf.reshape(-1).view(np.uint8)
    lo = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(stops, dtype=np.int64) - lo
    whole = (lens <= DIGEST_CHUNK) | (format_version < 2)  # digests that are one xxh3 of the slice
    if whole.any():
        ranges = xxh3_128_ranges(flat.ctypes.data + lo[whole], lens[whole], mapper=mapper)
        if ranges is not None:
            picked = np.flatnonzero(whole).tolist()
            out = dict(zip([names[i] for i in picked], ranges, strict=True))
            rest = np.flatnonzero(~whole).tolist()
            out.update(
                tensor_digests({names[i]: flat[starts[i] : stops[i]] for i in rest}, format_version, mapper=mapper)
            )
            return {n: out[n] for n in names}
    mv = flat.data
    hexdigest = xxhash.xxh3_128_hexdigest
    out = {}
    larger: dict[str, np.ndarray[Any, Any]] = {}
    for name, a, b in zip(names, starts, stops, strict=True):
        if b - a <= GIL_HELD_BYTES:
            out[name] = hexdigest(mv[a:b])
        else:
            larger[name] = flat[a:b]
    if larger:
        out.update(tensor_digests(larger, format_version, mapper=mapper))
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
