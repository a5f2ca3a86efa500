"""The byte streams that patch encodings are made of (SPEC.md, "Patch encodings"): zstd frames,
byte planes and pair-coded symbol streams.

Every decoder here validates lengths before it allocates and raises ProtocolError on anything
malformed.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import zstandard

from deltasync.errors import ProtocolError

__all__ = [
    "PAIR_BASE",
    "PAIR_ESCAPE",
    "ZSTD_MAX_RATIO",
    "byte_planes",
    "compress",
    "decode_pairs",
    "decompress",
    "encode_pairs",
    "from_byte_planes",
    "pair_parts",
    "pairs_blob",
]

ZSTD_LEVEL = 1  # level 1 beat 3 on XOR ranks and quotient pairs (smaller and faster)
ZSTD_MAX_RATIO = 32768  # no zstd frame expands more: its densest block (RLE, 4 bytes) yields at most 128 KiB
Ints = np.ndarray[Any, np.dtype[Any]]

_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    # kept per thread: a fresh one costs ~45 us a frame (its context made and sized on first use,
    # holding the GIL), nearly half of a 70 kB frame's decode; each one-shot decompress starts clean
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


# ---------------------------------------------------------------- zstd helpers


def compress(data: Ints | bytes) -> bytes:
    return _cctx().compress(np.ascontiguousarray(data).data.cast("B") if isinstance(data, np.ndarray) else data)


def decompress(blob: bytes | memoryview, expected: int, what: str) -> bytes:
    if expected == 0:
        if len(blob):
            raise ProtocolError(f"{what}: {len(blob)} bytes where no zstd frame belongs (nothing to code)")
        return b""
    if expected > len(blob) * ZSTD_MAX_RATIO:
        # checked before zstd sees the frame: no output buffer is sized from bytes that are not there
        raise ProtocolError(f"{what}: {len(blob)} bytes cannot hold {expected} bytes of zstd output")
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: not a zstd frame ({exc})") from None
    if declared != expected:
        raise ProtocolError(f"{what}: zstd frame declares {declared} bytes, expected {expected}")
    try:
        out = _dctx().decompress(blob, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != expected:
        raise ProtocolError(f"{what}: decompressed to {len(out)} bytes, expected {expected}")
    return out


def byte_planes(vals: Ints) -> Ints:
    """Byte planes: all lowest bytes, then all next bytes... (groups similar bytes for zstd)."""
    w = vals.dtype.itemsize
    return vals.reshape(-1).view(np.uint8).reshape(-1, w).T.copy() if w > 1 else vals.view(np.uint8)


def from_byte_planes(raw: bytes, count: int, bits: np.dtype[Any]) -> Ints:
    w = bits.itemsize
    arr = np.frombuffer(raw, dtype=np.uint8)
    if w > 1:
        arr = arr.reshape(w, count).T.copy()
    return arr.reshape(-1).view(bits).copy() if w == 1 else arr.view(bits).reshape(-1)


# ---------------------------------------------------------------- pair-coded symbols

PAIR_BASE = 15  # two symbols < 15 share one byte: a * 15 + b (0..224)
PAIR_ESCAPE = 255
_PAIR_DECODE = ((np.arange(256) // PAIR_BASE) | ((np.arange(256) % PAIR_BASE) << 8)).astype("<u2")


def _pair_lut() -> Ints:
    lut = np.full(1 << 16, PAIR_ESCAPE, dtype=np.uint8)
    a, b = np.meshgrid(np.arange(PAIR_BASE), np.arange(PAIR_BASE), indexing="ij")
    lut[a | (b << 8)] = a * PAIR_BASE + b  # index: the two symbols read as one little-endian u16
    return lut


_PAIR_LUT = _pair_lut()


def encode_pairs(sym: Ints) -> bytes:
    """uint8 symbols as a pair stream (SPEC.md): small symbols two to a byte, then zstd.

    Pairing squares the probability of the commonest byte, so zstd's Huffman
    stage (at least one bit per byte) wastes about half as much per symbol.
    """
    s = np.ascontiguousarray(sym, dtype=np.uint8)
    if s.size % 2:
        s = np.append(s, np.uint8(0))
    two = s.view("<u2")
    pairs = _PAIR_LUT[two]
    return pairs_blob(pairs, two[pairs == PAIR_ESCAPE])


def pairs_blob(pairs: Ints, escaped: Ints) -> bytes:
    """The pair stream's bytes from its pair bytes and its escaped pairs (little-endian u16)."""
    pz = compress(pairs)
    esc = compress(escaped.astype("<u2", copy=False).view(np.uint8)) if escaped.size else b""
    return b"".join([struct.pack("<I", len(pz)), pz, esc])


def pair_parts(blob: bytes | memoryview, count: int, what: str) -> tuple[Ints, Ints]:
    """(pair bytes, escaped pairs as u16) of a pair stream coding ``count`` symbols."""
    mv = memoryview(blob)
    if len(mv) < 4:
        raise ProtocolError(f"{what}: symbol stream truncated")
    (plen,) = struct.unpack_from("<I", mv, 0)
    if len(mv) < 4 + plen:
        raise ProtocolError(f"{what}: symbol stream truncated")
    pairs = np.frombuffer(decompress(mv[4 : 4 + plen], (count + 1) // 2, what + " pairs"), dtype=np.uint8)
    n_esc = int(np.count_nonzero(pairs == PAIR_ESCAPE))
    raw = decompress(mv[4 + plen :], 2 * n_esc, what + " escaped pairs")
    return pairs, np.frombuffer(raw, dtype="<u2")


def decode_pairs(blob: bytes | memoryview, count: int, what: str) -> Ints:
    pairs, escaped = pair_parts(blob, count, what)
    esc = pairs == PAIR_ESCAPE
    if int(np.count_nonzero(pairs >= PAIR_BASE * PAIR_BASE)) != escaped.size:
        raise ProtocolError(f"{what}: invalid pair byte")
    both = _PAIR_DECODE[pairs]  # (a, b) as one little-endian u16 per pair
    if escaped.size:
        both[esc] = escaped
    flat = both.view(np.uint8)
    if count % 2 and flat[-1] != 0:
        raise ProtocolError(f"{what}: nonzero padding symbol")
    return flat[:count]
