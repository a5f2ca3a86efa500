"""The compiled kernels against the numpy fallback: the same bytes, the same arrays, the same errors.

Golden digests below were taken from the numpy encoder as it was before the kernels
existed (commit dedbbaa), so "byte-identical" is checked against the old format's
writer, not against whatever the fallback does today.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.errors import ProtocolError
from deltasync.fetcher._apply import Undo
from deltasync.fetcher._target import HostTensor
from deltasync.protocol import EncodedTensor, decode_positions, decode_values, encode_changes, kernels
from deltasync.protocol.encoding import apply_values
from deltasync.uploader._diff import diff_tensor
from tests.kernel_streams import change_stream

pytest.importorskip("numba", reason="the numba kernels are what this module compares with the fallback")

Arr = np.ndarray[Any, np.dtype[Any]]
BOTH = ("numba", "numpy")

# (seed, numel, density, width, count, positions, rice_k, values, xxh3-128 of pos_blob | val_blob)
GOLDEN = [
    (1, 3000000, 0.01, 2, 36001, "rice-z", 6, "xor-rank", "7132d56b0db758350a8748a18e025ff5"),
    (2, 1000000, 0.1, 2, 120001, "rice-z", 2, "xor-rank", "27a40aa423ddb004a9aefd2f96a5678b"),
    (3, 200000, 0.6, 2, 94069, "rice-z", 0, "xor-rank", "d0c9ae88291cd5725172fafb18d5d908"),
    (4, 60000000, 0.0002, 2, 14401, "rice-z", 11, "xor-rank", "efb404f651c44fb8017e48f114138c87"),
    (5, 500000, 0.05, 4, 30001, "rice-z", 3, "xor-rank", "f86ba6893a1b2adb717726bff23d032b"),
    (6, 300000, 0.2, 1, 68791, "rice-z", 1, "xor-rank", "4814a164d44d21be1c3916ea847ecd9d"),
    (7, 5000, 0.3, 2, 1782, "rice", 1, "xor-rank", "0fdfb468faae8bf03d78f8897fada440"),
    (8, 2000000, 0.7, 2, 2000000, "dense", 0, "xor-rank", "ecf030dad6a1f6aa9ca13e88998da03b"),
]


@pytest.fixture(autouse=True, scope="module")
def _restore_backend() -> Iterator[None]:
    before = kernels.backend()
    yield
    kernels.set_backend(before)


def _encode(backend: str, numel: int, idx: Arr, old: Arr, new: Arr) -> EncodedTensor:
    with kernels.using(backend):  # type: ignore[arg-type]
        return encode_changes(numel, idx, old, new)


def _decode(backend: str, e: EncodedTensor, numel: int, bits: np.dtype[Any]) -> tuple[Arr, Arr]:
    with kernels.using(backend):  # type: ignore[arg-type]
        pos = decode_positions(e.pos_blob, e.positions, e.rice_k, e.count, numel, "t")
        return pos, decode_values(e.val_blob, e.values, e.count, bits, "t")


def test_the_kernels_are_in_use_by_default() -> None:
    assert kernels.backend() == "numba"


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("case", GOLDEN, ids=[f"seed{c[0]}-{c[5]}-w{c[3]}" for c in GOLDEN])
def test_golden_streams_encode_to_the_old_bytes(backend: str, case: tuple[Any, ...]) -> None:
    seed, numel, density, width, count, positions, k, values, digest = case
    idx, old, new = change_stream(seed, numel, density, width)
    e = _encode(backend, numel, idx, old, new)
    assert (e.count, e.positions, e.rice_k, e.values) == (count, positions, k, values)
    assert xxhash.xxh3_128_hexdigest(e.pos_blob + b"|" + e.val_blob) == digest
    for reader in BOTH:  # an old (numpy) reader reads new patches and the other way round
        pos, vals = _decode(reader, e, numel, old.dtype)
        if positions == "dense":
            dense = np.zeros(numel, dtype=old.dtype)
            dense[idx] = old ^ new
            assert np.array_equal(vals, dense)
        else:
            assert np.array_equal(pos, idx)
            assert np.array_equal(apply_values(values, old, vals), new)


@st.composite
def changes(draw: st.DrawFn) -> tuple[int, Arr, Arr, Arr]:
    width = draw(st.sampled_from([1, 2, 2, 4]))
    numel = draw(st.integers(1, 40_000))
    n = draw(st.integers(1, min(numel, 9_000)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    clustered = draw(st.booleans())
    if clustered:
        start = int(rng.integers(0, numel - n + 1))
        idx = np.arange(start, start + n, dtype=np.int64)
    else:
        idx = np.sort(rng.choice(numel, n, replace=False)).astype(np.int64)
    bits = np.dtype(f"<i{width}")
    old = rng.integers(0, 1 << (8 * width), n, dtype=np.uint64).astype(f"<u{width}").view(bits)
    spread = draw(st.sampled_from([3, 40, 1 << (8 * width - 1)]))
    flip = (rng.integers(1, spread, n, dtype=np.int64) if spread > 1 else np.ones(n, np.int64)).astype(f"<u{width}")
    flip[flip == 0] = 1
    return numel, idx, old, old ^ flip.view(bits)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes())
def test_any_change_encodes_alike_and_decodes_everywhere(c: tuple[int, Arr, Arr, Arr]) -> None:
    numel, idx, old, new = c
    a, b = _encode("numpy", numel, idx, old, new), _encode("numba", numel, idx, old, new)
    assert a == b
    got = [_decode(be, a, numel, old.dtype) for be in BOTH]
    assert all(np.array_equal(x, y) for x, y in zip(got[0], got[1], strict=True))


def _flip(blob: bytes, at: int, mask: int) -> bytes:
    out = bytearray(blob)
    out[at % len(out)] ^= mask or 1
    return bytes(out)


def _outcome(backend: str, e: EncodedTensor, numel: int, bits: np.dtype[Any]) -> tuple[str, Any]:
    try:
        pos, vals = _decode(backend, e, numel, bits)
    except ProtocolError:
        return "error", None
    return "ok", (pos.tobytes(), vals.tobytes())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(0, 1 << 30), st.integers(0, 255), st.booleans(), st.integers(-3, 3))
def test_corrupt_streams_fail_alike(seed: int, at: int, mask: int, in_positions: bool, count_delta: int) -> None:
    """A flipped byte or a wrong count: both decoders raise ProtocolError, or both decode the same."""
    numel = 20_000
    idx, old, new = change_stream(seed, numel, [0.3, 0.05, 0.002][seed % 3], 2)
    e = encode_changes(numel, idx, old, new)
    if in_positions and e.pos_blob:
        e = EncodedTensor(e.count, e.positions, e.rice_k, e.values, _flip(e.pos_blob, at, mask), e.val_blob)
    else:
        e = EncodedTensor(e.count, e.positions, e.rice_k, e.values, e.pos_blob, _flip(e.val_blob, at, mask))
    if count_delta and e.positions != "dense":
        e = EncodedTensor(max(1, e.count + count_delta), e.positions, e.rice_k, e.values, e.pos_blob, e.val_blob)
    assert _outcome("numba", e, numel, old.dtype) == _outcome("numpy", e, numel, old.dtype)


@pytest.mark.parametrize("density", [0.0, 1e-4, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_diff_kernel_matches_numpy(density: float, width: int) -> None:
    torch = pytest.importorskip("torch")
    numel = 300_001  # several kernel chunks, with a ragged end
    rng = np.random.default_rng(7)
    bits = np.dtype(f"<i{width}")
    base = rng.integers(0, 1 << (8 * width), numel, dtype=np.uint64).astype(f"<u{width}").view(bits)
    new = base.copy()
    hit = rng.random(numel) < density
    new[hit] ^= np.array(1, dtype=bits)
    out = {}
    for be in BOTH:
        b = torch.from_numpy(base.copy())
        with kernels.using(be):  # type: ignore[arg-type]
            c = diff_tensor(b, torch.from_numpy(new))
        assert np.array_equal(b.numpy(), new)  # the baseline took the new bits
        out[be] = None if c is None else (c.idx.tobytes(), c.old.tobytes(), c.new.tobytes())
    assert out["numba"] == out["numpy"]
    assert (out["numba"] is None) == (not hit.any())


@pytest.mark.parametrize(("width", "distinct", "n"), [(1, 3, 10), (1, 256, 5000), (2, 40, 999), (2, 4000, 20000)])
def test_rank_table_kernel_ranks_as_numpy(width: int, distinct: int, n: int) -> None:
    """The compiled histogram + ranking gives the table and lookup numpy's bincount + stable argsort
    give: most frequent first, equal counts by value (ties on purpose: few counts, many values), the
    table cut at 255 entries."""
    from deltasync.protocol import _numba_kernels as nk
    from deltasync.protocol.values import _table_of_counts

    rng = np.random.default_rng(distinct)
    u = np.dtype(f"u{width}")
    pool = rng.choice(1 << (8 * width), distinct, replace=False).astype(u)
    xor = pool[rng.integers(0, distinct, n) % rng.integers(1, distinct + 1, n)]  # skewed, with ties
    old = rng.integers(0, 1 << (8 * width), n).astype(u)
    new = old ^ xor
    order, lut = nk.xor_rank_table(old, new, 1 << (8 * width))
    want_order, want_lut = _table_of_counts(np.bincount(xor, minlength=1 << (8 * width)))
    assert order.tolist() == want_order.tolist()
    assert np.array_equal(lut, want_lut)
    assert order.size == min(255, np.unique(xor).size)


@pytest.mark.parametrize("coding", ["xor-rank", "raw"])
def test_apply_kernel_writes_and_rolls_back(coding: str) -> None:
    from deltasync.protocol import DecodedEntry, PatchEntry
    from deltasync.protocol.manifest import ByteRange

    numel = 100_000
    idx, old, new = change_stream(3, numel, 0.1, 2)
    rng = np.random.default_rng(1)
    target = rng.integers(0, 1 << 16, numel, dtype=np.uint64).astype("<u2").view("<i2")
    target[idx] = old
    before = target.copy()
    vals = (old ^ new) if coding == "xor-rank" else new
    entry = PatchEntry("w", "f", int(idx.size), "rice-z", 0, coding, ByteRange(0, 0), ByteRange(0, 0))  # type: ignore[arg-type]
    for be in BOTH:
        with kernels.using(be):  # type: ignore[arg-type]
            undo = Undo()
            undo.put(HostTensor(target), DecodedEntry(entry, idx, vals))
            assert np.array_equal(target[idx], new)
            undo.rollback()
            assert np.array_equal(target, before)


def test_numpy_is_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    code = "from deltasync.protocol import kernels; print(kernels.backend())"
    env = {"DELTASYNC_KERNELS": "numpy"}
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.stdout.strip() == "numpy", out.stderr
    # numba missing (no wheel for the platform): the fallback is chosen on its own, and works
    gone = "import sys; sys.modules['numba'] = None; " + code + "; from tests.kernel_streams import change_stream; "
    gone += "from deltasync.protocol import encode_changes; print(encode_changes(9000, *change_stream(1, 9000, 0.5, 2)).count)"
    out = subprocess.run([sys.executable, "-c", gone], env=os.environ, capture_output=True, text=True)
    assert out.stdout.split() == ["numpy", str(change_stream(1, 9000, 0.5, 2)[0].size)], out.stderr
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "DELTASYNC_KERNELS": "fast"}, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "expected auto, numba or numpy" in bad.stderr


_ROUNDTRIP = """
import sys, torch, deltasync as ds
from deltasync.protocol import kernels
store, steps = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(5)
state = {f"w{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate([70_001, 9_000, 3])}
if sys.argv[3] == "push":
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, on_backlog="block", span_levels=()) as up:
        for step in range(steps):
            for t in state.values():
                hit = torch.rand(t.numel(), generator=g) < 0.2
                t[hit] = (t[hit].float() * 1.01).to(torch.bfloat16)
            up.push(state, step)
        up.flush()
    torch.save(state, store + "/../want.pt")
