"""Who writes a run (SPEC.md "Single writer"): the writer a manifest names, and the claims
under ``writers/`` with which an uploader takes a run over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltasync.protocol.canonical import (
    FORMAT_VERSION,
    canonical_json,
    check_version,
    json_int,
    json_object,
    json_str,
    load_json,
)
from deltasync.protocol.keys import MAX_STEP

__all__ = ["MAX_CLAIM_BYTES", "Writer", "WriterClaim"]

#: the most bytes a writer claim may hold (SPEC.md "Manifest")
MAX_CLAIM_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Writer:
    """The uploader that wrote a step: a random id and the epoch it claimed (SPEC.md "Single writer")."""

    id: str
    epoch: int

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"id": self.id, "epoch": self.epoch}

    @classmethod
    def from_json(cls, v: Any) -> Writer:
        """Parse and validate."""
        o = json_object(v, "writer", ("id", "epoch"))
        return cls(json_str(o["id"], "writer id"), json_int(o["epoch"], "writer epoch", 0, MAX_STEP))


@dataclass(frozen=True, slots=True)
class WriterClaim:
    """``writers/{epoch}.json``: an uploader took over the run at ``after_step`` (SPEC.md "Single writer")."""

    epoch: int
    writer: str
    after_step: int | None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return canonical_json(
            {
                "format_version": self.format_version,
                "epoch": self.epoch,
                "writer": self.writer,
                "after_step": self.after_step,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> WriterClaim:
        """Parse and validate."""
        raw = load_json(data, "writer claim", MAX_CLAIM_BYTES)
        check_version(raw, "writer claim")
        o = json_object(raw, "writer claim", ("format_version", "epoch", "writer", "after_step"))
        after = None if o["after_step"] is None else json_int(o["after_step"], "after_step", 0, MAX_STEP)
        return cls(json_int(o["epoch"], "epoch", 1, MAX_STEP), json_str(o["writer"], "writer"), after)
