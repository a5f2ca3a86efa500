"""Position codings: where a tensor changed (SPEC.md, "Patch encodings").

``rice``   gaps between the sorted flat positions split Rice-style with parameter k:
           unary quotients, then the remainders as k bit planes.
``rice-z`` the same with the quotients as a pair stream (two small symbols per byte, zstd);
           faster than unary for large counts.
``dense``  no positions: every element is listed (dense fallback).
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import Literal

import numpy as np

from deltasync.errors import ProtocolError
from deltasync.protocol import kernels
from deltasync.protocol.streams import Ints, decode_pairs, encode_pairs, pair_parts, pairs_blob

__all__ = ["ZIP_QUOTIENTS", "PositionCoding", "decode_positions", "encode_positions", "encode_rice"]

PositionCoding = Literal["rice", "rice-z", "dense"]

ZIP_QUOTIENTS = 4096  # from this many changes on, quotients are pair-coded (faster than unary)
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


def encode_rice(gaps: Ints, k: int, zipped: bool) -> bytes:
    q = gaps >> k
    planes = _bit_planes(gaps & ((1 << k) - 1), k) if k else b""
    if not zipped:
        unary = np.ones(int(q.sum()) + q.size, dtype=np.uint8)
        unary[np.cumsum(q + 1) - 1] = 0
        return np.packbits(unary, bitorder="little").tobytes() + planes
    big = q >= BIG_Q
    sym = np.minimum(q, BIG_Q).astype(np.uint8)
    p = encode_pairs(sym)
    bigs = q[big].astype("<u8").tobytes()
    return b"".join([struct.pack("<I", len(p)), p, struct.pack("<I", len(bigs) // 8), bigs, planes])


def _encode_rice_z_kernel(kern: ModuleType, idx: Ints) -> tuple[int, bytes]:
    """The kernels' rice-z coding: the same k and bytes as :func:`encode_rice` (zipped)."""
    # the mean gap exactly as numpy's gaps.mean() gives it (the gap sum is exact in float64)
    k = int(kern.rice_k(idx, _rice_k0(float(int(idx[-1]) - (idx.size - 1)) / idx.size)))
    pairs, esc, ne, bigs, nb, planes = kern.rice_z_parts(idx, k)
    p = pairs_blob(pairs, esc[:ne])
    bigs_b = bigs[:nb].astype("<u8", copy=False).tobytes()
    return k, b"".join([struct.pack("<I", len(p)), p, struct.pack("<I", nb), bigs_b, planes.tobytes()])


def encode_positions(idx: Ints) -> tuple[PositionCoding, int, bytes]:
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
    return ("rice-z" if zipped else "rice"), k, encode_rice(gaps, k, zipped)


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
    q = decode_pairs(mv[4 : 4 + plen], count, what + " quotients").astype(np.int64)
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
    pairs, escaped = pair_parts(mv[4 : 4 + plen], count, what + " quotients")
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
