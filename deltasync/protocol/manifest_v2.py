"""Format 2's compact manifest fields (SPEC.md "Manifest, format 2"): the inventory as one zstd frame,
group patch entries and tensor digests that name tensors by their index in the inventory.

A format-1 manifest spells every tensor's name out in its inventory, its entry and its digest, every
step: ~415 bytes per tensor, most of a step's cost at 18k tensors. Format 2 writes each name once,
compressed, and refers to tensors by index. :class:`~deltasync.protocol.manifest.Manifest` reads
and writes both; this module holds format 2's pieces. Every reader here validates before it
allocates and raises ProtocolError on anything malformed.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import operator
import threading
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from typing import Any, cast

import numpy as np
import zstandard

from deltasync.errors import ProtocolError
from deltasync.protocol.canonical import canonical_json, field_error, json_int, json_list, json_object
from deltasync.protocol.digests import xxh3_128
from deltasync.protocol.dtypes import DTYPES
from deltasync.protocol.entries import ByteRange, PatchEntry, TensorInfo, inventory_digest
from deltasync.protocol.keys import check_file_name

__all__ = [
    "DigestTable",
    "decode_inventory",
    "decode_inventory_digest",
    "digests_from_json",
    "digests_to_json",
    "encode_inventory",
    "group_entries_from_json",
    "group_entry_from_json",
    "group_entry_to_json",
    "inventory_bound",
    "inventory_facts",
    "inventory_fields",
]

#: the most bytes a format-2 inventory decompresses to (a manifest's own limit)
MAX_INVENTORY_BYTES = 256 * 1024 * 1024
#: and at most this many times its compressed frame (above :data:`INVENTORY_FLOOR_BYTES`): real
#: inventories compress 8x (a 25-tensor toy) to 132x (a 128-expert MoE of 36,945 tensors; 87x for a
#: 94k-tensor fp8 one), so 256x leaves room, while a frame of a few KiB cannot make a reader parse
#: more than ~1 MiB of JSON (SPEC.md "Manifest, format 2")
INVENTORY_RATIO = 256
#: the bound of a small frame's inventory (any real inventory this small compresses less than 256x)
INVENTORY_FLOOR_BYTES = 1 << 20
#: compressed bytes fed to zstd at a time: one feed inflates at most ~8 MiB (64 RLE blocks of 128 KiB)
_FEED = 256
_MAX_SHAPE = 2**48
_ENTRY_KEYS = ("tensors", "file", "count", "positions", "rice_k", "values", "positions_range", "values_range")
_INV_KEYS = frozenset(("name", "dtype", "shape"))


def inventory_fields(inventory: Sequence[TensorInfo]) -> tuple[str, str]:
    """(``inventory`` string, ``inventory_digest``) of a format-2 manifest: one canonical JSON pass
    (the digest is of those very bytes when the inventory is sorted by name, as the uploader's is)."""
    raw = canonical_json([t.to_json() for t in inventory])
    names = [t.name for t in inventory]
    digest = xxh3_128(raw) if names == sorted(names) else inventory_digest(inventory)
    return _pack(raw), digest


def encode_inventory(inventory: Sequence[TensorInfo]) -> str:
    """Base64 of one zstd frame (content size declared) of the canonical JSON of the inventory array,
    in the writer's order."""
    return _pack(canonical_json([t.to_json() for t in inventory]))


def _pack(raw: bytes) -> str:
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compress(raw)
    return base64.b64encode(frame).decode("ascii")


def decode_inventory(v: Any, what: str) -> tuple[TensorInfo, ...]:
    """The inventory of a format-2 manifest's ``inventory`` string (names unique, shapes checked)."""
    return decode_inventory_digest(v, what)[0]


#: the newest inventory strings parsed, and what they parse to: a run's steps repeat one inventory,
#: so a reader parses it once, not every step (a pure function of the string: a hit is the same result)
_PARSED: dict[str, tuple[tuple[TensorInfo, ...], str]] = {}
_PARSED_MAX = 4
_PARSED_LOCK = threading.Lock()  # readers in several threads (a fetcher per target) share it


def decode_inventory_digest(v: Any, what: str) -> tuple[tuple[TensorInfo, ...], str]:
    """The inventory of a format-2 ``inventory`` string and its ``inventory_digest`` (SPEC.md "Digests":
    of the canonical JSON of the inventory sorted by name). When the stored array is exactly that
    JSON (a writer that stores it sorted, as the reference does), the digest is of the bytes as
    decompressed, without writing the inventory out again. The newest few strings' results are
    kept (every step of a run carries the same one)."""
    if isinstance(v, str) and (hit := _PARSED.get(v)) is not None:
        return hit
    out = _decode_inventory_digest(v, what)
    assert isinstance(v, str)  # the parse refused anything else
    with _PARSED_LOCK:
        while len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[v] = out
    return out


def _decode_inventory_digest(v: Any, what: str) -> tuple[tuple[TensorInfo, ...], str]:
    if not isinstance(v, str) or not v.isascii():
        raise field_error(what, "inventory must be a base64 string")
    try:
        frame = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise field_error(what, "inventory is not valid base64") from None
    raw = _inflate(frame, what)
    try:
        lst = json.loads(raw.decode("utf-8"))
        canon = canonical_json(lst)  # lone surrogates parse but cannot be written (as load_json checks)
    except (UnicodeError, ValueError, RecursionError):
        raise field_error(what, "inventory frame is corrupt or not UTF-8 JSON") from None
    if not isinstance(lst, list):
        raise field_error(what, "inventory must decompress to a JSON array")
    out = []
    for t in lst:
        if type(t) is not dict or t.keys() != _INV_KEYS:
            raise field_error(what, "an inventory entry must be {name, dtype, shape}")
        name, dtype, shape = t["name"], t["dtype"], t["shape"]
        if type(name) is not str or not 1 <= len(name) <= 1024:
            raise field_error(what, "tensor names are strings of 1 to 1024 characters")
        if type(dtype) is not str or dtype not in DTYPES:
            raise field_error(what, f"tensor {name!r}: unsupported dtype {dtype!r}")
        if (
            type(shape) is not list
            or len(shape) > 64
            or not all(type(s) is int and 0 <= s <= _MAX_SHAPE for s in shape)
        ):
            raise field_error(what, f"tensor {name!r}: a shape is at most 64 integers in [0, 2^48]")
        out.append(TensorInfo(name, dtype, tuple(shape)))
    names = [t.name for t in out]
    if names == sorted(names) and canon == raw:
        return tuple(out), xxh3_128(raw)
    return tuple(out), inventory_digest(out)


def inventory_bound(frame_bytes: int) -> int:
    """The most bytes the inventory of a ``frame_bytes``-byte zstd frame may decompress to:
    ``min(256 MiB, max(1 MiB, 256 * frame_bytes))``."""
    return min(MAX_INVENTORY_BYTES, max(INVENTORY_FLOOR_BYTES, INVENTORY_RATIO * frame_bytes))


def _inflate(frame: bytes, what: str) -> bytes:
    """The content of the one zstd ``frame``: its declared size checked against
    :func:`inventory_bound` before zstd runs, then decompressed a few bytes of input at a time and
    refused as soon as it yields more than it declared (a lying header); nothing after the frame."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        raise field_error(what, "inventory is not a zstd frame") from None
    bound = inventory_bound(len(frame))
    if declared < 0:
        raise field_error(what, "inventory frame does not declare its content size")
    if declared > bound:
        raise field_error(
            what,
            f"inventory frame declares {declared} bytes, over the {bound}-byte bound of a {len(frame)}-byte frame "
            f"(max({INVENTORY_FLOOR_BYTES}, {INVENTORY_RATIO} x its size), at most {MAX_INVENTORY_BYTES})",
        )
    obj = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    at = 0
    try:
        while at < len(frame) and not obj.eof:
            out += obj.decompress(frame[at : at + _FEED])
            at += _FEED
            if len(out) > declared:
                raise field_error(what, f"inventory frame inflates past the {declared} bytes it declares")
    except zstandard.ZstdError:
        raise field_error(what, "inventory frame is corrupt or not UTF-8 JSON") from None
    if not obj.eof or obj.unused_data or at < len(frame) or len(out) != declared:
        raise field_error(what, "inventory must be one whole zstd frame of the size it declares, nothing after it")
    return bytes(out)


class InventoryFacts:
    """What a manifest's checks look up in its inventory, computed once per inventory tuple (every
    step of a run shares one: :func:`decode_inventory_digest` keeps it): names, dtypes and element
    counts by index, a name's entry and element count, the total, whether the names are unique."""

    __slots__ = ("_index", "by_name", "dtypes", "memo", "names", "numel_of", "total", "unique")

    def __init__(self, inventory: Sequence[TensorInfo]) -> None:
        self._index: dict[str, int] | None = None
        #: what readers derive from these facts and keep with them (bounded by whoever adds to it)
        self.memo: dict[Any, Any] = {}
        self.names = [t.name for t in inventory]
        self.dtypes = [t.dtype for t in inventory]
        self.by_name = {t.name: t for t in inventory}
        self.numel_of = {t.name: t.numel for t in inventory}
        self.unique = len(self.by_name) == len(self.names)
        self.total = sum(t.numel for t in inventory)

    def arrays(self) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """(a code per dtype, the element count) of each inventory position, as int64 arrays (made once)."""
        got = self.memo.get("arrays")
        if got is None:
            codes: dict[str, int] = {}
            got = self.memo["arrays"] = (
                np.fromiter((codes.setdefault(d, len(codes)) for d in self.dtypes), np.int64, len(self.dtypes)),
                np.fromiter(self.numel_of.values(), np.int64, len(self.numel_of))
                if self.unique
                else np.fromiter((self.numel_of[n] for n in self.names), np.int64, len(self.names)),
            )
        return cast(tuple[Any, Any], got)

    @property
    def index(self) -> dict[str, int]:
        """Each name's index in the inventory (made on first use: writers need it, readers do not)."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index


_FACTS: list[tuple[tuple[TensorInfo, ...], InventoryFacts]] = []
#: inventories whose facts are kept (a process that writes and reads a run holds two objects of it)
_FACTS_KEPT = 4


def inventory_facts(inventory: tuple[TensorInfo, ...]) -> InventoryFacts:
    """:class:`InventoryFacts` of ``inventory`` (the last tuple asked is kept, by identity: it is immutable)."""
    kept = list(_FACTS)  # a reader in another thread sees the old list or the new one, whole
    for inv, facts in reversed(kept):
        if inv is inventory:
            return facts
    facts = InventoryFacts(inventory)
    _FACTS[:] = [*kept[-(_FACTS_KEPT - 1) :], (inventory, facts)]
    return facts


def _index_list(v: list[Any], n: int) -> bool:
    """Whether ``v`` holds only ints (not bools) in ``[0, n)``."""
    if not v:
        return True
    return set(map(type, v)) == {int} and min(v) >= 0 and max(v) < n


def group_entry_to_json(e: PatchEntry, index: Mapping[str, int]) -> dict[str, Any]:
    """A patch entry in format 2's form: ``tensors`` lists inventory indices."""
    return {
        "tensors": [index[n] for n in e.tensors],
        "file": e.file,
        "count": e.count,
        "positions": e.positions,
        "rice_k": e.rice_k,
        "values": e.values,
        "positions_range": e.positions_range.to_json(),
        "values_range": e.values_range.to_json(),
    }


