"""Value codings: the new bits of the changed elements (SPEC.md, "Patch encodings").

``xor-rank`` XOR(old, new) bits, each replaced by its frequency rank in a small table (rank 255
             escapes to a raw side stream), as a pair stream. Needs the exact old bits: apply
             exactly once, onto a verified base.
``raw``      the new bits themselves (overwrite, idempotent), split into byte planes, then zstd.
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import Any, Literal

import numpy as np
import zstandard

from deltasync.errors import ProtocolError
from deltasync.protocol import kernels
from deltasync.protocol.streams import (
    Ints,
    byte_planes,
    compress,
    decode_pairs,
    decompress,
    encode_pairs,
    from_byte_planes,
    pair_parts,
    pairs_blob,
)

__all__ = ["ESCAPE", "ValueCoding", "apply_values", "decode_values", "encode_values", "encode_xor_rank"]

ValueCoding = Literal["xor-rank", "raw"]

ESCAPE = 255  # the rank of a value outside the table


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
    """:func:`encode_xor_rank` of ``old ^ new`` (bits of at most 2 bytes) in two compiled passes."""
    o, n = _unsigned(old), _unsigned(new)
    order, lut = kern.xor_rank_table(o, n, 1 << (8 * old.dtype.itemsize))
    table = order.astype(o.dtype).view(old.dtype)
    pairs, pesc, ne, vesc, nv = kern.xor_rank_parts(o, n, lut)
    rank_p = pairs_blob(pairs, pesc[:ne])
    esc_z = compress(byte_planes(vesc[:nv].view(old.dtype))) if nv else b""
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


def encode_xor_rank(xor: Ints) -> bytes:
    table, ranks = _rank_table(xor)
    rank_p = encode_pairs(ranks)
    esc = xor[ranks == ESCAPE]
    esc_z = compress(byte_planes(esc)) if esc.size else b""
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
    ranks = decode_pairs(mv[off : off + rlen], count, what + " ranks")
    esc_mask = ranks == ESCAPE
    n_esc = int(np.count_nonzero(esc_mask))
    if n_esc and tlen < ESCAPE:
        raise ProtocolError(f"{what}: escaped rank with a table of only {tlen} entries")
    if n_esc < count and int(ranks[~esc_mask].max() if n_esc else ranks.max()) >= tlen:
        raise ProtocolError(f"{what}: rank outside a table of {tlen} entries")
    esc_raw = decompress(mv[off + rlen :], n_esc * w, what + " escapes")
    if not n_esc:
        return table[ranks]
    out = np.empty(count, dtype=bits)
    ok = ~esc_mask
    out[ok] = table[ranks[ok]]
    out[esc_mask] = from_byte_planes(esc_raw, n_esc, bits)
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
    pairs, escaped = pair_parts(mv[off : off + rlen], count, what + " ranks")
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
    raw = decompress(rest, n_esc * w, what + " escapes")
    vesc = from_byte_planes(raw, n_esc, table.dtype) if n_esc else np.empty(0, dtype=table.dtype)
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
        return from_byte_planes(decompress(blob, count * bits.itemsize, what), count, bits)
    raise ProtocolError(f"{what}: unknown value coding {coding!r}")


def apply_values(coding: str, old: Ints, decoded: Ints) -> Ints:
    """New bits from the old bits and a decoded value stream."""
    return old ^ decoded if coding == "xor-rank" else decoded


def encode_values(old: Ints, new: Ints) -> bytes:
    """The ``xor-rank`` value blob of ``old ^ new`` (compiled for bits of up to 2 bytes)."""
    kern = kernels.impl()
    if kern is not None and new.dtype.itemsize <= 2:
        return _xor_rank_kernel(kern, np.ascontiguousarray(old), np.ascontiguousarray(new))
    return encode_xor_rank(old ^ new)