else:
    want = torch.load(store + "/../want.pt")
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    assert ds.DeltaFetcher(store, verify="full").sync(target) == steps - 1
    assert all(torch.equal(target[k].view(torch.int16), want[k].view(torch.int16)) for k in want)
print(kernels.backend())
"""


@pytest.mark.parametrize(("writer", "reader"), [("numpy", "numpy"), ("numpy", "auto"), ("auto", "numpy")])
def test_a_run_written_by_one_implementation_reads_with_the_other(tmp_path: Any, writer: str, reader: str) -> None:
    """The whole uploader -> store -> fetcher path on the fallback, and across implementations."""
    import os
    import subprocess
    import sys

    store = str(tmp_path / "run")
    for role, backend in (("push", writer), ("sync", reader)):
        env = {**os.environ, "DELTASYNC_KERNELS": backend}
        out = subprocess.run(
            [sys.executable, "-c", _ROUNDTRIP, store, "5", role], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == ("numba" if backend == "auto" else backend)


@pytest.mark.parametrize("pool", [True, False], ids=["on-a-pool", "small-so-inline"])
def test_parallel_apply_logs_every_write_when_one_tensor_fails(pool: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """threads > 1: a tensor whose write fails does not lose the undo bits of those written beside it
    (on a pool; or, a change this small, on the calling thread, which stops at the failure)."""
    from deltasync.fetcher import _apply
    from deltasync.fetcher._apply import apply_changes

    monkeypatch.setattr(_apply, "INLINE_POSITIONS", 0 if pool else 1 << 20)
    from deltasync.protocol import DecodedEntry, PatchEntry
    from deltasync.protocol.manifest import ByteRange

    class Broken(HostTensor):
        def apply(self, c: Any) -> Arr:
            raise ProtocolError("refused")

    rng = np.random.default_rng(3)
    arrays = {n: rng.integers(0, 1 << 16, 50_000, dtype=np.uint64).astype("<u2").view("<i2") for n in "abcd"}
    before = {n: a.copy() for n, a in arrays.items()}
    slots = {n: (Broken if n == "c" else HostTensor)(a, key=n) for n, a in arrays.items()}
    changes = []
    for n in "abcd":
        idx = np.arange(0, 50_000, 7, dtype=np.int64)
        entry = PatchEntry(n, "f", int(idx.size), "rice-z", 0, "xor-rank", ByteRange(0, 0), ByteRange(0, 0))
        changes.append(DecodedEntry(entry, idx, np.full(idx.size, 5, dtype="<i2")))
    undo = Undo()
    with pytest.raises(ProtocolError, match="refused"):
        apply_changes(slots, changes, undo, threads=3)
    assert undo.names == ({"a", "b", "d"} if pool else {"a", "b"})
    assert not np.array_equal(arrays["a"], before["a"])
    undo.rollback()
    assert all(np.array_equal(arrays[n], before[n]) for n in arrays)
