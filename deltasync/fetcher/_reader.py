"""Reading committed steps: manifests (cached), verified file downloads, decoded changes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.errors import ChecksumMismatch, ObjectNotFound, ProtocolError
from deltasync.protocol import (
    AnchorEntry,
    Committed,
    Manifest,
    PatchEntry,
    decode_positions,
    decode_values,
    file_key,
    manifest_key,
    xxh3_128,
)
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.keys import STEPS_PREFIX, parse_manifest_key
from deltasync.protocol.safetensors_io import parse_safetensors
from deltasync.storage import Store

__all__ = ["DecodedChange", "StepReader"]

Bits = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class DecodedChange:
    """One tensor's decoded change: positions, a value stream and how to combine it with old bits."""

    tensor: str
    idx: Bits
    values: Bits
    coding: str


class StepReader:
    """Loads and checks what a store holds for one run. Manifests are immutable, so cached."""

    def __init__(self, store: Store, *, verify: bool, signing_key: bytes | None) -> None:
        self.store = store
        self.verify = verify
        self.signing_key = signing_key
        self._manifests: dict[int, Committed] = {}

    def steps(self) -> list[int]:
        """Committed steps, ascending (a step is committed iff its manifest exists)."""
        return sorted(s for o in self.store.list(STEPS_PREFIX) if (s := parse_manifest_key(o.key)) is not None)

    def committed(self, step: int) -> Committed:
        """The parsed manifest of ``step`` and its digest (signature checked when a key is set)."""
        hit = self._manifests.get(step)
        if hit is None:
            body = self.store.get(manifest_key(step))
            m = Manifest.from_json(body)
            if m.step != step:
                raise ProtocolError(f"manifest stored under step {step} says step {m.step}")
            if self.signing_key is not None:
                m.check_signature(self.signing_key)
            hit = self._manifests[step] = Committed(m, xxh3_128(body))
        return hit

    def forget(self, steps: Iterable[int]) -> None:
        """Drop cached manifests (after a failure they may be the bad bytes)."""
        for step in steps:
            self._manifests.pop(step, None)

    def chain(self, target: int, also: int | None = None) -> dict[int, Committed]:
        """Manifests along the parent walk from ``target`` down to the first anchor (plus ``also``)."""
        out: dict[int, Committed] = {}
        cur: int | None = target
        while cur is not None and cur not in out:
            try:
                c = self.committed(cur)
            except ObjectNotFound:
                break
            out[cur] = c
            cur = None if c.manifest.kind == "anchor" else c.manifest.parent_step
        if also is not None and also not in out:
            with contextlib.suppress(ObjectNotFound):
                out[also] = self.committed(also)
        return out

    def download(self, m: Manifest, progress: Callable[[int], None] | None = None) -> dict[str, bytes]:
        """All data files of a step, sizes and xxh3-128 checked (checksums only when verifying)."""
        keys = {file_key(m.step, f.path): f for f in m.files}
        blobs = self.store.get_many(list(keys))
        out: dict[str, bytes] = {}
        for key, info in keys.items():
            data = blobs[key]
            if len(data) != info.size:
                raise ChecksumMismatch(
                    f"step {m.step}: file {info.path} is {len(data)} bytes, manifest says {info.size} (truncated or replaced)"
                )
            if self.verify and xxh3_128(data) != info.xxh3_128:
                raise ChecksumMismatch(f"step {m.step}: file {info.path} fails its xxh3-128 checksum (corrupted)")
            out[info.path] = data
            if progress:
                progress(len(data))
        return out

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
