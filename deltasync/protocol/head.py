"""``HEAD.json``: the hint naming a run's newest committed step (SPEC.md, "Layout")."""

from __future__ import annotations

from dataclasses import dataclass

from deltasync.protocol.canonical import (
    FORMAT_VERSION,
    canonical_json,
    check_version,
    json_digest,
    json_int,
    json_object,
    json_str,
    load_json,
)
from deltasync.protocol.keys import MAX_STEP

__all__ = ["MAX_HEAD_BYTES", "Head"]

MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Head:
    """``HEAD.json``: a hint naming the newest committed step. The manifests are the truth."""

    step: int
    manifest_digest: str
    run_id: str
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return canonical_json(
            {
                "format_version": self.format_version,
                "step": self.step,
                "manifest_digest": self.manifest_digest,
                "run_id": self.run_id,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> Head:
        """Parse and validate."""
        raw = load_json(data, "HEAD.json", MAX_HEAD_BYTES)
        check_version(raw, "HEAD.json")
        o = json_object(raw, "HEAD.json", ("format_version", "step", "manifest_digest", "run_id"))
        return cls(
            json_int(o["step"], "HEAD step", 0, MAX_STEP),
            json_digest(o["manifest_digest"], "HEAD digest"),
            json_str(o["run_id"], "run_id"),
        )