def group_entry_from_json(v: Any, inventory: Sequence[TensorInfo], what: str) -> PatchEntry:
    """Parse a format-2 patch entry: 1 or more distinct inventory indices, all of one dtype."""
    o = json_object(v, "patch entry", _ENTRY_KEYS)
    idx = json_list(o["tensors"], "patch entry tensors")
    n = len(inventory)
    if not idx or not _index_list(idx, n) or len(set(idx)) != len(idx):
        raise field_error(what, "a patch entry's tensors are distinct inventory indices, at least one")
    facts = inventory_facts(inventory) if isinstance(inventory, tuple) else InventoryFacts(inventory)
    names = tuple(map(facts.names.__getitem__, idx))
    if len(set(map(facts.dtypes.__getitem__, idx))) != 1:
        raise field_error(what, f"patch entry {names[0]!r}: the tensors of a group must share one dtype")
    return _group_entry(o, names, what)


def group_entries_from_json(
    v: list[Any], inventory: tuple[TensorInfo, ...], what: str
) -> tuple[tuple[PatchEntry, ...], list[int] | None]:
    """Every format-2 patch entry of a manifest, and each one's element count: the checks of
    :func:`group_entry_from_json` in one pass over all the entries' indices together (which also
    proves that no tensor is in two entries), or, when any of those fails, entry by entry, for
    its own error (then the counts are None: the caller sums them, and finds a duplicate itself)."""
    try:
        objs = [json_object(e, "patch entry", _ENTRY_KEYS) for e in v]
        idxs = [json_list(o["tensors"], "patch entry tensors") for o in objs]
    except ProtocolError:  # the first bad entry's own error, as entry by entry finds it
        return tuple(group_entry_from_json(e, inventory, what) for e in v), None
    facts = inventory_facts(inventory)
    flat = list(itertools.chain.from_iterable(idxs))
    ok = all(idxs) and _index_list(flat, len(inventory)) and len(set(flat)) == len(flat)
    if ok and flat:
        codes, numels = facts.arrays()
        at = np.asarray(flat, dtype=np.int64)
        starts = np.zeros(len(idxs), dtype=np.int64)
        np.cumsum([len(i) for i in idxs[:-1]], out=starts[1:])
        c = codes[at]
        ok = bool(np.array_equal(np.minimum.reduceat(c, starts), np.maximum.reduceat(c, starts)))
        counts: list[int] = np.add.reduceat(numels[at], starts).tolist()
    if not ok:
        return tuple(group_entry_from_json(e, inventory, what) for e in v), None
    names = facts.names
    out = []
    for o, idx in zip(objs, idxs, strict=True):
        members = tuple(map(names.__getitem__, idx))
        out.append(_group_entry(o, members, what))
    return tuple(out), counts if flat else []


