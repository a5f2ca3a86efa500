"""Format-2 manifests whose zstd inventory inflates (issue 45, point 4): one that declares far more
than its size allows, and one whose frame header lies (declares a few bytes, holds megabytes)."""

from __future__ import annotations

import base64
import dataclasses
import json
import struct

import numpy as np
import zstandard

from deltasync.protocol import TensorInfo
from deltasync.protocol.canonical import canonical_json


def valid_manifest(step: int = 1) -> bytes:
    """A valid format-2 anchor manifest of one 4x4 F32 tensor (~640 bytes)."""
    from manifests import anchor_manifest

    m, _ = anchor_manifest([TensorInfo("w", "F32", (4, 4))], {"w": np.zeros(16, dtype=np.uint32)}, step=step)
    body: bytes = dataclasses.replace(m, format_version=2).to_json()
    return body


def with_inventory(frame: bytes, step: int = 1) -> bytes:
    """:func:`valid_manifest` with its inventory replaced by ``frame`` (base64)."""
    o = json.loads(valid_manifest(step))
    o["inventory"] = base64.b64encode(frame).decode()
    return canonical_json(o)


def many_dicts(n: int) -> bytes:
    """``[{},{},...]`` of ``n`` bytes (give or take 2): ~25 bytes of Python objects per byte once parsed."""
    k = max(1, (n - 1) // 3)
    return b"[" + b"{}," * (k - 1) + b"{}]"


def small_manifest_declaring(n: int) -> bytes:
    """A manifest of a few KiB whose inventory frame honestly declares (and holds) ``n`` bytes."""
    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(many_dicts(n))
    return with_inventory(frame)


def lying_frame(declared: int, n: int) -> bytes:
    """A zstd frame that declares ``declared`` content bytes but inflates to ``n``."""
    frame = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(many_dicts(n))
    fhd = frame[4]
    assert fhd & 0xE3 == 0, "expected no content size, no single segment, no dictionary"
    # Frame_Content_Size_flag 2: a 4-byte content size after the window descriptor
    out = frame[:4] + bytes([fhd | 0x80]) + frame[5:6] + struct.pack("<I", declared) + frame[6:]
    assert zstandard.frame_content_size(out) == declared
    return out


def lying_manifest(n: int, declared: int = 100) -> bytes:
    """A manifest whose inventory frame declares ``declared`` bytes and inflates to ``n``."""
    return with_inventory(lying_frame(declared, n))


__all__ = [
    "lying_frame",
    "lying_manifest",
    "many_dicts",
    "small_manifest_declaring",
    "valid_manifest",
    "with_inventory",
]
