"""Manifests: the typed, canonical-JSON record that commits a step (SPEC.md, "Manifest").

The records a manifest is made of live in :mod:`~deltasync.protocol.entries` (and the writer
it names in :mod:`~deltasync.protocol.writers`); they are re-exported here, with
:func:`canonical_json` and ``FORMAT_VERSION``, as the manifest's vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from deltasync.errors import ProtocolError, SignatureMismatch
from deltasync.protocol.canonical import (
    FORMAT_VERSION,
    HEX32,
    MANIFEST_VERSION,
    MANIFEST_VERSIONS,
    canonical_json,
    check_version,
    field_error,
    json_digest,
    json_int,
    json_list,
    json_object,
    json_str,
    load_json,
)
from deltasync.protocol.digests import hmac_sign, hmac_verify
from deltasync.protocol.entries import (
    AnchorEntry,
    ByteRange,
    FileInfo,
    PatchEntry,
    Stats,
    TensorInfo,
    inventory_digest,
)
from deltasync.protocol.keys import MAX_STEP
from deltasync.protocol.manifest_v2 import (
    decode_inventory_digest,
    digests_from_json,
    digests_to_json,
    encode_inventory,
    group_entries_from_json,
    group_entry_to_json,
    inventory_facts,
)
from deltasync.protocol.streams import ZSTD_MAX_RATIO
from deltasync.protocol.writers import Writer

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_VERSION",
    "MANIFEST_VERSIONS",
    "AnchorEntry",
    "ByteRange",
    "FileInfo",
    "Kind",
    "Manifest",
    "PatchEntry",
    "Stats",
    "TensorInfo",
    "Writer",
    "canonical_json",
    "inventory_digest",
]

MAX_MANIFEST_BYTES = 256 * 1024 * 1024
Kind = Literal["anchor", "patch"]


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
    #: format 2: the ``inventory`` string as read, with the inventory it encodes (re-written verbatim, so
    #: a signature checks against the bytes the writer signed whatever zstd build compresses here). Used
    #: only while ``inventory`` is that very tuple: a copy with another inventory (``replace``) encodes its
    #: own. None: encode it
    inventory_blob: tuple[str, tuple[TensorInfo, ...]] | None = field(default=None, compare=False, repr=False)

    @property
    def epoch(self) -> int:
        """The writer epoch (0 when the manifest names no writer)."""
        return self.writer.epoch if self.writer else 0

    # -- serialisation ---------------------------------------------------

    def _body(self) -> dict[str, Any]:
        # the two formats differ in how they write the inventory, the entries and the digests
        inventory: Any
        entries: list[dict[str, Any]]
        digests: Any
        if self.format_version == 2:
            index = inventory_facts(self.inventory).index  # kept per inventory: every step repeats it
            inventory = self._inventory_v2()
            entries = [
                group_entry_to_json(e, index) if isinstance(e, PatchEntry) else e.to_json() for e in self.entries
            ]
            digests = digests_to_json(self.tensor_digests, self.inventory)
        else:
            inventory = [t.to_json() for t in self.inventory]
            entries = [e.to_json() for e in self.entries]
            digests = dict(self.tensor_digests)
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "run_id": self.run_id,
            "step": self.step,
            "kind": self.kind,
            "parent_step": self.parent_step,
            "parent_digest": self.parent_digest,
            "anchor_step": self.anchor_step,
            "inventory": inventory,
            "inventory_digest": self.inventory_digest,
            "files": [f.to_json() for f in self.files],
            "entries": entries,
            "tensor_digests": digests,
            "stats": self.stats.to_json(),
        }
        if self.extra:
            body["extra"] = dict(self.extra)
        if self.writer is not None:
            body["writer"] = self.writer.to_json()
        return body

    def _inventory_v2(self) -> str:
        blob = self.inventory_blob
        if blob is not None and blob[1] is self.inventory:
            return blob[0]
        return encode_inventory(self.inventory)

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
        raw = load_json(data, "manifest", MAX_MANIFEST_BYTES)
        version = check_version(raw, "manifest", MANIFEST_VERSIONS)
        o = json_object(raw, "manifest", _MANIFEST_KEYS, ("signature", "extra", "writer"))
        step = json_int(o["step"], "step", 0, MAX_STEP)
        what = f"manifest of step {step}"
        kind = o["kind"]
        if kind not in ("anchor", "patch"):
            raise field_error(what, f"kind must be 'anchor' or 'patch', got {kind!r}")
        parent_step = None if o["parent_step"] is None else json_int(o["parent_step"], "parent_step", 0, step - 1)
        parent_digest = None if o["parent_digest"] is None else json_digest(o["parent_digest"], "parent_digest")
        if (parent_step is None) != (parent_digest is None):
            raise field_error(what, "parent_step and parent_digest must both be set or both be null")
        if kind == "patch" and parent_step is None:
            raise field_error(what, "a patch needs a parent")
        anchor_step = json_int(o["anchor_step"], "anchor_step", 0, step)
        if (kind == "anchor") != (anchor_step == step):
            raise field_error(what, "anchor_step must equal step exactly for anchors")
        if version == 2:
            inventory, actual_digest = decode_inventory_digest(o["inventory"], what)
        else:
            inventory = tuple(TensorInfo.from_json(t) for t in json_list(o["inventory"], "inventory"))
            actual_digest = None
        facts = inventory_facts(inventory)  # kept for the next step's manifest (the same inventory tuple)
        names = facts.names
        if not facts.unique:
            raise field_error(what, "duplicate tensor names in inventory")
        inv_digest = json_digest(o["inventory_digest"], "inventory_digest")
        if inv_digest != (actual_digest or inventory_digest(inventory)):
            raise field_error(what, "inventory_digest does not match the inventory")
        files = tuple(FileInfo.from_json(f) for f in json_list(o["files"], "files"))
        if len({f.path for f in files}) != len(files):
            raise field_error(what, "duplicate file names")
        by_name = facts.by_name
        numel_of = facts.numel_of
        sizes = {f.path: f.size for f in files}
        entries: tuple[PatchEntry, ...] | tuple[AnchorEntry, ...]
        counts: list[int] | None = None  # each entry's element count, with its tensors proven distinct
        if kind == "patch":
            if version == 2:
                entries, counts = group_entries_from_json(json_list(o["entries"], "entries"), inventory, what)
            else:
                entries = tuple(PatchEntry.from_json(e) for e in json_list(o["entries"], "entries"))
            for k, e in enumerate(entries):
                if counts is not None:
                    numel = counts[k]
                else:
                    try:
                        numel = sum(map(numel_of.__getitem__, e.tensors))
                    except KeyError:
                        numel = -1  # a tensor the inventory does not hold
                if numel < 0 or e.count > numel or (e.positions == "dense" and e.count != numel):
                    raise field_error(what, f"patch entry {e.tensor!r} does not fit the inventory")
                for r in (e.positions_range, e.values_range):
                    if e.file not in sizes or r.end > sizes[e.file]:
                        raise field_error(what, f"patch entry {e.tensor!r} points outside file {e.file!r}")
                if e.positions == "dense" and e.positions_range.length:
                    raise field_error(what, f"patch entry {e.tensor!r}: dense positions carry no bytes")
                if e.count > 2 * ZSTD_MAX_RATIO * e.values_range.length:
                    # every value costs at least half a byte of one zstd frame's output
                    raise field_error(
                        what,
                        f"patch entry {e.tensor!r}: {e.values_range.length} value bytes cannot code {e.count} elements",
                    )
        else:
            entries = tuple(AnchorEntry.from_json(e) for e in json_list(o["entries"], "entries"))
            if sorted(e.tensor for e in entries) != sorted(names):
                raise field_error(what, "an anchor must hold every tensor of the inventory exactly once")
            for a in entries:
                if a.file not in sizes or a.range.end > sizes[a.file] or a.range.length != by_name[a.tensor].nbytes:
                    raise field_error(what, f"anchor entry {a.tensor!r} does not fit its file or its dtype/shape")
        if counts is None:
            listed = [n for e in entries for n in (e.tensors if isinstance(e, PatchEntry) else (e.tensor,))]
            if len(set(listed)) != len(listed):
                raise field_error(what, "a tensor appears twice in entries")
        _check_disjoint(entries, what)
        tdig = o["tensor_digests"]
        if version == 2:
            tensor_digests = digests_from_json(tdig, inventory, what)
        else:
            if not isinstance(tdig, dict) or not set(tdig) <= set(names):
                raise field_error(what, "tensor_digests must map inventory names to digests")
            tensor_digests = {k: json_digest(v, f"digest of {k!r}") for k, v in tdig.items()}
        extra = o.get("extra", {})
        if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise field_error(what, "extra must map strings to strings")
        sig = o.get("signature")
        if sig is not None and (not isinstance(sig, str) or len(sig) != 64 or not set(sig) <= HEX32):
            raise field_error(what, "signature must be 64 lower-case hex characters")
        return cls(
            run_id=json_str(o["run_id"], "run_id"),
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
            stats=_check_stats(Stats.from_json(o["stats"]), files, facts.total, what),
            signature=sig,
            extra=extra,
            writer=None if o.get("writer") is None else Writer.from_json(o["writer"]),
            format_version=version,
            inventory_blob=(o["inventory"], inventory) if version == 2 else None,
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
                raise field_error(what, f"entries overlap in file {name!r} at byte {start}")


def _check_stats(stats: Stats, files: tuple[FileInfo, ...], total: int, what: str) -> Stats:
    """``stats`` checked against the files and the inventory's element count ``total``."""
    if stats.nbytes != sum(f.size for f in files):
        raise field_error(what, f"stats.nbytes {stats.nbytes} is not the sum of the listed file sizes")
    if stats.total != total or stats.changed > stats.total:
        raise field_error(what, "stats.total must be the inventory's element count and stats.changed at most that")
    return stats
