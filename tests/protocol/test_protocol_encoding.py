"""Property tests of the per-tensor patch encodings (SPEC.md, "Patch encodings").

For every dtype of protocol v1, tensor sizes from one element up, and change
densities from one element to all of them: encode -> decode -> apply gives back
the new bits exactly, and the chosen coding is never bigger than the raw
byte-plane coding (plus zstd framing).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.protocol import encoding, positions, streams, values
from deltasync.protocol.dtypes import DTYPES
from deltasync.protocol.encoding import apply_values, decode_positions, decode_values, encode_changes

Bits = np.ndarray[Any, np.dtype[Any]]

pytestmark = pytest.mark.usefixtures("kernel_backend")  # each test on the compiled kernels and on numpy

SIZES = (1, 2, 3, 8, 63, 640, 4099)
DENSITIES = ("one", 0.01, 0.5, 1.0)
# How the changed elements differ: any new bits, a flip of a few low bits (what small
# optimizer steps do to floats), or one of a handful of XOR masks (a tiny rank table).
KINDS = ("random", "lowbits", "few")
ZSTD_OVERHEAD = 64  # frame header + block headers for the sizes used here


def _random_bits(rng: np.random.Generator, bits: np.dtype[Any], n: int) -> Bits:
    info = np.iinfo(bits)
    return rng.integers(info.min, info.max, size=n, dtype=bits, endpoint=True)


def _make_change(
    rng: np.random.Generator, dtype: str, numel: int, density: str | float, kind: str
) -> tuple[Bits, Bits, Bits]:
    """(sorted changed positions, old full tensor bits, new full tensor bits)."""
    bits = DTYPES[dtype].bits
    count = 1 if density == "one" else max(1, round(numel * float(density)))
    idx = np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64)
    old = _random_bits(rng, bits, numel)
    if kind == "random":
        xor = _random_bits(rng, bits, count)
    elif kind == "lowbits":
        xor = rng.integers(0, 16, size=count).astype(bits)
    else:
        masks = _random_bits(rng, bits, 3)
        xor = masks[rng.integers(0, 3, size=count)]
    xor[xor == 0] = 1  # a changed element has at least one differing bit
    new = old.copy()
    new[idx] = old[idx] ^ xor
    return idx, old, new


def _roundtrip(numel: int, idx: Bits, old: Bits, new: Bits) -> encoding.EncodedTensor:
    enc = encode_changes(numel, idx, old[idx], new[idx])
    pos = decode_positions(enc.pos_blob, enc.positions, enc.rice_k, enc.count, numel, "t")
    assert pos.dtype == np.int64
    if enc.positions != "dense":
        np.testing.assert_array_equal(pos, idx)
    else:
        np.testing.assert_array_equal(pos, np.arange(numel))
    decoded = decode_values(enc.val_blob, enc.values, enc.count, old.dtype, "t")
    assert decoded.dtype == old.dtype and decoded.shape == (enc.count,)
    out = old.copy()
    out[pos] = apply_values(enc.values, old[pos], decoded)
    np.testing.assert_array_equal(out.view(np.uint8), new.view(np.uint8))
    return enc


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    numel=st.sampled_from(SIZES),
    density=st.sampled_from(DENSITIES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_is_bit_exact_and_never_bigger_than_raw(
    dtype: str, numel: int, density: str | float, kind: str, seed: int
) -> None:
    idx, old, new = _make_change(np.random.default_rng(seed), dtype, numel, density, kind)
    enc = _roundtrip(numel, idx, old, new)
    assert enc.count == (idx.size if enc.positions != "dense" else numel)
    assert (
        enc.positions == ("rice-z" if idx.size >= positions.ZIP_QUOTIENTS else "rice")
        or enc.positions == "dense"
        and enc.values in ("xor-rank", "raw")
    )
    assert (enc.positions == "dense") <= (idx.size * 8 > numel)  # dense only when > 1/8 changed

    # Never larger than Rice positions + zstd'ed raw byte planes (tried for < 65536 changes),
    # and in any case never larger than Rice positions + the uncompressed values + framing.
    itemsize = DTYPES[dtype].itemsize
    rice = positions.encode_positions(idx)[2]
    raw_planes = streams.compress(streams.byte_planes(new[idx]))
    assert enc.nbytes <= len(rice) + len(raw_planes)
    assert enc.nbytes <= len(rice) + idx.size * itemsize + ZSTD_OVERHEAD


@pytest.mark.parametrize("dtype", ["BF16", "F32", "U8"])
def test_large_change_sets_take_the_same_path(dtype: str) -> None:
    """>= 65536 changes skips the raw attempt unless XOR is worse than the plain values."""
    rng = np.random.default_rng(7)
    for density, kind in ((0.6, "lowbits"), (1.0, "random")):
        idx, old, new = _make_change(rng, dtype, 120_000, density, kind)
        enc = _roundtrip(120_000, idx, old, new)
        assert enc.nbytes <= len(positions.encode_positions(idx)[2]) + (
            idx.size * DTYPES[dtype].itemsize + ZSTD_OVERHEAD
        )


def test_escapes_roundtrip() -> None:
    """More than 255 distinct XOR masks: ranks escape to the side stream."""
    rng = np.random.default_rng(3)
    idx, old, new = _make_change(rng, "F32", 4000, 0.5, "random")
    enc = _roundtrip(4000, idx, old, new)
    assert enc.values == "raw" or len(enc.val_blob) > 2 + 255 * 4


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_nothing_changed_is_not_encodable(dtype: str) -> None:
    """Density 0: there is no patch entry to write; the uploader must skip the tensor.

    ``encode_changes`` refuses with ValueError (a caller bug, not bad input, so not a
    ProtocolError), as it does for more positions than elements.
    """
    bits = DTYPES[dtype].bits
    empty = np.zeros(0, dtype=bits)
    with pytest.raises(ValueError, match="changed positions"):
        encode_changes(8, np.zeros(0, dtype=np.int64), empty, empty)
    one = np.zeros(9, dtype=bits)
    with pytest.raises(ValueError, match="changed positions"):
        encode_changes(8, np.arange(9, dtype=np.int64), one, one)


def test_raw_is_idempotent_and_xor_is_not() -> None:
    """SPEC: overwrite may be applied twice; XOR must be applied exactly once."""
    old = np.arange(16, dtype=np.int16)
    new = old.copy()
    new[[1, 5]] ^= 0x0101
    idx = np.array([1, 5], dtype=np.int64)
    for coding in ("raw", "xor-rank"):
        blob = (
            streams.compress(streams.byte_planes(new[idx]))
            if coding == "raw"
            else values.encode_xor_rank(old[idx] ^ new[idx])
        )
        dec = decode_values(blob, coding, 2, old.dtype, "t")
        once = apply_values(coding, old[idx], dec)
        twice = apply_values(coding, once, dec)
        np.testing.assert_array_equal(once, new[idx])
        if coding == "raw":
            np.testing.assert_array_equal(twice, new[idx])
        else:
            np.testing.assert_array_equal(twice, old[idx])
