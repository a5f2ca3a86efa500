"""Per-tensor patch encodings (SPEC.md, "Patch encodings").

A tensor's change between two steps is the sorted set of flat positions whose
bits differ plus, for each, the new bits. Both halves are coded separately and
the smallest combination wins:

positions
    ``rice``  gaps between positions, Rice-coded with parameter k, as two
              streams (unary quotients, then k-bit remainders) so both encode
              and decode are vectorised numpy.
    ``dense`` no positions: every element is listed (dense fallback).
values
    ``xor-rank`` XOR(old, new) bits, each replaced by its frequency rank in a
                 small table (rank 255 escapes to a raw side stream), then zstd.
                 Needs the exact old bits: apply exactly once, onto a verified base.
    ``raw``      the new bits themselves (overwrite, idempotent), split into
                 byte planes, then zstd.

No function here does I/O; every decoder validates lengths and raises
ProtocolError on anything malformed.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zstandard

from deltasync.errors import ProtocolError

__all__ = [
    "EncodedTensor",
    "PositionCoding",
    "ValueCoding",
    "apply_values",
    "decode_positions",
    "decode_values",
    "encode_changes",
]

PositionCoding = Literal["rice", "dense"]
ValueCoding = Literal["xor-rank", "raw"]

ZSTD_LEVEL = 3
ESCAPE = 255
Ints = np.ndarray[Any, np.dtype[Any]]

_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False)
    return c


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor's coded change: position and value blobs plus what decoding needs."""

    count: int
    positions: PositionCoding
    rice_k: int
    values: ValueCoding
    pos_blob: bytes
    val_blob: bytes

    @property
    def nbytes(self) -> int:
        """Payload bytes of both blobs."""
        return len(self.pos_blob) + len(self.val_blob)


# ---------------------------------------------------------------- zstd helpers


def _compress(data: Ints | bytes) -> bytes:
    return _cctx().compress(np.ascontiguousarray(data).data.cast("B") if isinstance(data, np.ndarray) else data)


