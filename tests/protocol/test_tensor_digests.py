"""Tensor digests of both manifest formats (SPEC.md "Digests"): format 2's tree digest of a tensor over
2^24 bytes, the same digest in both formats below that, and the parallel digest of a state equal to
the serial one whatever the mix of sizes, dtypes and layouts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import xxhash

from deltasync._util.cpus import parallel_map
from deltasync.protocol import kernels
from deltasync.protocol.digests import (
    DIGEST_CHUNK,
    GIL_HELD_BYTES,
    TASK_BYTES,
    digests_comparable,
    hex_words,
    is_tree_digest,
    packed_digests,
    tensor_digest,
    tensor_digests,
    words_hex,
    xxh3_128_array,
    xxh3_128_ranges,
    xxh3_128_words,
)

CHUNK = 1 << 24  # the SPEC's CHUNK, written out: the code's constant must not drift from it


def reference(arr: np.ndarray[Any, Any], format_version: int) -> str:
    """The SPEC's definition on the bytes, written independently of the code: xxh3-128 of the raw
    bytes, or (format 2, more than CHUNK bytes) of the chunks' 16-byte big-endian digests."""
    raw = np.ascontiguousarray(arr).tobytes()
    if format_version == 1 or len(raw) <= CHUNK:
        return xxhash.xxh3_128(raw).hexdigest()
    return xxhash.xxh3_128(
        b"".join(xxhash.xxh3_128(raw[a : a + CHUNK]).digest() for a in range(0, len(raw), CHUNK))
    ).hexdigest()


def big() -> np.ndarray[Any, Any]:
    """17 MiB of little-endian uint32: two chunks, the second 1 MiB."""
    return (np.arange((17 << 20) // 4, dtype=np.uint64) * 2654435761 % (1 << 32)).astype("<u4")


def test_chunk_is_the_spec_s() -> None:
    assert DIGEST_CHUNK == CHUNK
    assert not is_tree_digest(CHUNK, 2) and is_tree_digest(CHUNK + 1, 2)
    assert not is_tree_digest(CHUNK + 1, 1)


def test_golden_tree_digest_of_a_17_mib_tensor() -> None:
    arr = big()
    raw = arr.tobytes()
    # computed here from xxhash on the two chunks, and frozen: the format's definition must not move
    first, second = xxhash.xxh3_128(raw[:CHUNK]).digest(), xxhash.xxh3_128(raw[CHUNK:]).digest()
    assert len(first) == 16 and first.hex() == xxhash.xxh3_128_hexdigest(raw[:CHUNK])  # canonical = big-endian hex
    want = xxhash.xxh3_128_hexdigest(first + second)
    assert want == "796e00ab2d2731ed9025e504f06cc5a9"
    assert tensor_digest(arr, 2) == want
    assert tensor_digests({"w": arr}, 2) == {"w": want}
    # format 1 keeps the whole-bytes digest, which differs
    assert (
        tensor_digest(arr, 1)
        == xxh3_128_array(arr)
        == xxhash.xxh3_128_hexdigest(raw)
        == "3436df577ff75d7abb1294616eeb7a4d"
    )
    assert tensor_digest(arr, 1) != want


@pytest.mark.parametrize("nbytes", [0, 1, 1000, CHUNK - 1, CHUNK])
def test_a_tensor_of_at_most_chunk_bytes_has_one_digest_in_both_formats(nbytes: int) -> None:
    arr = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), dtype=np.uint8)
    assert tensor_digest(arr, 1) == tensor_digest(arr, 2) == xxh3_128_array(arr) == reference(arr, 1)
    assert digests_comparable(nbytes, 1, 2)


def test_one_byte_over_chunk_is_a_tree_of_two() -> None:
    arr = np.frombuffer(np.random.default_rng(1).bytes(CHUNK + 1), dtype=np.uint8)
    raw = arr.tobytes()
    want = xxhash.xxh3_128_hexdigest(xxhash.xxh3_128_digest(raw[:CHUNK]) + xxhash.xxh3_128_digest(raw[CHUNK:]))
    assert tensor_digest(arr, 2) == want == reference(arr, 2)
    assert not digests_comparable(arr.nbytes, 1, 2) and digests_comparable(arr.nbytes, 2, 2)


