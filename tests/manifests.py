"""Manifests built the way the protocol builds them, for tests that need a valid step without an uploader."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def anchor_manifest(inventory: Sequence[Any], arrays: Mapping[str, Any], step: int = 0) -> tuple[Any, dict[str, bytes]]:
    """A valid anchor ``step`` of ``arrays`` (flat bit arrays by name): its manifest (parsed back from
    its JSON, no tensor digests) and its files, as the protocol builds them."""
    from deltasync.protocol import FileInfo, Manifest, Stats, inventory_digest, xxh3_128
    from deltasync.protocol.checkpoint import build_checkpoint

    inv = tuple(inventory)
    files, entries = build_checkpoint(inv, arrays, 1 << 20)
    infos = tuple(FileInfo(n, len(d), xxh3_128(d)) for n, d in sorted(files.items()))
    numel = sum(t.numel for t in inv)
    m = Manifest(
        run_id="r",
        step=step,
        kind="anchor",
        parent_step=None,
        parent_digest=None,
        anchor_step=step,
        inventory=inv,
        inventory_digest=inventory_digest(inv),
        files=infos,
        entries=tuple(entries),
        tensor_digests={},
        stats=Stats(numel, numel, sum(f.size for f in infos)),
    )
    return Manifest.from_json(m.to_json()), files
