"""Per-tensor patch encodings (SPEC.md, "Patch encodings").

A tensor's change between two steps is the sorted set of flat positions whose
bits differ plus, for each, the new bits. Both halves are coded separately and
the smallest combination wins:

positions
    ``rice``   gaps between positions split Rice-style with parameter k:
               unary quotients, then the remainders as k bit planes.
    ``rice-z`` the same with the quotients as a pair stream (two small symbols
               per byte, zstd); faster than unary for large counts.
    ``dense`` no positions: every element is listed (dense fallback).
values
    ``xor-rank`` XOR(old, new) bits, each replaced by its frequency rank in a
                 small table (rank 255 escapes to a raw side stream), as a pair
                 stream.
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
from types import ModuleType
from typing import Any, Literal

import numpy as np
import zstandard

from deltasync.errors import ProtocolError
from deltasync.protocol import kernels
from deltasync.protocol.manifest import ZSTD_MAX_RATIO

__all__ = [
    "EncodedTensor",
    "PositionCoding",
    "ValueCoding",
    "apply_values",
    "decode_positions",
    "decode_values",
    "encode_changes",
]

PositionCoding = Literal["rice", "rice-z", "dense"]
ValueCoding = Literal["xor-rank", "raw"]

ZSTD_LEVEL = 1  # level 1 beat 3 on XOR ranks and quotient pairs (smaller and faster)
ZIP_QUOTIENTS = 4096  # from this many changes on, quotients are pair-coded (faster than unary)
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


def _encode_pairs(sym: Ints) -> bytes:
    """uint8 symbols as a pair stream (SPEC.md): small symbols two to a byte, then zstd.

    Pairing squares the probability of the commonest byte, so zstd's Huffman
    stage (at least one bit per byte) wastes about half as much per symbol.
    """
    s = np.ascontiguousarray(sym, dtype=np.uint8)
    if s.size % 2:
        s = np.append(s, np.uint8(0))
    two = s.view("<u2")
    pairs = _PAIR_LUT[two]
    return _pairs_blob(pairs, two[pairs == PAIR_ESCAPE])


def _pairs_blob(pairs: Ints, escaped: Ints) -> bytes:
    """The pair stream's bytes from its pair bytes and its escaped pairs (little-endian u16)."""
    pz = _compress(pairs)
    esc = _compress(escaped.astype("<u2", copy=False).view(np.uint8)) if escaped.size else b""
    return b"".join([struct.pack("<I", len(pz)), pz, esc])


