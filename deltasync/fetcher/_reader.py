"""Downloading a plan's files (one batch, checked) and decoding them. Manifests: :class:`deltasync.storage.RunReader`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.errors import ChecksumMismatch, ProtocolError
from deltasync.protocol import (
    AnchorEntry,
    Manifest,
    PatchEntry,
    decode_positions,
    decode_values,
    file_key,
    xxh3_128,
)
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.safetensors_io import parse_safetensors
from deltasync.storage import Store

__all__ = ["DecodedChange", "StepDecoder", "download"]

Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class DecodedChange:
    """One tensor's decoded change: positions, a value stream and how to combine it with old bits."""

    tensor: str
    idx: Bits
    values: Bits
    coding: str


def download(
    store: Store, manifests: Sequence[Manifest], *, verify: bool, progress: Callable[[int], None] | None = None
) -> list[dict[str, bytes]]:
    """All data files of ``manifests`` in one batch, sizes and (when verifying) xxh3-128 checked.

    Returns one ``{file name: bytes}`` per manifest. Nothing is decoded here.
    """
    keys = {file_key(m.step, f.path): (i, f) for i, m in enumerate(manifests) for f in m.files}
    blobs = store.get_many(list(keys)) if keys else {}
    out: list[dict[str, bytes]] = [{} for _ in manifests]
    for key, (i, info) in keys.items():
        data = blobs[key]
        step = manifests[i].step
        if len(data) != info.size:
            raise ChecksumMismatch(
                f"step {step}: file {info.path} is {len(data)} bytes, manifest says {info.size} (truncated or replaced)"
            )
        if verify and xxh3_128(data) != info.xxh3_128:
            raise ChecksumMismatch(f"step {step}: file {info.path} fails its xxh3-128 checksum (corrupted)")
        out[i][info.path] = data
        if progress:
            progress(len(data))
    return out


class StepDecoder:
    """Turns a step's downloaded files into arrays (anchors) or decoded changes (patches)."""

    @staticmethod
    def anchor_arrays(m: Manifest, files: dict[str, bytes]) -> dict[str, Bits]:
        """Flat bit arrays (read-only views into ``files``) of every tensor of an anchor."""
        parsed = {
            name: parse_safetensors(data, what=f"step {m.step} {name}")
            for name, data in files.items()
            if name.endswith(".safetensors")
        }
        inv = {t.name: t for t in m.inventory}
        out: dict[str, Bits] = {}
        for e in m.entries:
            assert isinstance(e, AnchorEntry)  # kind == "anchor" was checked by Manifest.from_json
            st = parsed.get(e.file)
            info = inv[e.tensor]
            ent = st.entries.get(e.tensor) if st else None
            if (
                ent is None
                or (ent.start, ent.end) != (e.range.start, e.range.end)
                or ent.dtype != info.dtype
                or ent.shape != info.shape
            ):
                raise ProtocolError(
                    f"step {m.step}: anchor file {e.file} does not hold {e.tensor!r} where the manifest says"
                )
            out[e.tensor] = np.frombuffer(
                files[e.file], dtype=dtype_info(info.dtype).bits, count=info.numel, offset=e.range.start
            )
        missing = sorted(set(inv) - set(out))
        if missing:
            raise ProtocolError(f"step {m.step}: anchor holds no bytes for tensors {missing[:5]} of its inventory")
        return out

    @staticmethod
    def decode_patch(m: Manifest, files: dict[str, bytes]) -> list[DecodedChange]:
        """Decode every entry of a patch (nothing is applied; errors leave targets untouched)."""
        inv = {t.name: t for t in m.inventory}
        parsed = {name: parse_safetensors(data, what=f"step {m.step} {name}") for name, data in files.items()}
        out: list[DecodedChange] = []
        for e in m.entries:
            assert isinstance(e, PatchEntry)
            ents = parsed[e.file].entries
            for suffix, r in (("positions", e.positions_range), ("values", e.values_range)):
                st = ents.get(f"{e.tensor}/{suffix}")
                if st is None or (st.start, st.end) != (r.start, r.end):
                    raise ProtocolError(
                        f"step {m.step}: {e.file} has no {e.tensor}/{suffix} entry where the manifest says"
                    )
            info = inv[e.tensor]
            data = memoryview(files[e.file])
            what = f"step {m.step} tensor {e.tensor!r}"
            idx = decode_positions(
                data[e.positions_range.start : e.positions_range.end], e.positions, e.rice_k, e.count, info.numel, what
            )
            vals = decode_values(
                data[e.values_range.start : e.values_range.end], e.values, e.count, dtype_info(info.dtype).bits, what
            )
            out.append(DecodedChange(e.tensor, idx, vals, e.values))
        return out