def mixed_state() -> dict[str, np.ndarray[Any, Any]]:
    """Sizes from empty to three chunks, several dtypes, and non-contiguous arrays."""
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray[Any, Any]] = {
        "empty.f32": np.zeros(0, dtype=np.float32),
        "empty.2d": np.zeros((0, 5), dtype=np.uint16),
        "scalar": np.array(3.5, dtype=np.float64),
        "mask": rng.random(1001) > 0.5,
        "i8": rng.integers(-128, 127, 333, dtype=np.int8),
        "three.chunks": np.frombuffer(rng.bytes(2 * CHUNK + 12345), dtype=np.uint8),
        "big.u16": rng.integers(0, 1 << 16, (CHUNK + 4096) // 2, dtype=np.uint16),
        "exactly.chunk": rng.integers(0, 1 << 31, CHUNK // 4, dtype=np.int32),
        # non-contiguous: a transposed matrix, a strided slice, a big strided one
        "transposed": rng.integers(0, 1 << 15, (64, 48), dtype=np.int16).T,
        "strided": rng.integers(0, 1 << 62, 500, dtype=np.int64)[::3],
        "big.strided": rng.integers(0, 1 << 16, CHUNK + 10, dtype=np.uint16)[::2],
    }
    # many small tensors: several of them share a task
    for i in range(300):
        out[f"expert.{i}"] = rng.integers(0, 1 << 16, int(rng.integers(1, 60_000)), dtype=np.uint16)
    return out


@pytest.mark.parametrize("format_version", [1, 2])
def test_parallel_equals_serial_and_the_definition(format_version: int) -> None:
    state = mixed_state()
    experts = [a.nbytes for n, a in state.items() if n.startswith("expert.")]
    # tensors batched into several tasks, and tiny ones (hashed with the GIL held) in a task of their own
    assert sum(b for b in experts if b > GIL_HELD_BYTES) > 2 * TASK_BYTES
    assert sum(b <= GIL_HELD_BYTES for b in experts) > 100
    serial = tensor_digests(state, format_version)
    assert list(serial) == list(state)
    assert serial == {n: reference(a, format_version) for n, a in state.items()}
    assert serial == {n: tensor_digest(a, format_version) for n, a in state.items()}
    with ThreadPoolExecutor(4) as pool:
        assert tensor_digests(state, format_version, mapper=pool.map) == serial
    assert tensor_digests(state, format_version, mapper=lambda f, xs: parallel_map(f, xs, threads=2)) == serial
    assert serial["empty.f32"] == serial["empty.2d"] == xxhash.xxh3_128_hexdigest(b"")
    assert tensor_digests({}, format_version) == {}


class ChunkReader:
    """A tensor held elsewhere (as an accelerator's would be): bytes only through ``read``."""

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self._raw = arr.tobytes()
        self.nbytes = len(self._raw)
        self.reads: list[int] = []

    def read(self, start: int, stop: int) -> bytes:
        self.reads.append(stop - start)
        return self._raw[start:stop]


@pytest.mark.parametrize("format_version", [1, 2])
def test_a_byte_source_is_read_one_chunk_at_a_time(format_version: int) -> None:
    arr = big()
    small = np.arange(100, dtype=np.uint16)
    src, src_small = ChunkReader(arr), ChunkReader(small)
    with ThreadPoolExecutor(2) as pool:
        got = tensor_digests({"w": src, "b": src_small, "h": arr}, format_version, mapper=pool.map)
    assert got == {"w": reference(arr, format_version), "b": reference(small, 1), "h": reference(arr, format_version)}
    assert sorted(src.reads) == [1 << 20, CHUNK] and src_small.reads == [200]


def test_a_failing_task_raises() -> None:
    class Broken(ChunkReader):
        def read(self, start: int, stop: int) -> bytes:
            raise OSError("device lost")

    with pytest.raises(OSError, match="device lost"):
        tensor_digests(
            {"a": np.zeros(10, np.uint8), "w": Broken(big())}, 2, mapper=lambda f, xs: parallel_map(f, xs, 2)
        )


# ---------------------------------------------------------------- the compiled batch hasher

#: lengths around xxh3's internal boundaries (16, 128, 240 bytes; its 1 kB stripes and 64 kB blocks)
RANGE_LENS = [0, 1, 3, 4, 8, 9, 16, 17, 64, 127, 128, 129, 239, 240, 241, 1023, 1024, 1025, 65536, 100_003, 1 << 20]


@pytest.mark.skipif(not kernels.available(), reason="numba cannot be imported here")
@pytest.mark.parametrize("offset", [0, 1, 7])
def test_ranges_equal_python_xxhash_at_every_length_and_alignment(offset: int) -> None:
    rng = np.random.default_rng(offset)
    buf = rng.integers(0, 256, sum(RANGE_LENS) + 64, dtype=np.uint8)
    lens = np.array(RANGE_LENS, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) + offset
    with kernels.using("numba"):
        got = xxh3_128_ranges(buf.ctypes.data + starts, lens, mapper=lambda f, xs: parallel_map(f, xs, threads=3))
    assert got == [xxhash.xxh3_128_hexdigest(buf[a : a + n].tobytes()) for a, n in zip(starts, lens, strict=True)]


@pytest.mark.skipif(not kernels.available(), reason="numba cannot be imported here")
def test_ranges_asked_out_of_address_order_keep_the_callers_order() -> None:
    """Ranges are hashed in address order (prefetch-friendly) but each digest comes back at the
    caller's row: shuffled, repeated and backwards ranges."""
    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, 64 * 1000, dtype=np.uint8)
    starts = rng.permutation(1000)[:300].astype(np.int64) * 64
    starts = np.concatenate([starts, starts[:5], starts[::-1][:7]])
    lens = rng.integers(0, 64 * 5, starts.size).astype(np.int64)
    lens = np.minimum(lens, buf.size - starts)
    want = [xxhash.xxh3_128_hexdigest(buf[a : a + n].tobytes()) for a, n in zip(starts, lens, strict=True)]
    with kernels.using("numba"):
        for threads in (1, 3):
            got = xxh3_128_ranges(
                buf.ctypes.data + starts, lens, mapper=lambda f, xs, t=threads: parallel_map(f, xs, threads=t)
            )
            assert got == want


def test_ranges_say_none_on_the_numpy_fallback() -> None:
    """Without the compiled kernels the caller hashes its buffers itself (it is told so, not given junk)."""
    buf = np.arange(100, dtype=np.uint8)
    with kernels.using("numpy"):
        assert xxh3_128_words(np.array([buf.ctypes.data]), np.array([100])) is None


def test_hex_words_round_trip_and_refuse_what_is_not_a_digest() -> None:
    hexes = [xxhash.xxh3_128_hexdigest(bytes([i])) for i in range(5)]
    words = hex_words(hexes)
    assert words.shape == (5, 2) and words.dtype == np.uint64
    assert words_hex(words) == hexes
    # the high half first: the words order as the hex does
    assert int(words[0, 0]) == int(hexes[0][:16], 16) and int(words[0, 1]) == int(hexes[0][16:], 16)
    with pytest.raises(ValueError):
        hex_words([hexes[0][:31], hexes[1] + "0"])  # 64 characters in all, but not 32 each
    with pytest.raises(ValueError):
        hex_words(["z" * 32])


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("format_version", [1, 2])
def test_packed_digests_equal_the_definition_on_both_backends(backend: str, format_version: int) -> None:
    if backend == "numba" and not kernels.available():
        pytest.skip("numba cannot be imported here")
    rng = np.random.default_rng(3)
    sizes = [0, 5, 64, GIL_HELD_BYTES + 1, 3000, (17 << 20) + 5, 11]
    buf = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    stops = np.cumsum(sizes).tolist()
    starts = [0, *stops[:-1]]
    names = [f"t{i}" for i in range(len(sizes))]
    with kernels.using(backend):  # type: ignore[arg-type]
        got = packed_digests(buf, names, starts, stops, format_version, mapper=ThreadPoolExecutor(2).map)
    assert got == {n: reference(buf[a:b], format_version) for n, a, b in zip(names, starts, stops, strict=True)}


def test_a_hasher_that_disagrees_on_its_probe_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compiled loop would read xxhash's result wrongly (another ABI), digests still come
    out right: the probe's verdict turns the loop off and python-xxhash hashes instead."""
    from deltasync.protocol import digests

    monkeypatch.setattr(digests, "_HASHER_OK", [False])
    buf = np.arange(4096, dtype=np.uint8)
    assert xxh3_128_words(np.array([buf.ctypes.data]), np.array([4096])) is None
    got = packed_digests(buf, ["a", "b"], [0, 1000], [1000, 4096], 2)
    assert got == {"a": reference(buf[:1000], 2), "b": reference(buf[1000:], 2)}
