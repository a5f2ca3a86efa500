"""The records a manifest is made of: the tensor inventory, data files, byte ranges, patch and
anchor entries, stats (SPEC.md, "Manifest")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deltasync.protocol.canonical import (
    canonical_json,
    field_error,
    json_digest,
    json_int,
    json_list,
    json_object,
    json_str,
)
from deltasync.protocol.digests import xxh3_128
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.keys import check_file_name

__all__ = ["AnchorEntry", "ByteRange", "FileInfo", "PatchEntry", "Stats", "TensorInfo", "inventory_digest"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the inventory: name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Size of the tensor's raw bytes."""
        return self.numel * dtype_info(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, v: Any) -> TensorInfo:
        """Parse and validate."""
        o = json_object(v, "inventory entry", ("name", "dtype", "shape"))
        name = json_str(o["name"], "tensor name")
        dtype_info(o["dtype"])
        shape = tuple(json_int(s, f"shape of {name!r}", 0, 2**48) for s in json_list(o["shape"], f"shape of {name!r}"))
        if len(shape) > 64:
            raise field_error(f"shape of {name!r}", "more than 64 dimensions")
        return cls(name, o["dtype"], shape)


def inventory_digest(inventory: Sequence[TensorInfo]) -> str:
    """xxh3-128 of the canonical JSON of the inventory (sorted by name)."""
    return xxh3_128(canonical_json([t.to_json() for t in sorted(inventory, key=lambda t: t.name)]))


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A data file of the step: plain name inside the step folder, size, xxh3-128."""

    path: str
    size: int
    xxh3_128: str

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"path": self.path, "size": self.size, "xxh3_128": self.xxh3_128}

    @classmethod
    def from_json(cls, v: Any) -> FileInfo:
        """Parse and validate (rejects any path that is not one plain segment)."""
        o = json_object(v, "file entry", ("path", "size", "xxh3_128"))
        return cls(
            check_file_name(o["path"]), json_int(o["size"], "file size"), json_digest(o["xxh3_128"], "file digest")
        )


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Half-open byte range ``[start, end)`` within a file."""

    start: int
    end: int

    @property
    def length(self) -> int:
        """Number of bytes."""
        return self.end - self.start

    def to_json(self) -> list[int]:
        """JSON form: ``[start, end]``."""
        return [self.start, self.end]

    @classmethod
    def from_json(cls, v: Any, what: str) -> ByteRange:
        """Parse and validate."""
        lst = json_list(v, what)
        if len(lst) != 2:
            raise field_error(what, "a byte range is [start, end]")
        a, b = json_int(lst[0], what), json_int(lst[1], what)
        if b < a:
            raise field_error(what, f"range end {b} before start {a}")
        return cls(a, b)


@dataclass(frozen=True, slots=True)
class PatchEntry:
    """Where and how one tensor's change (or a group's, format 2) is coded in a patch file.

    ``members``: format 2's group, the tensors whose concatenated flat elements the entry codes,
    in that order (all of one dtype); empty for a one-tensor entry. ``tensor`` is the first
    member (it names the blobs in the patch file).
    """

    tensor: str
    file: str
    count: int
    positions: Literal["rice", "rice-z", "dense"]
    rice_k: int
    values: Literal["xor-rank", "raw"]
    positions_range: ByteRange
    values_range: ByteRange
    members: tuple[str, ...] = ()

    @property
    def tensors(self) -> tuple[str, ...]:
        """The tensors the entry codes, in the order of their elements."""
        return self.members or (self.tensor,)

    def to_json(self) -> dict[str, Any]:
        """JSON form (format 1: one tensor)."""
        if len(self.members) > 1:
            raise ValueError(f"patch entry {self.tensor!r} codes a group of tensors: format 1 cannot write it")
        return {
            "tensor": self.tensor,
            "file": self.file,
            "count": self.count,
            "positions": self.positions,
            "rice_k": self.rice_k,
            "values": self.values,
            "positions_range": self.positions_range.to_json(),
            "values_range": self.values_range.to_json(),
        }

    @classmethod
    def from_json(cls, v: Any) -> PatchEntry:
        """Parse and validate."""
        keys = ("tensor", "file", "count", "positions", "rice_k", "values", "positions_range", "values_range")
        o = json_object(v, "patch entry", keys)
        name = json_str(o["tensor"], "patch entry tensor")
        if o["positions"] not in ("rice", "rice-z", "dense") or o["values"] not in ("xor-rank", "raw"):
            raise field_error(f"patch entry {name!r}", f"unknown coding {o['positions']!r}/{o['values']!r}")
        return cls(
            name,
            check_file_name(o["file"]),
            json_int(o["count"], "count", 1),
            o["positions"],
            json_int(o["rice_k"], "rice_k", 0, 62),
            o["values"],
            ByteRange.from_json(o["positions_range"], "positions_range"),
            ByteRange.from_json(o["values_range"], "values_range"),
        )


@dataclass(frozen=True, slots=True)
class AnchorEntry:
    """Where one tensor's full bytes live in an anchor shard."""

    tensor: str
    file: str
    range: ByteRange

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"tensor": self.tensor, "file": self.file, "range": self.range.to_json()}

    @classmethod
    def from_json(cls, v: Any) -> AnchorEntry:
        """Parse and validate."""
        o = json_object(v, "anchor entry", ("tensor", "file", "range"))
        return cls(
            json_str(o["tensor"], "anchor entry tensor"),
            check_file_name(o["file"]),
            ByteRange.from_json(o["range"], "range"),
        )


@dataclass(frozen=True, slots=True)
class Stats:
    """Changed and total element counts and the step's payload bytes (sum of file sizes)."""

    changed: int
    total: int
    nbytes: int

    def to_json(self) -> dict[str, int]:
        """JSON form."""
        return {"changed": self.changed, "total": self.total, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, v: Any) -> Stats:
        """Parse and validate."""
        o = json_object(v, "stats", ("changed", "total", "nbytes"))
        return cls(
            json_int(o["changed"], "stats.changed"),
            json_int(o["total"], "stats.total"),
            json_int(o["nbytes"], "stats.nbytes"),
        )
