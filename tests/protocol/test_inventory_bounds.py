"""A format-2 inventory decompresses to at most max(1 MiB, 256 x its compressed frame) (256 MiB at
most), checked from the frame's header before zstd runs, and is inflated a little at a time, refused
as soon as it yields more than it declared (issue 45, point 4; SPEC.md "Manifest, format 2")."""

from __future__ import annotations

import base64
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import zstandard
from inventory_bombs import lying_frame, lying_manifest, small_manifest_declaring, valid_manifest, with_inventory

from deltasync.errors import ProtocolError
from deltasync.protocol import Manifest, TensorInfo
from deltasync.protocol import manifest_v2 as v2
from deltasync.protocol.canonical import canonical_json

MiB = 1 << 20


def peak_of(call: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``call`` raised and the peak of the memory Python allocated meanwhile."""
    tracemalloc.start()
    try:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            return exc, tracemalloc.get_traced_memory()[1]
        return None, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(autouse=True)
def _no_parse_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v2, "_PARSED", {})


def frame_of(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=19, write_content_size=True).compress(raw)


def test_the_bound() -> None:
    assert v2.inventory_bound(0) == v2.inventory_bound(4096) == MiB
    assert v2.inventory_bound(10 * 1024) == 2560 * 1024
    assert v2.inventory_bound(MiB) == v2.MAX_INVENTORY_BYTES == 256 * MiB


def test_a_4_kib_manifest_declaring_32_mib_is_refused_from_its_header() -> None:
    body = small_manifest_declaring(32 * MiB)
    assert len(body) < 5 * 1024
    raised, peak = peak_of(lambda: Manifest.from_json(body))
    assert isinstance(raised, ProtocolError)
    assert "declares 33554431 bytes, over the 1048576-byte bound" in str(raised)
    assert peak < MiB  # before: +350 MiB (issue 45), +722 MiB of RSS for this very frame


@pytest.mark.parametrize("declared", [100, 1000, 900 * 1024])
def test_a_frame_header_that_lies_is_refused_before_it_inflates_far(declared: int) -> None:
    body = lying_manifest(32 * MiB, declared)
    raised, peak = peak_of(lambda: Manifest.from_json(body))
    assert isinstance(raised, ProtocolError), raised
    assert "inventory" in str(raised)
    assert peak < declared + 10 * MiB  # one feed of compressed bytes past what it declared, at most


def test_a_lying_frame_is_refused_by_decode_inventory_too() -> None:
    frame = lying_frame(64, 4 * MiB)
    with pytest.raises(ProtocolError, match="inventory"):
        v2.decode_inventory(base64.b64encode(frame).decode(), "test")


def test_up_to_the_floor_is_read_and_a_byte_more_is_not() -> None:
    at_floor = b"[" + b" " * (v2.INVENTORY_FLOOR_BYTES - 2) + b"]"
    frame = frame_of(at_floor)
    assert 256 * len(frame) < v2.INVENTORY_FLOOR_BYTES  # so the floor is the bound
    assert v2.decode_inventory(base64.b64encode(frame).decode(), "test") == ()
    over = frame_of(at_floor + b" ")
    with pytest.raises(ProtocolError, match="declares 1048577 bytes, over the 1048576-byte bound"):
        v2.decode_inventory(base64.b64encode(over).decode(), "test")


def test_nothing_may_follow_the_frame() -> None:
    frame = frame_of(canonical_json([{"dtype": "F32", "name": "w", "shape": [4, 4]}]))
    assert v2.decode_inventory(base64.b64encode(frame).decode(), "t") == (TensorInfo("w", "F32", (4, 4)),)
    for tail in (b"x", frame, b"\x00" * 300):
        with pytest.raises(ProtocolError, match="inventory"):
            v2.decode_inventory(base64.b64encode(frame + tail).decode(), "t")


def test_a_large_moe_inventory_compressing_132x_is_read() -> None:
    """The most compressible inventory measured: a 94-layer, 128-expert MoE (36,945 tensors)."""
    inv = [TensorInfo("lm_head.weight", "BF16", (151936, 4096))]
    for layer in range(94):
        for e in range(128):
            for proj in ("down_proj", "gate_proj", "up_proj"):
                inv.append(TensorInfo(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", "BF16", (1536, 4096)))
        inv.append(TensorInfo(f"model.layers.{layer}.mlp.gate.weight", "BF16", (128, 4096)))
    inv.sort(key=lambda t: t.name)
    packed, digest = v2.inventory_fields(inv)
    frame = base64.b64decode(packed)
    ratio = zstandard.frame_content_size(frame) / len(frame)
    assert 60 < ratio < v2.INVENTORY_RATIO
    assert v2.decode_inventory_digest(packed, "moe") == (tuple(inv), digest)


def test_a_valid_manifest_still_reads() -> None:
    assert Manifest.from_json(valid_manifest()).inventory == (TensorInfo("w", "F32", (4, 4)),)
    again = with_inventory(frame_of(canonical_json([{"dtype": "F32", "name": "w", "shape": [4, 4]}])))
    assert Manifest.from_json(again).inventory == (TensorInfo("w", "F32", (4, 4)),)
