"""Manifests: the typed, canonical-JSON record that commits a step (SPEC.md, "Manifest")."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from deltasync.errors import ProtocolError, SignatureMismatch, UnsupportedVersion
from deltasync.protocol.digests import hmac_sign, hmac_verify, xxh3_128
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.keys import MAX_STEP, check_file_name

__all__ = [
    "FORMAT_VERSION",
    "AnchorEntry",
    "ByteRange",
    "FileInfo",
    "Head",
    "Kind",
    "Writer",
    "WriterClaim",
    "Manifest",
    "PatchEntry",
    "Stats",
    "TensorInfo",
    "canonical_json",
    "inventory_digest",
]

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
ZSTD_MAX_RATIO = 32768  # no zstd frame expands more: its densest block (RLE, 4 bytes) yields at most 128 KiB
Kind = Literal["anchor", "patch"]
_HEX32 = frozenset("0123456789abcdef")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes that are digested and signed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _load_json(data: bytes | bytearray | memoryview, what: str, limit: int) -> dict[str, Any]:
    """Parse a JSON object of at most ``limit`` bytes that canonical_json can write back."""
    if len(data) > limit:
        raise ProtocolError(f"{what} is {len(data)} bytes, over the {limit} limit")
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
        # NaN/Infinity and lone surrogates (``"\\ud800"``) parse but cannot be written canonically.
        canonical_json(raw)
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    return raw


def _version(raw: Mapping[str, Any], what: str) -> None:
    version = raw.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnsupportedVersion(
            f"{what} has format_version {version!r}; this deltasync reads version {FORMAT_VERSION} "
            "only (upgrade deltasync to read newer runs)"
        )


# ------------------------------------------------------------- field checkers


def _err(what: str, msg: str) -> ProtocolError:
    return ProtocolError(f"{what}: {msg}")


def _obj(v: Any, what: str, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _err(what, "expected a JSON object")
    missing = [k for k in keys if k not in v]
    unknown = sorted(set(v) - set(keys) - set(optional))
    if missing or unknown:
        raise _err(what, f"missing fields {missing} / unknown fields {unknown}")
    return v


def _int(v: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _err(what, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise _err(what, f"expected a non-empty string, got {v!r}")
    return v


def _digest(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) != 32 or not set(v) <= _HEX32:
        raise _err(what, f"expected a 32-character lower-case hex xxh3-128 digest, got {v!r}")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise _err(what, "expected a JSON array")
    return v


# ------------------------------------------------------------------- records


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
        o = _obj(v, "inventory entry", ("name", "dtype", "shape"))
        name = _str(o["name"], "tensor name")
        dtype_info(o["dtype"])
        shape = tuple(_int(s, f"shape of {name!r}", 0, 2**48) for s in _list(o["shape"], f"shape of {name!r}"))
        if len(shape) > 64:
            raise _err(f"shape of {name!r}", "more than 64 dimensions")
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
        o = _obj(v, "file entry", ("path", "size", "xxh3_128"))
        return cls(check_file_name(o["path"]), _int(o["size"], "file size"), _digest(o["xxh3_128"], "file digest"))


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
        lst = _list(v, what)
        if len(lst) != 2:
            raise _err(what, "a byte range is [start, end]")
        a, b = _int(lst[0], what), _int(lst[1], what)
        if b < a:
            raise _err(what, f"range end {b} before start {a}")
        return cls(a, b)


@dataclass(frozen=True, slots=True)
class PatchEntry:
    """Where and how one tensor's change is coded in a patch file."""

    tensor: str
    file: str
    count: int
    positions: Literal["rice", "rice-z", "dense"]
    rice_k: int
    values: Literal["xor-rank", "raw"]
    positions_range: ByteRange
    values_range: ByteRange

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
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
        o = _obj(v, "patch entry", keys)
        name = _str(o["tensor"], "patch entry tensor")
        if o["positions"] not in ("rice", "rice-z", "dense") or o["values"] not in ("xor-rank", "raw"):
            raise _err(f"patch entry {name!r}", f"unknown coding {o['positions']!r}/{o['values']!r}")
        return cls(
            name,
            check_file_name(o["file"]),
            _int(o["count"], "count", 1),
            o["positions"],
            _int(o["rice_k"], "rice_k", 0, 62),
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
        o = _obj(v, "anchor entry", ("tensor", "file", "range"))
        return cls(
            _str(o["tensor"], "anchor entry tensor"),
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
        o = _obj(v, "stats", ("changed", "total", "nbytes"))
        return cls(
            _int(o["changed"], "stats.changed"), _int(o["total"], "stats.total"), _int(o["nbytes"], "stats.nbytes")
        )


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
        o = _obj(v, "writer", ("id", "epoch"))
        return cls(_str(o["id"], "writer id"), _int(o["epoch"], "writer epoch", 0, MAX_STEP))


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
        raw = _load_json(data, "writer claim", 4096)
        _version(raw, "writer claim")
        o = _obj(raw, "writer claim", ("format_version", "epoch", "writer", "after_step"))
        after = None if o["after_step"] is None else _int(o["after_step"], "after_step", 0, MAX_STEP)
        return cls(_int(o["epoch"], "epoch", 1, MAX_STEP), _str(o["writer"], "writer"), after)


_MANIFEST_KEYS = (
    "format_version",
    "run_id",
    "step",
    "kind",
    "parent_step",
    "parent_digest",
    "anchor_step",
    "inventory",
    "inventory_digest",
    "files",
    "entries",
    "tensor_digests",
    "stats",
)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a reader needs to fetch, verify and apply one committed step."""

    run_id: str
    step: int
    kind: Kind
    parent_step: int | None
    parent_digest: str | None
    anchor_step: int
    inventory: tuple[TensorInfo, ...]
    inventory_digest: str
    files: tuple[FileInfo, ...]
    entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...]
    tensor_digests: Mapping[str, str]
    stats: Stats
    signature: str | None = None
    format_version: int = FORMAT_VERSION
    extra: Mapping[str, str] = field(default_factory=dict)
    writer: Writer | None = None

    @property
    def epoch(self) -> int:
        """The writer epoch (0 when the manifest names no writer)."""
        return self.writer.epoch if self.writer else 0

    # -- serialisation ---------------------------------------------------

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "run_id": self.run_id,
            "step": self.step,
            "kind": self.kind,
            "parent_step": self.parent_step,
            "parent_digest": self.parent_digest,
            "anchor_step": self.anchor_step,
            "inventory": [t.to_json() for t in self.inventory],
            "inventory_digest": self.inventory_digest,
            "files": [f.to_json() for f in self.files],
            "entries": [e.to_json() for e in self.entries],
            "tensor_digests": dict(self.tensor_digests),
            "stats": self.stats.to_json(),
        }
        if self.extra:
            body["extra"] = dict(self.extra)
        if self.writer is not None:
            body["writer"] = self.writer.to_json()
        return body

    def to_json(self) -> bytes:
        """Canonical JSON bytes: what is stored as ``manifest.json``."""
        body = self._body()
        if self.signature is not None:
            body["signature"] = self.signature
        return canonical_json(body)

    def signed(self, key: bytes) -> Manifest:
        """A copy with an HMAC-SHA256 signature over the canonical body (without ``signature``)."""
        return replace(self, signature=hmac_sign(key, canonical_json(self._body())))

    def check_signature(self, key: bytes) -> None:
        """Raise SignatureMismatch unless the manifest is signed with ``key``."""
        if self.signature is None:
            raise SignatureMismatch(f"step {self.step}: manifest is not signed but a signing key is configured")
        if not hmac_verify(key, canonical_json(self._body()), self.signature):
            raise SignatureMismatch(f"step {self.step}: manifest signature does not match the configured key")

    @property
    def total_bytes(self) -> int:
        """Bytes of all data files of the step."""
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileInfo:
        """The FileInfo named ``name``."""
        for f in self.files:
            if f.path == name:
                return f
        raise ProtocolError(f"step {self.step}: entry refers to file {name!r} that the manifest does not list")

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """Parse, validate and cross-check a manifest; anything off is a ProtocolError."""
        raw = _load_json(data, "manifest", MAX_MANIFEST_BYTES)
        _version(raw, "manifest")
        o = _obj(raw, "manifest", _MANIFEST_KEYS, ("signature", "extra", "writer"))
        step = _int(o["step"], "step", 0, MAX_STEP)
        what = f"manifest of step {step}"
        kind = o["kind"]
        if kind not in ("anchor", "patch"):
            raise _err(what, f"kind must be 'anchor' or 'patch', got {kind!r}")
        parent_step = None if o["parent_step"] is None else _int(o["parent_step"], "parent_step", 0, step - 1)
        parent_digest = None if o["parent_digest"] is None else _digest(o["parent_digest"], "parent_digest")
        if (parent_step is None) != (parent_digest is None):
            raise _err(what, "parent_step and parent_digest must both be set or both be null")
        if kind == "patch" and parent_step is None:
            raise _err(what, "a patch needs a parent")
        anchor_step = _int(o["anchor_step"], "anchor_step", 0, step)
        if (kind == "anchor") != (anchor_step == step):
            raise _err(what, "anchor_step must equal step exactly for anchors")
        inventory = tuple(TensorInfo.from_json(t) for t in _list(o["inventory"], "inventory"))
        names = [t.name for t in inventory]
        if len(set(names)) != len(names):
            raise _err(what, "duplicate tensor names in inventory")
        inv_digest = _digest(o["inventory_digest"], "inventory_digest")
        if inv_digest != inventory_digest(inventory):
            raise _err(what, "inventory_digest does not match the inventory")
        files = tuple(FileInfo.from_json(f) for f in _list(o["files"], "files"))
        if len({f.path for f in files}) != len(files):
            raise _err(what, "duplicate file names")
        by_name = {t.name: t for t in inventory}
        sizes = {f.path: f.size for f in files}
        entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...]
        if kind == "patch":
            entries = tuple(PatchEntry.from_json(e) for e in _list(o["entries"], "entries"))
            for e in entries:
                info = by_name.get(e.tensor)
                if info is None or e.count > info.numel or (e.positions == "dense" and e.count != info.numel):
                    raise _err(what, f"patch entry {e.tensor!r} does not fit the inventory")
                for r in (e.positions_range, e.values_range):
                    if e.file not in sizes or r.end > sizes[e.file]:
                        raise _err(what, f"patch entry {e.tensor!r} points outside file {e.file!r}")
                if e.positions == "dense" and e.positions_range.length:
                    raise _err(what, f"patch entry {e.tensor!r}: dense positions carry no bytes")
                if e.count > 2 * ZSTD_MAX_RATIO * e.values_range.length:
                    # every value costs at least half a byte of one zstd frame's output
                    raise _err(
                        what,
                        f"patch entry {e.tensor!r}: {e.values_range.length} value bytes cannot code {e.count} elements",
                    )
        else:
            entries = tuple(AnchorEntry.from_json(e) for e in _list(o["entries"], "entries"))
            if sorted(e.tensor for e in entries) != sorted(names):
                raise _err(what, "an anchor must hold every tensor of the inventory exactly once")
            for a in entries:
                if a.file not in sizes or a.range.end > sizes[a.file] or a.range.length != by_name[a.tensor].nbytes:
                    raise _err(what, f"anchor entry {a.tensor!r} does not fit its file or its dtype/shape")
        if len({e.tensor for e in entries}) != len(entries):
            raise _err(what, "a tensor appears twice in entries")
        _check_disjoint(entries, what)
        tdig = o["tensor_digests"]
        if not isinstance(tdig, dict) or not set(tdig) <= set(names):
            raise _err(what, "tensor_digests must map inventory names to digests")
        tensor_digests = {k: _digest(v, f"digest of {k!r}") for k, v in tdig.items()}
        extra = o.get("extra", {})
        if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise _err(what, "extra must map strings to strings")
        sig = o.get("signature")
        if sig is not None and (not isinstance(sig, str) or len(sig) != 64 or not set(sig) <= _HEX32):
            raise _err(what, "signature must be 64 lower-case hex characters")
        return cls(
            run_id=_str(o["run_id"], "run_id"),
            step=step,
            kind=cast(Kind, kind),
            parent_step=parent_step,
            parent_digest=parent_digest,
            anchor_step=anchor_step,
            inventory=inventory,
            inventory_digest=inv_digest,
            files=files,
            entries=entries,
            tensor_digests=tensor_digests,
            stats=_check_stats(Stats.from_json(o["stats"]), files, inventory, what),
            signature=sig,
            extra=extra,
            writer=None if o.get("writer") is None else Writer.from_json(o["writer"]),
        )


def _check_disjoint(entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...], what: str) -> None:
    """No two non-empty byte ranges of one file overlap, so entries never declare more bytes than a file holds."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        ranges = (e.positions_range, e.values_range) if isinstance(e, PatchEntry) else (e.range,)
        spans.setdefault(e.file, []).extend((r.start, r.end) for r in ranges if r.length)
    for name, lst in spans.items():
        lst.sort()
        for (_, end), (start, _) in zip(lst, lst[1:], strict=False):
            if start < end:
                raise _err(what, f"entries overlap in file {name!r} at byte {start}")


def _check_stats(stats: Stats, files: tuple[FileInfo, ...], inventory: tuple[TensorInfo, ...], what: str) -> Stats:
    if stats.nbytes != sum(f.size for f in files):
        raise _err(what, f"stats.nbytes {stats.nbytes} is not the sum of the listed file sizes")
    if stats.total != sum(t.numel for t in inventory) or stats.changed > stats.total:
        raise _err(what, "stats.total must be the inventory's element count and stats.changed at most that")
    return stats


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
        raw = _load_json(data, "HEAD.json", MAX_HEAD_BYTES)
        _version(raw, "HEAD.json")
        o = _obj(raw, "HEAD.json", ("format_version", "step", "manifest_digest", "run_id"))
        return cls(
            _int(o["step"], "HEAD step", 0, MAX_STEP),
            _digest(o["manifest_digest"], "HEAD digest"),
            _str(o["run_id"], "run_id"),
        )