def _decompress(blob: bytes | memoryview, expected: int, what: str) -> bytes:
    if expected == 0 and len(blob) == 0:
        return b""
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: not a zstd frame ({exc})") from None
    if declared != expected:
        raise ProtocolError(f"{what}: zstd frame declares {declared} bytes, expected {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ProtocolError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != expected:
        raise ProtocolError(f"{what}: decompressed to {len(out)} bytes, expected {expected}")
    return out


def _planes(vals: Ints) -> Ints:
    """Byte planes: all lowest bytes, then all next bytes... (groups similar bytes for zstd)."""
    w = vals.dtype.itemsize
    return vals.reshape(-1).view(np.uint8).reshape(-1, w).T.copy() if w > 1 else vals.view(np.uint8)


def _unplanes(raw: bytes, count: int, bits: np.dtype[Any]) -> Ints:
    w = bits.itemsize
    arr = np.frombuffer(raw, dtype=np.uint8)
    if w > 1:
        arr = arr.reshape(w, count).T.copy()
    return arr.reshape(-1).view(bits).copy() if w == 1 else arr.view(bits).reshape(-1)


# ---------------------------------------------------------------- positions


def _rice_cost(gaps: Ints, k: int) -> int:
    return int(gaps.size * (k + 1) + int(np.sum(gaps >> k)))


def _encode_rice(gaps: Ints) -> tuple[int, bytes]:
    c = gaps.size
    mean = float(gaps.mean()) if c else 0.0
    k0 = max(0, int(np.floor(np.log2(mean * 0.6931 + 1.0))))
    k = min((kk for kk in (k0 - 1, k0, k0 + 1) if 0 <= kk <= 62), key=lambda kk: _rice_cost(gaps, kk))
    q = gaps >> k
    nbits = int(q.sum()) + c
    unary = np.ones(nbits, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0
    parts = [np.packbits(unary, bitorder="little").tobytes()]
    if k:
        rem = (gaps[:, None] >> np.arange(k, dtype=np.int64)) & 1
        parts.append(np.packbits(rem.astype(np.uint8).reshape(-1), bitorder="little").tobytes())
    return k, b"".join(parts)


def decode_positions(blob: bytes | memoryview, coding: str, k: int, count: int, numel: int, what: str) -> Ints:
    """Sorted int64 flat positions of a tensor with ``numel`` elements."""
    if coding == "dense":
        if count != numel or len(blob):
            raise ProtocolError(f"{what}: dense positions must list all {numel} elements and carry no bytes")
        return np.arange(numel, dtype=np.int64)
    if coding != "rice":
        raise ProtocolError(f"{what}: unknown position coding {coding!r}")
    if not (0 <= k <= 62) or not (0 < count <= numel):
        raise ProtocolError(f"{what}: invalid rice parameters k={k} count={count} numel={numel}")
    rem_len = (count * k + 7) // 8
    if len(blob) < rem_len:
        raise ProtocolError(f"{what}: position stream truncated")
    buf = np.frombuffer(blob, dtype=np.uint8)
    unary = np.unpackbits(buf[: len(buf) - rem_len], bitorder="little")
    zeros = np.flatnonzero(unary == 0)
    if zeros.size < count:
        raise ProtocolError(f"{what}: position stream holds fewer than {count} positions")
    term = zeros[:count]
    if len(buf) - rem_len != (int(term[-1]) + 8) // 8:
        raise ProtocolError(f"{what}: position stream has trailing bytes")
    q = np.diff(term, prepend=-1) - 1
    # No gap reaches numel, so a larger quotient is corrupt; checking it first also keeps
    # ``q << k`` and the cumulative sum below inside int64 (no silent wrap-around).
    if int(q.max()) > (min(numel, 1 << 62) - 1) >> k:
        raise ProtocolError(f"{what}: a position gap exceeds a tensor of {numel} elements")
    gaps = q.astype(np.int64) << k
    if k:
        rbits = np.unpackbits(buf[len(buf) - rem_len :], bitorder="little")[: count * k]
        gaps |= (rbits.reshape(count, k).astype(np.int64) << np.arange(k, dtype=np.int64)).sum(axis=1)
    pos = np.cumsum(gaps + 1) - 1
    if int(pos[-1]) >= numel or (count > 1 and bool(np.any(pos[1:] <= pos[:-1]))):
        raise ProtocolError(f"{what}: positions run outside a tensor of {numel} elements")
    return pos


# ---------------------------------------------------------------- values


def _rank_table(xor: Ints) -> tuple[Ints, Ints]:
    """(table of most frequent XOR values, uint8 rank per element; ESCAPE if not in table)."""
    if xor.dtype.itemsize <= 2:
        u = xor.view(np.uint8 if xor.dtype.itemsize == 1 else np.uint16)
        counts = np.bincount(u, minlength=1 << (8 * xor.dtype.itemsize))
        nz = np.flatnonzero(counts)
        order = nz[np.argsort(-counts[nz], kind="stable")][:ESCAPE]
        lut = np.full(counts.size, ESCAPE, dtype=np.uint8)
        lut[order] = np.arange(order.size, dtype=np.uint8)
        return order.astype(u.dtype).view(xor.dtype), lut[u]
    values, inverse, counts = np.unique(xor, return_inverse=True, return_counts=True)
    order = np.argsort(-counts, kind="stable")[:ESCAPE]
    lut = np.full(values.size, ESCAPE, dtype=np.uint8)
    lut[order] = np.arange(order.size, dtype=np.uint8)
    return values[order], lut[inverse.reshape(-1)]


def _encode_xor_rank(xor: Ints) -> bytes:
    table, ranks = _rank_table(xor)
    rank_z = _compress(ranks)
    esc = xor[ranks == ESCAPE]
    esc_z = _compress(_planes(esc)) if esc.size else b""
    return b"".join([struct.pack("<H", table.size), table.tobytes(), struct.pack("<I", len(rank_z)), rank_z, esc_z])


def _decode_xor_rank(blob: bytes | memoryview, count: int, bits: np.dtype[Any], what: str) -> Ints:
    mv = memoryview(blob)
    w = bits.itemsize
    if len(mv) < 2:
        raise ProtocolError(f"{what}: value stream truncated")
    (tlen,) = struct.unpack_from("<H", mv, 0)
    off = 2 + tlen * w
    if tlen > ESCAPE or len(mv) < off + 4:
        raise ProtocolError(f"{what}: value table truncated or too large ({tlen} entries)")
    table = np.frombuffer(mv[2:off], dtype=bits)
    (rlen,) = struct.unpack_from("<I", mv, off)
    off += 4
    if len(mv) < off + rlen:
        raise ProtocolError(f"{what}: rank stream truncated")
    ranks = np.frombuffer(_decompress(mv[off : off + rlen], count, what + " ranks"), dtype=np.uint8)
    esc_mask = ranks == ESCAPE
    ok = ~esc_mask
    n_esc = count - int(ok.sum())
    if (n_esc and tlen < ESCAPE) or (n_esc < count and int(ranks[ok].max()) >= tlen):
        raise ProtocolError(f"{what}: rank outside a table of {tlen} entries")
    out = np.empty(count, dtype=bits)
    out[ok] = table[ranks[ok]]
    esc_raw = _decompress(mv[off + rlen :], n_esc * w, what + " escapes")
    if n_esc:
        out[esc_mask] = _unplanes(esc_raw, n_esc, bits)
    return out


def decode_values(blob: bytes | memoryview, coding: str, count: int, bits: np.dtype[Any], what: str) -> Ints:
    """Decoded value stream: XOR masks for ``xor-rank``, new bits for ``raw``."""
    if coding == "xor-rank":
        return _decode_xor_rank(blob, count, bits, what)
    if coding == "raw":
        return _unplanes(_decompress(blob, count * bits.itemsize, what), count, bits)
    raise ProtocolError(f"{what}: unknown value coding {coding!r}")


def apply_values(coding: str, old: Ints, decoded: Ints) -> Ints:
    """New bits from the old bits and a decoded value stream."""
    return old ^ decoded if coding == "xor-rank" else decoded


# ---------------------------------------------------------------- encoder


def encode_changes(numel: int, idx: Ints, old: Ints, new: Ints) -> EncodedTensor:
    """Code one tensor's change; ``idx`` sorted int64 positions, ``old``/``new`` their bits.

    Tries Rice positions with both value codings, and the dense XOR fallback
    when more than half of the tensor changed; keeps the smallest.
    """
    count = int(idx.size)
    if count == 0 or count > numel:
        raise ValueError(f"encode_changes needs 1..{numel} changed positions, got {count}")
    xor = old ^ new
    gaps = np.diff(idx, prepend=np.int64(-1)) - 1
    k, pos_blob = _encode_rice(gaps)
    best = EncodedTensor(count, "rice", k, "xor-rank", pos_blob, _encode_xor_rank(xor))
    if count < 65536 or best.nbytes > count * new.dtype.itemsize:
        raw = EncodedTensor(count, "rice", k, "raw", pos_blob, _compress(_planes(new)))
        best = min(best, raw, key=lambda e: e.nbytes)
    if count * 2 > numel:  # below half density the dense trial never won in the benchmark
        dense_xor = np.zeros(numel, dtype=xor.dtype)
        dense_xor[idx] = xor
        dense = EncodedTensor(numel, "dense", 0, "xor-rank", b"", _encode_xor_rank(dense_xor))
        best = min(best, dense, key=lambda e: e.nbytes)
    return best