def _pair_parts(blob: bytes | memoryview, count: int, what: str) -> tuple[Ints, Ints]:
    """(pair bytes, escaped pairs as u16) of a pair stream coding ``count`` symbols."""
    mv = memoryview(blob)
    if len(mv) < 4:
        raise ProtocolError(f"{what}: symbol stream truncated")
    (plen,) = struct.unpack_from("<I", mv, 0)
    if len(mv) < 4 + plen:
        raise ProtocolError(f"{what}: symbol stream truncated")
    pairs = np.frombuffer(_decompress(mv[4 : 4 + plen], (count + 1) // 2, what + " pairs"), dtype=np.uint8)
    n_esc = int(np.count_nonzero(pairs == PAIR_ESCAPE))
    raw = _decompress(mv[4 + plen :], 2 * n_esc, what + " escaped pairs")
    return pairs, np.frombuffer(raw, dtype="<u2")


def _decode_pairs(blob: bytes | memoryview, count: int, what: str) -> Ints:
    pairs, escaped = _pair_parts(blob, count, what)
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


# ---------------------------------------------------------------- positions

BIG_Q = 255  # a quotient >= 255 is sent as a u64 in a side stream


def _bit_planes(rem: Ints, k: int) -> bytes:
    """Plane j (j = 0 first) holds bit j of every remainder, packed LSB first."""
    r = rem.astype(np.uint8 if k <= 8 else np.uint64)
    one = r.dtype.type(1)
    return b"".join(np.packbits((r >> r.dtype.type(j)) & one, bitorder="little").tobytes() for j in range(k))


def _from_bit_planes(buf: Ints, k: int, count: int) -> Ints:
    plane = (count + 7) // 8
    acc = np.zeros(count, dtype=np.uint8 if k <= 8 else np.uint64)
    for j in range(k):
        bits = np.unpackbits(buf[j * plane : (j + 1) * plane], count=count, bitorder="little")
        acc |= bits.astype(acc.dtype) << acc.dtype.type(j)
    return acc.astype(np.int64)


def _rice_cost(gaps: Ints, k: int) -> int:
    return int(gaps.size * (k + 1) + int(np.sum(gaps >> k)))


def _rice_k0(mean: float) -> int:
    return max(0, int(np.floor(np.log2(mean * 0.6931 + 1.0))))


def _rice_k(gaps: Ints) -> int:
    k0 = _rice_k0(float(gaps.mean()) if gaps.size else 0.0)
    sample = gaps[:: max(1, gaps.size >> 16)]  # about 64k gaps decide as well as all of them
    return min((kk for kk in (k0 - 1, k0, k0 + 1) if 0 <= kk <= 62), key=lambda kk: _rice_cost(sample, kk))


def _encode_rice(gaps: Ints, k: int, zipped: bool) -> bytes:
    q = gaps >> k
    planes = _bit_planes(gaps & ((1 << k) - 1), k) if k else b""
    if not zipped:
        unary = np.ones(int(q.sum()) + q.size, dtype=np.uint8)
        unary[np.cumsum(q + 1) - 1] = 0
        return np.packbits(unary, bitorder="little").tobytes() + planes
    big = q >= BIG_Q
    sym = np.minimum(q, BIG_Q).astype(np.uint8)
    p = _encode_pairs(sym)
    bigs = q[big].astype("<u8").tobytes()
    return b"".join([struct.pack("<I", len(p)), p, struct.pack("<I", len(bigs) // 8), bigs, planes])


def _encode_rice_z_kernel(kern: ModuleType, idx: Ints) -> tuple[int, bytes]:
    """The kernels' rice-z coding: the same k and bytes as :func:`_encode_rice` (zipped)."""
    # the mean gap exactly as numpy's gaps.mean() gives it (the gap sum is exact in float64)
    k = int(kern.rice_k(idx, _rice_k0(float(int(idx[-1]) - (idx.size - 1)) / idx.size)))
    pairs, esc, ne, bigs, nb, planes = kern.rice_z_parts(idx, k)
    p = _pairs_blob(pairs, esc[:ne])
    bigs_b = bigs[:nb].astype("<u8", copy=False).tobytes()
    return k, b"".join([struct.pack("<I", len(p)), p, struct.pack("<I", nb), bigs_b, planes.tobytes()])


def _encode_positions(idx: Ints) -> tuple[PositionCoding, int, bytes]:
    """(coding, k, blob) of sorted non-empty int64 positions."""
    kern = kernels.impl()
    if kern is not None and idx.size >= ZIP_QUOTIENTS:
        k, blob = _encode_rice_z_kernel(kern, np.ascontiguousarray(idx, dtype=np.int64))
        return "rice-z", k, blob
    gaps = np.empty_like(idx)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    gaps[1:] -= 1
    k = _rice_k(gaps)
    zipped = idx.size >= ZIP_QUOTIENTS
    return ("rice-z" if zipped else "rice"), k, _encode_rice(gaps, k, zipped)


def _unary_quotients(buf: Ints, count: int, what: str) -> Ints:
    term = np.flatnonzero(np.unpackbits(~buf, bitorder="little"))
    if term.size < count:
        raise ProtocolError(f"{what}: position stream holds fewer than {count} positions")
    term = term[:count]
    if buf.size != (int(term[-1]) + 8) // 8:
        raise ProtocolError(f"{what}: position stream has trailing bytes")
    return np.diff(term, prepend=-1) - 1


def _zipped_quotients(mv: memoryview, count: int, what: str) -> Ints:
    if len(mv) < 4:
        raise ProtocolError(f"{what}: position stream truncated")
    (plen,) = struct.unpack_from("<I", mv, 0)
    if len(mv) < 8 + plen:
        raise ProtocolError(f"{what}: position stream truncated")
    q = _decode_pairs(mv[4 : 4 + plen], count, what + " quotients").astype(np.int64)
    (nbig,) = struct.unpack_from("<I", mv, 4 + plen)
    big = q == BIG_Q
    if nbig != int(np.count_nonzero(big)) or len(mv) != 8 + plen + 8 * nbig:
        raise ProtocolError(f"{what}: big-quotient stream does not match the quotients")
    if nbig:
        vals = np.frombuffer(mv[8 + plen :], dtype="<u8")
        if int(vals.min()) < BIG_Q or int(vals.max()) >= 1 << 62:
            raise ProtocolError(f"{what}: big quotient out of range")
        q[big] = vals.astype(np.int64)
    return q


_POSITION_ERRORS = {
    1: "escaped quotient pairs do not match the pair stream",
    2: "invalid pair byte",
    3: "nonzero padding symbol",
    4: "big-quotient stream does not match the quotients",
    5: "big quotient out of range",
    6: "a position gap exceeds the tensor",
    7: "positions run outside the tensor",
}


def _rice_z_kernel(kern: ModuleType, head: Ints, planes: Ints, k: int, count: int, numel: int, what: str) -> Ints:
    """Positions of a rice-z stream in one compiled pass (the checks of :func:`_zipped_quotients`)."""
    mv = memoryview(head.data).cast("B")
    if len(mv) < 4:
        raise ProtocolError(f"{what}: position stream truncated")
    (plen,) = struct.unpack_from("<I", mv, 0)
    if len(mv) < 8 + plen:
        raise ProtocolError(f"{what}: position stream truncated")
    pairs, escaped = _pair_parts(mv[4 : 4 + plen], count, what + " quotients")
    (nbig,) = struct.unpack_from("<I", mv, 4 + plen)
    if len(mv) != 8 + plen + 8 * nbig:
        raise ProtocolError(f"{what}: big-quotient stream does not match the quotients")
    bigs = np.frombuffer(mv[8 + plen :], dtype="<u8")
    pos, err = kern.rice_z_positions(pairs, escaped, bigs, planes, k, count, numel)
    if err:
        raise ProtocolError(f"{what}: {_POSITION_ERRORS[err]} (a tensor of {numel} elements)")
    out: Ints = pos
    return out


def decode_positions(blob: bytes | memoryview, coding: str, k: int, count: int, numel: int, what: str) -> Ints:
    """Sorted int64 flat positions of a tensor with ``numel`` elements."""
    if coding == "dense":
        if count != numel or len(blob):
            raise ProtocolError(f"{what}: dense positions must list all {numel} elements and carry no bytes")
        return np.arange(numel, dtype=np.int64)
    if coding not in ("rice", "rice-z"):
        raise ProtocolError(f"{what}: unknown position coding {coding!r}")
    if not (0 <= k <= 62) or not (0 < count <= numel):
        raise ProtocolError(f"{what}: invalid rice parameters k={k} count={count} numel={numel}")
    rem_len = k * ((count + 7) // 8)
    if len(blob) < rem_len:
        raise ProtocolError(f"{what}: position stream truncated")
    buf = np.frombuffer(blob, dtype=np.uint8)
    head = buf[: buf.size - rem_len]
    kern = kernels.impl()
    if coding == "rice":
        q = _unary_quotients(head, count, what)
    elif kern is not None:
        return _rice_z_kernel(kern, head, buf[buf.size - rem_len :], k, count, numel, what)
    else:
        q = _zipped_quotients(memoryview(head.data).cast("B"), count, what)
    # No gap reaches numel, so a larger quotient is corrupt; checking it first also keeps
    # ``q << k`` and the cumulative sum below inside int64 (no silent wrap-around).
    if int(q.max()) > (min(numel, 1 << 62) - 1) >> k:
        raise ProtocolError(f"{what}: a position gap exceeds a tensor of {numel} elements")
    gaps = q << k
    if k:
        gaps |= _from_bit_planes(buf[buf.size - rem_len :], k, count)
    pos = np.cumsum(gaps + 1) - 1
    if int(pos[-1]) >= numel:
        raise ProtocolError(f"{what}: positions run outside a tensor of {numel} elements")
    return pos


# ---------------------------------------------------------------- values


def _table_of_counts(counts: Ints) -> tuple[Ints, Ints]:
    """(the up to 255 commonest values, most frequent first, ties by value; rank lookup table)."""
    nz = np.flatnonzero(counts)
    order = nz[np.argsort(-counts[nz], kind="stable")][:ESCAPE]
    lut = np.full(counts.size, ESCAPE, dtype=np.uint8)
    lut[order] = np.arange(order.size, dtype=np.uint8)
    return order, lut


def _unsigned(a: Ints) -> Ints:
    return a.view(f"u{a.dtype.itemsize}")


def _xor_rank_kernel(kern: ModuleType, old: Ints, new: Ints) -> bytes:
    """:func:`_encode_xor_rank` of ``old ^ new`` (bits of at most 2 bytes) in two compiled passes."""
    o, n = _unsigned(old), _unsigned(new)
    counts = np.zeros(1 << (8 * old.dtype.itemsize), dtype=np.int64)
    kern.xor_histogram(o, n, counts)
    order, lut = _table_of_counts(counts)
    table = order.astype(o.dtype).view(old.dtype)
    pairs, pesc, ne, vesc, nv = kern.xor_rank_parts(o, n, lut)
    rank_p = _pairs_blob(pairs, pesc[:ne])
    esc_z = _compress(_planes(vesc[:nv].view(old.dtype))) if nv else b""
    return b"".join([struct.pack("<H", table.size), table.tobytes(), struct.pack("<I", len(rank_p)), rank_p, esc_z])


def _rank_table(xor: Ints) -> tuple[Ints, Ints]:
    """(table of most frequent XOR values, uint8 rank per element; ESCAPE if not in table)."""
    if xor.dtype.itemsize <= 2:
        u = xor.view(np.uint8 if xor.dtype.itemsize == 1 else np.uint16)
        order, lut = _table_of_counts(np.bincount(u, minlength=1 << (8 * xor.dtype.itemsize)))
        return order.astype(u.dtype).view(xor.dtype), lut[u]
    values, inverse, counts = np.unique(xor, return_inverse=True, return_counts=True)
    order = np.argsort(-counts, kind="stable")[:ESCAPE]
    lut = np.full(values.size, ESCAPE, dtype=np.uint8)
    lut[order] = np.arange(order.size, dtype=np.uint8)
    return values[order], lut[inverse.reshape(-1)]


def _encode_xor_rank(xor: Ints) -> bytes:
    table, ranks = _rank_table(xor)
    rank_p = _encode_pairs(ranks)
    esc = xor[ranks == ESCAPE]
    esc_z = _compress(_planes(esc)) if esc.size else b""
    return b"".join([struct.pack("<H", table.size), table.tobytes(), struct.pack("<I", len(rank_p)), rank_p, esc_z])


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
    kern = kernels.impl()
    if kern is not None:
        return _xor_rank_decode_kernel(kern, mv, off, rlen, table, count, what)
    ranks = _decode_pairs(mv[off : off + rlen], count, what + " ranks")
    esc_mask = ranks == ESCAPE
    n_esc = int(np.count_nonzero(esc_mask))
    if n_esc and tlen < ESCAPE:
        raise ProtocolError(f"{what}: escaped rank with a table of only {tlen} entries")
    if n_esc < count and int(ranks[~esc_mask].max() if n_esc else ranks.max()) >= tlen:
        raise ProtocolError(f"{what}: rank outside a table of {tlen} entries")
    esc_raw = _decompress(mv[off + rlen :], n_esc * w, what + " escapes")
    if not n_esc:
        return table[ranks]
    out = np.empty(count, dtype=bits)
    ok = ~esc_mask
    out[ok] = table[ranks[ok]]
    out[esc_mask] = _unplanes(esc_raw, n_esc, bits)
    return out


_VALUE_ERRORS = {
    1: "escaped rank pairs do not match the pair stream",
    2: "invalid pair byte",
    3: "nonzero padding symbol",
    4: "escaped values do not match the escaped ranks",
    5: "escaped rank with a table of fewer than 255 entries",
    6: "rank outside the table",
}


def _xor_rank_decode_kernel(
    kern: ModuleType, mv: memoryview, off: int, rlen: int, table: Ints, count: int, what: str
) -> Ints:
    """XOR masks in one compiled pass; the escaped values' frame is sized from its own header
    (bounded by ``count``) and the kernel checks that their number matches the escaped ranks."""
    pairs, escaped = _pair_parts(mv[off : off + rlen], count, what + " ranks")
    rest = mv[off + rlen :]
    w = table.dtype.itemsize
    n_esc = 0
    if len(rest):
        try:
            declared = zstandard.frame_content_size(rest)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"{what} escapes: not a zstd frame ({exc})") from None
        if declared < 0 or declared % w or declared > count * w:
            raise ProtocolError(f"{what} escapes: zstd frame declares {declared} bytes for {count} values")
        n_esc = declared // w
    raw = _decompress(rest, n_esc * w, what + " escapes")
    vesc = _unplanes(raw, n_esc, table.dtype) if n_esc else np.empty(0, dtype=table.dtype)
    out, err = kern.xor_rank_values(pairs, escaped, table, vesc, count)
    if err:
        raise ProtocolError(f"{what}: {_VALUE_ERRORS[err]} ({table.size} entries)")
    vals: Ints = out
    return vals


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


def _encode_values(old: Ints, new: Ints) -> bytes:
    """The ``xor-rank`` value blob of ``old ^ new`` (compiled for bits of up to 2 bytes)."""
    kern = kernels.impl()
    if kern is not None and new.dtype.itemsize <= 2:
        return _xor_rank_kernel(kern, np.ascontiguousarray(old), np.ascontiguousarray(new))
    return _encode_xor_rank(old ^ new)


def encode_changes(numel: int, idx: Ints, old: Ints, new: Ints) -> EncodedTensor:
    """Code one tensor's change; ``idx`` sorted int64 positions, ``old``/``new`` their bits.

    Rice positions (unary quotients for small counts, pair-coded ones from
    ``ZIP_QUOTIENTS`` changes on) with both value codings where either may win,
    and the dense XOR fallback when more than half of the tensor changed; keeps
    the smallest.
    """
    count = int(idx.size)
    if count == 0 or count > numel:
        raise ValueError(f"encode_changes needs 1..{numel} changed positions, got {count}")
    pcoding, k, pos_blob = _encode_positions(idx)
    best = EncodedTensor(count, pcoding, k, "xor-rank", pos_blob, _encode_values(old, new))
    if count < 65536 or best.nbytes > count * new.dtype.itemsize:
        raw = EncodedTensor(count, pcoding, k, "raw", pos_blob, _compress(_planes(new)))
        best = min(best, raw, key=lambda e: e.nbytes)
    if count * 2 > numel:  # below half density the dense trial never won in the benchmark
        dense_xor = np.zeros(numel, dtype=new.dtype)
        dense_xor[idx] = old ^ new
        dense = EncodedTensor(numel, "dense", 0, "xor-rank", b"", _encode_xor_rank(dense_xor))
        best = min(best, dense, key=lambda e: e.nbytes)
    return best