def _group_entry(o: dict[str, Any], names: tuple[str, ...], what: str) -> PatchEntry:
    """The entry ``o`` (its tensors checked: ``names``)."""
    if o["positions"] not in ("rice", "rice-z", "dense") or o["values"] not in ("xor-rank", "raw"):
        raise field_error(f"patch entry {names[0]!r}", f"unknown coding {o['positions']!r}/{o['values']!r}")
    return PatchEntry(
        names[0],
        check_file_name(o["file"]),
        json_int(o["count"], "count", 1),
        o["positions"],
        json_int(o["rice_k"], "rice_k", 0, 62),
        o["values"],
        ByteRange.from_json(o["positions_range"], "positions_range"),
        ByteRange.from_json(o["values_range"], "values_range"),
        names if len(names) > 1 else (),
    )


class DigestTable(Mapping[str, str]):
    """Format 2's tensor digests as read: ascending inventory positions and their 32-character hex
    digests in one string. A mapping of name -> hex digest (its dict made on first use); readers in
    bulk take :meth:`positions`, :meth:`words` and :meth:`rows` instead of 18k strings. Immutable."""

    __slots__ = ("_at", "_dict", "_pos", "_rows", "_words", "facts", "hexes")

    def __init__(self, facts: InventoryFacts, pos: list[int], hexes: str) -> None:
        """``pos``: strictly ascending inventory positions; ``hexes``: 32 lower-case hex each (checked by the caller)."""
        self.facts = facts
        self.hexes = hexes
        self._pos = pos
        self._at: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._dict: dict[str, str] | None = None
        self._words: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._rows: np.ndarray[Any, np.dtype[np.int64]] | None = None

    def _map(self) -> dict[str, str]:
        d = self._dict
        if d is None:
            names = self.facts.names
            picked = names if len(self._pos) == len(names) else list(map(names.__getitem__, self._pos))
            hexes = self.hexes
            d = dict(zip(picked, [hexes[k : k + 32] for k in range(0, len(hexes), 32)], strict=True))
            self._dict = d
        return d

    def __getitem__(self, name: str) -> str:
        return self._map()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, name: object) -> bool:
        return name in self._map()

    def get(self, name: str, default: Any = None) -> Any:
        # docstring inherited
        return self._map().get(name, default)

    def keys(self) -> KeysView[str]:
        # docstring inherited
        return self._map().keys()

    def items(self) -> ItemsView[str, str]:
        # docstring inherited
        return self._map().items()

    def values(self) -> ValuesView[str]:
        # docstring inherited
        return self._map().values()

    def __repr__(self) -> str:
        return f"DigestTable({self._map()!r})"

    def __reduce__(self) -> Any:
        return (dict, (self._map(),))  # a copy elsewhere is a plain dict (the facts are this process's)

    def positions(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The inventory positions digested, ascending."""
        if self._at is None:
            n = len(self.facts.names)
            if len(self._pos) == n:  # ascending and in range: every position (the writers' default)
                at = self.facts.memo.get("arange")
                if at is None:
                    at = self.facts.memo["arange"] = np.arange(n, dtype=np.int64)
                    at.flags.writeable = False
            else:
                at = np.asarray(self._pos, dtype=np.int64)
                at.flags.writeable = False
            self._at = at
        return self._at

    def words(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """The digests as an ``(n, 2)`` uint64 array, in :meth:`positions` order (see
        :func:`~deltasync.protocol.digests.hex_words`)."""
        if self._words is None:
            self._words = np.frombuffer(bytes.fromhex(self.hexes), dtype=">u8").astype(np.uint64).reshape(-1, 2)
        return self._words

    def rows(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each inventory position's row in :meth:`words`, -1 where it has no digest."""
        if self._rows is None:
            if len(self._pos) == len(self.facts.names):
                self._rows = self.positions()  # every position: row i is position i
            else:
                rows = np.full(len(self.facts.names), -1, dtype=np.int64)
                rows[self.positions()] = np.arange(len(self._pos), dtype=np.int64)
                rows.flags.writeable = False
                self._rows = rows
        return self._rows


def digests_to_json(digests: Mapping[str, str], inventory: Sequence[TensorInfo]) -> dict[str, Any]:
    """``{"tensors": [ascending inventory indices], "xxh3_128": "<32 hex per tensor, in that order>"}``."""
    if (
        isinstance(digests, DigestTable)
        and isinstance(inventory, tuple)
        and digests.facts is inventory_facts(inventory)
    ):
        return {"tensors": list(digests._pos), "xxh3_128": digests.hexes}  # as read
    if len(digests) == len(inventory) and isinstance(inventory, tuple):
        names = inventory_facts(inventory).names
        try:  # every tensor digested (the uploader's default): one pass in inventory order
            return {"tensors": list(range(len(names))), "xxh3_128": "".join(map(digests.__getitem__, names))}
        except KeyError:
            pass
    idx = [i for i, t in enumerate(inventory) if t.name in digests]
    return {"tensors": idx, "xxh3_128": "".join(digests[inventory[i].name] for i in idx)}


def digests_from_json(v: Any, inventory: Sequence[TensorInfo], what: str) -> Mapping[str, str]:
    """Parse format 2's tensor digests: strictly ascending indices, 32 lower-case hex characters each."""
    o = json_object(v, "tensor_digests", ("tensors", "xxh3_128"))
    idx = json_list(o["tensors"], "tensor_digests.tensors")
    hexes = o["xxh3_128"]
    n = len(inventory)
    facts = inventory_facts(inventory) if isinstance(inventory, tuple) else InventoryFacts(inventory)
    # every tensor, in order (the writers' default); ints only (2.0 and True compare equal to ints)
    every = len(idx) == n and idx == facts.memo.setdefault("every", list(range(n))) and set(map(type, idx)) == {int}
    if not every and (not _index_list(idx, n) or any(map(operator.ge, idx, itertools.islice(idx, 1, None)))):
        raise field_error(what, "tensor_digests.tensors must be strictly ascending inventory indices")
    if not isinstance(hexes, str) or len(hexes) != 32 * len(idx) or not _lower_hex(hexes):
        raise field_error(what, "tensor_digests.xxh3_128 must be 32 lower-case hex characters per tensor")
    return DigestTable(facts, idx, hexes)


def _lower_hex(s: str) -> bool:
    """Whether ``s`` is only lower-case hex digits (as ``set(s) <= HEX32``, in one C pass)."""
    return s.isascii() and not s.encode("ascii").translate(None, b"0123456789abcdef")
