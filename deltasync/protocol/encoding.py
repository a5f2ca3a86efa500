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

The codings live in :mod:`~deltasync.protocol.positions` and :mod:`~deltasync.protocol.values`,
the streams they are made of in :mod:`~deltasync.protocol.streams`; this module picks the
smallest combination for one tensor. No function here does I/O; every decoder validates
lengths and raises ProtocolError on anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.protocol.positions import PositionCoding, decode_positions, encode_positions
from deltasync.protocol.streams import byte_planes, compress, decode_pairs
from deltasync.protocol.values import ValueCoding, apply_values, decode_values, encode_values, encode_xor_rank

__all__ = [
    "EncodedTensor",
    "PositionCoding",
    "ValueCoding",
    "apply_values",
    "decode_positions",
    "decode_values",
    "encode_changes",
]

Ints = np.ndarray[Any, np.dtype[Any]]

# read from this module under their former names by tests/protocol/test_protocol_golden.py (frozen)
# and benchmarks/bench_payload.py
_decode_pairs = decode_pairs
_encode_positions = encode_positions
_encode_xor_rank = encode_xor_rank
_encode_values = encode_values


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
    pcoding, k, pos_blob = encode_positions(idx)
    best = EncodedTensor(count, pcoding, k, "xor-rank", pos_blob, encode_values(old, new))
    if count < 65536 or best.nbytes > count * new.dtype.itemsize:
        raw = EncodedTensor(count, pcoding, k, "raw", pos_blob, compress(byte_planes(new)))
        best = min(best, raw, key=lambda e: e.nbytes)
    if count * 2 > numel:  # below half density the dense trial never won in the benchmark
        dense_xor = np.zeros(numel, dtype=new.dtype)
        dense_xor[idx] = old ^ new
        dense = EncodedTensor(numel, "dense", 0, "xor-rank", b"", encode_xor_rank(dense_xor))
        best = min(best, dense, key=lambda e: e.nbytes)
    return best
