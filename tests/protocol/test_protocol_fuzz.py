"""Feed the protocol readers garbage and mutated valid input: they may only raise ProtocolError.

Every reader of untrusted bytes (``parse_safetensors``, ``Manifest.from_json``,
``Head.from_json``, ``decode_positions``, ``decode_values``) either succeeds with
a result that satisfies its invariants or raises
:class:`deltasync.errors.ProtocolError` -- never IndexError, a bare ValueError,
MemoryError, RecursionError, a zstd or unicode error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifests import anchor_manifest

from deltasync.errors import ProtocolError, UnsupportedVersion
from deltasync.protocol import (
    AnchorEntry,
    ByteRange,
    FileInfo,
    Head,
    Manifest,
    PatchEntry,
    Stats,
    TensorInfo,
    decode_positions,
    decode_values,
    encode_changes,
    file_key,
    inventory_digest,
    positions,
    span_file_key,
    xxh3_128,
)
from deltasync.protocol.dtypes import DTYPES
from deltasync.protocol.encoding import EncodedTensor
from deltasync.protocol.safetensors_io import StFile, TensorBytes, parse_safetensors, to_bytes

T = TypeVar("T")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_protocol_errors(fn: Callable[[], T]) -> T | None:
    """Run ``fn``; a ProtocolError is an accepted outcome, anything else fails the test."""
    try:
        return fn()
    except ProtocolError as exc:
        assert str(exc)  # a message that says what is wrong
        return None


# ----------------------------------------------------------------- mutations

_OPS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 2**31), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 2**31), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 2**31), st.just(0)),
    st.tuples(st.just("append"), st.integers(0, 2**31), st.integers(0, 255)),
)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, arg in ops:
        i = where % (len(buf) + 1)
        if op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf.insert(i, arg)
        elif op == "append":
            buf.append(arg)
        elif not buf:
            continue
        elif op == "flip":
            buf[i % len(buf)] ^= 1 << arg
        elif op == "set":
            buf[i % len(buf)] = arg
        else:
            del buf[i % len(buf)]
    return bytes(buf)


mutations = st.lists(_OPS, min_size=1, max_size=4)

# JSON values that probe the validators: wrong types, edge integers, traversal strings,
# lone surrogates (valid JSON text, unencodable as UTF-8), NaN, deep nesting.
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2, 7, 2**31, 2**48, 2**63, 2**64, 10**12, -(2**63) - 1]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "",
            "../x",
            "/etc/passwd",
            "a/b",
            ".hidden",
            "manifest.json",
            "\ud800",
            "BF16",
            "U8",
            "rice",
            "dense",
            "xor-rank",
            "raw",
            "anchor",
            "patch",
            "0" * 32,
            "f" * 64,
            "patch-00000.safetensors",
        ]
    ),
    st.text(max_size=8),
)
json_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def _paths(v: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


def _replace_at(v: Any, path: tuple[Any, ...], new: Any, delete: bool) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    v = dict(v) if isinstance(v, dict) else list(v)
    if delete and not rest:
        del v[head]
    else:
        v[head] = _replace_at(v[head], rest, new, delete)
    return v


def _dumps(v: Any) -> bytes:
    return json.dumps(v, sort_keys=True, separators=(",", ":")).encode()


# ----------------------------------------------------------------- valid inputs


def _patch_case(seed: int, dtype: str, numel: int, density: float) -> tuple[EncodedTensor, int, np.dtype[Any]]:
    rng = np.random.default_rng(seed)
    bits = DTYPES[dtype].bits
    count = max(1, int(numel * density))
    idx = np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64)
    info = np.iinfo(bits)
    old = rng.integers(info.min, info.max, size=count, dtype=bits, endpoint=True)
    xor = rng.integers(1, 9, size=count).astype(bits)
    return encode_changes(numel, idx, old, old ^ xor), numel, bits


PATCHES = [
    _patch_case(1, "BF16", 1000, 0.01),
    _patch_case(2, "F32", 300, 0.5),
    _patch_case(3, "U8", 64, 1.0),
    _patch_case(4, "F64", 50, 0.1),
    _patch_case(5, "BF16", 2000, 0.4),
]
assert {p[0].values for p in PATCHES} >= {"raw", "xor-rank"}


def _patch_file(enc: EncodedTensor) -> bytes:
    return to_bytes(
        [
            TensorBytes("w/positions", "U8", (len(enc.pos_blob),), enc.pos_blob),
            TensorBytes("w/values", "U8", (len(enc.val_blob),), enc.val_blob),
            TensorBytes("bias", "BF16", (2, 3), bytes(range(12))),
        ],
        {"format": "deltasync-patch", "step": "3"},
    )


ST_FILES = [_patch_file(p[0]) for p in PATCHES] + [to_bytes([]), to_bytes([TensorBytes("s", "F32", (), b"\0" * 4)])]

INVENTORY = (TensorInfo("w", "BF16", (4, 8)), TensorInfo("b", "F32", (3,)))


def _patch_manifest() -> Manifest:
    return Manifest(
        run_id="fuzz",
        step=3,
        kind="patch",
        parent_step=2,
        parent_digest="ab" * 16,
        anchor_step=0,
        inventory=INVENTORY,
        inventory_digest=inventory_digest(INVENTORY),
        files=(FileInfo("patch-00000.safetensors", 400, "cd" * 16),),
        entries=(
            PatchEntry("w", "patch-00000.safetensors", 3, "rice", 3, "raw", ByteRange(320, 323), ByteRange(323, 338)),
        ),
        tensor_digests={"w": "ef" * 16},
        stats=Stats(3, 35, 400),
    )


def _anchor_manifest() -> Manifest:
    return Manifest(
        run_id="fuzz",
        step=4,
        kind="anchor",
        parent_step=3,
        parent_digest="12" * 16,
        anchor_step=4,
        inventory=INVENTORY,
        inventory_digest=inventory_digest(INVENTORY),
        files=(
            FileInfo("model-00001-of-00001.safetensors", 200, "34" * 16),
            FileInfo("model.safetensors.index.json", 90, "56" * 16),
        ),
        entries=(
            AnchorEntry("b", "model-00001-of-00001.safetensors", ByteRange(120, 132)),
            AnchorEntry("w", "model-00001-of-00001.safetensors", ByteRange(132, 196)),
        ),
        tensor_digests={"b": "78" * 16, "w": "9a" * 16},
        stats=Stats(35, 35, 290),
        extra={"note": "x"},
    ).signed(b"k")


MANIFESTS = [_patch_manifest().to_json(), _anchor_manifest().to_json()]
HEAD = Head(12, "0f" * 16, "fuzz").to_json()


def test_valid_inputs_parse() -> None:
    for data in MANIFESTS:
        assert Manifest.from_json(data).to_json() == data
    assert Head.from_json(HEAD).to_json() == HEAD
    for data in ST_FILES:
        parse_safetensors(data)


# ----------------------------------------------------------------- safetensors


def _check_stfile(st_: StFile, data: bytes) -> None:
    for e in st_.entries.values():
        assert st_.data_start <= e.start <= e.end <= len(data)
        n = 1
        for s in e.shape:
            n *= s
        assert e.end - e.start == n * DTYPES[e.dtype].itemsize


@FUZZ
@given(data=st.binary(max_size=600))
def test_safetensors_random_bytes(data: bytes) -> None:
    got = _only_protocol_errors(lambda: parse_safetensors(data))
    if got is not None:
        _check_stfile(got, data)


@FUZZ
@given(base=st.sampled_from(ST_FILES), ops=mutations)
def test_safetensors_mutations(base: bytes, ops: list[tuple[str, int, int]]) -> None:
    data = _mutate(base, ops)
    got = _only_protocol_errors(lambda: parse_safetensors(data))
    if got is not None:
        _check_stfile(got, data)


@FUZZ
@given(base=st.sampled_from(ST_FILES[:3]), change=st.data())
def test_safetensors_header_mutations(base: bytes, change: st.DataObject) -> None:
    """Rewrite one node of the JSON header, keep the data bytes."""
    hlen = int.from_bytes(base[:8], "little")
    header = json.loads(base[8 : 8 + hlen])
    path = change.draw(st.sampled_from(_paths(header)))
    delete = bool(path) and change.draw(st.booleans())
    new_header = _dumps(_replace_at(header, path, change.draw(json_values), delete))
    data = len(new_header).to_bytes(8, "little") + new_header + base[8 + hlen :]
    got = _only_protocol_errors(lambda: parse_safetensors(data))
    if got is not None:
        _check_stfile(got, data)


def test_safetensors_pathological_headers() -> None:
    for header in (b"[" * 50_000, b'{"a":' * 30_000, b'{"x":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}}'):
        data = len(header).to_bytes(8, "little") + header
        with pytest.raises(ProtocolError):
            parse_safetensors(data)
    with pytest.raises(ProtocolError):
        parse_safetensors((2**64 - 1).to_bytes(8, "little") + b"{}")


# ----------------------------------------------------------------- manifests and HEAD


def _parse_manifest(data: bytes) -> None:
    m = _only_protocol_errors(lambda: Manifest.from_json(data))
    if m is not None:  # whatever parses writes back canonically and parses to the same record
        assert Manifest.from_json(m.to_json()) == m


@FUZZ
@given(data=st.binary(max_size=400))
def test_manifest_random_bytes(data: bytes) -> None:
    _parse_manifest(data)
    _only_protocol_errors(lambda: Head.from_json(data))


@FUZZ
@given(base=st.sampled_from(MANIFESTS), ops=mutations)
def test_manifest_byte_mutations(base: bytes, ops: list[tuple[str, int, int]]) -> None:
    _parse_manifest(_mutate(base, ops))


@FUZZ
@given(base=st.sampled_from(MANIFESTS), change=st.data())
def test_manifest_structural_mutations(base: bytes, change: st.DataObject) -> None:
    doc = json.loads(base)
    for _ in range(change.draw(st.integers(1, 2))):
        path = change.draw(st.sampled_from(_paths(doc)))
        delete = bool(path) and change.draw(st.booleans())
        doc = _replace_at(doc, path, change.draw(json_values), delete)
    _parse_manifest(_dumps(doc))


@FUZZ
@given(change=st.data(), ops=st.lists(_OPS, max_size=3))
def test_head_mutations(change: st.DataObject, ops: list[tuple[str, int, int]]) -> None:
    doc = json.loads(HEAD)
    path = change.draw(st.sampled_from(_paths(doc)))
    doc = _replace_at(doc, path, change.draw(json_values), bool(path) and change.draw(st.booleans()))
    data = _mutate(_dumps(doc), ops) if ops else _dumps(doc)
    head = _only_protocol_errors(lambda: Head.from_json(data))
    if head is not None:
        assert Head.from_json(head.to_json()) == head


# ----------------------------------------------------------------- encodings

_CODINGS_POS = st.sampled_from(["rice", "rice", "rice", "dense", "gaps"])
_CODINGS_VAL = st.sampled_from(["xor-rank", "xor-rank", "raw", "raw", "plain"])
_BITS = st.sampled_from([np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)])


def _check_positions(pos: Any, count: int, numel: int) -> None:
    assert pos.dtype == np.int64 and pos.shape == (count,)
    assert int(pos[0]) >= 0 and int(pos[-1]) < numel
    assert bool(np.all(np.diff(pos) > 0))


@FUZZ
@given(
    blob=st.binary(max_size=300),
    coding=_CODINGS_POS,
    k=st.integers(-2, 70),
    count=st.integers(-2, 600),
    numel=st.integers(1, 5000),
)
def test_positions_random(blob: bytes, coding: str, k: int, count: int, numel: int) -> None:
    pos = _only_protocol_errors(lambda: decode_positions(blob, coding, k, count, numel, "fuzz"))
    if pos is not None:
        _check_positions(pos, count, numel)


@FUZZ
@given(
    case=st.sampled_from(PATCHES),
    ops=st.lists(_OPS, max_size=3),
    dk=st.sampled_from([0, 0, 0, -1, 1, 40, 60]),
    dcount=st.sampled_from([0, 0, 0, -1, 1, 7]),
    as_memoryview=st.booleans(),
)
def test_positions_mutations(
    case: tuple[EncodedTensor, int, np.dtype[Any]],
    ops: list[tuple[str, int, int]],
    dk: int,
    dcount: int,
    as_memoryview: bool,
) -> None:
    enc, numel, _ = case
    blob = _mutate(enc.pos_blob, ops)
    count = enc.count + dcount
    src: bytes | memoryview = memoryview(blob) if as_memoryview else blob
    pos = _only_protocol_errors(lambda: decode_positions(src, enc.positions, enc.rice_k + dk, count, numel, "fuzz"))
    if pos is not None:
        _check_positions(pos, count, numel)


@FUZZ
@given(blob=st.binary(max_size=300), coding=_CODINGS_VAL, count=st.integers(1, 600), bits=_BITS)
def test_values_random(blob: bytes, coding: str, count: int, bits: np.dtype[Any]) -> None:
    vals = _only_protocol_errors(lambda: decode_values(blob, coding, count, bits, "fuzz"))
    if vals is not None:
        assert vals.dtype == bits and vals.shape == (count,)


@FUZZ
@given(
    case=st.sampled_from(PATCHES),
    ops=st.lists(_OPS, max_size=3),
    dcount=st.sampled_from([0, 0, 0, -1, 1, 100]),
    other_bits=st.one_of(st.none(), _BITS),
    as_memoryview=st.booleans(),
)
def test_values_mutations(
    case: tuple[EncodedTensor, int, np.dtype[Any]],
    ops: list[tuple[str, int, int]],
    dcount: int,
    other_bits: np.dtype[Any] | None,
    as_memoryview: bool,
) -> None:
    enc, _, bits = case
    bits = other_bits or bits
    count = max(1, enc.count + dcount)
    blob = _mutate(enc.val_blob, ops)
    src: bytes | memoryview = memoryview(blob) if as_memoryview else blob
    vals = _only_protocol_errors(lambda: decode_values(src, enc.values, count, bits, "fuzz"))
    if vals is not None:
        assert vals.dtype == bits and vals.shape == (count,)


@FUZZ
@given(
    tlen=st.integers(0, 300),
    table=st.binary(max_size=64),
    ranks=st.binary(min_size=1, max_size=40),
    escapes=st.binary(max_size=40),
    rlen_delta=st.sampled_from([0, 0, -1, 1, 2**31]),
    bits=_BITS,
)
def test_xor_rank_layout_fields(
    tlen: int, table: bytes, ranks: bytes, escapes: bytes, rlen_delta: int, bits: np.dtype[Any]
) -> None:
    """A well-framed xor-rank blob with arbitrary table size, ranks and escape stream."""
    import zstandard

    rank_z = zstandard.ZstdCompressor(write_content_size=True).compress(ranks)
    esc_z = zstandard.ZstdCompressor(write_content_size=True).compress(escapes) if escapes else b""
    blob = (
        (tlen % 65536).to_bytes(2, "little")
        + (table * (tlen * bits.itemsize // max(len(table), 1) + 1))[: tlen * bits.itemsize]
        + ((len(rank_z) + rlen_delta) % 2**32).to_bytes(4, "little")
        + rank_z
        + esc_z
    )
    vals = _only_protocol_errors(lambda: decode_values(blob, "xor-rank", len(ranks), bits, "fuzz"))
    if vals is not None:
        assert vals.shape == (len(ranks),)


# ----------------------------------------------------------------- hostile manifests


def _doc(base: bytes = MANIFESTS[0]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(base)
    return doc


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "/etc/passwd",
        "a/b",
        ".hidden",
        "..",
        "",
        "a\\b",
        "x\n",
        "manifest.json",
        "é.bin",
        "a" * 200,
        # a writer's subfolder is the one nesting allowed, exactly w<1-32 letters/digits>/<plain name>
        "wab12/../x",
        "wab12/..",
        "w/x",
        "wab12/c/x",
        "x/wab12/y",
        "wab12/.x",
        "/wab12/x",
        "wab12//x",
        "wab12/",
        "Wab12/x",
        "w-ab/x",
        "wa.b/x",
        "wé/x",
        "w" + "a" * 33 + "/x",
        "wab12\\x",
        "wab12/manifest.json",
        "wab12/" + "a" * 200,
    ],
)
def test_hostile_file_names(name: str) -> None:
    doc = _doc()
    doc["files"][0]["path"] = name
    with pytest.raises(ProtocolError, match="invalid file|itself"):
        Manifest.from_json(_dumps(doc))
    doc = _doc()
    doc["entries"][0]["file"] = name
    with pytest.raises(ProtocolError):
        Manifest.from_json(_dumps(doc))


@pytest.mark.parametrize(
    "name", ["patch-00000.safetensors", "wab12/patch-00000.safetensors", "w" + "Z9" * 16 + "/" + "p" * 128]
)
def test_plain_and_writer_subfolder_file_names_parse(name: str) -> None:
    """Plain names (runs written before the writer subfolders) and ``w<writer id>/<plain name>``."""
    doc = _doc()
    doc["files"][0]["path"] = doc["entries"][0]["file"] = name
    m = Manifest.from_json(_dumps(doc))
    assert m.files[0].path == name and m.entries[0].file == name
    assert file_key(3, name) == f"steps/000000000003/{name}"
    assert span_file_key(1, 3, name) == f"spans/000000000001-000000000003/{name}"


@pytest.mark.parametrize("version", [3, 0, -1, "1", None, True, 1.0, 2.0, [1], "missing"])
def test_unknown_format_version(version: Any) -> None:
    for base in (MANIFESTS[0], HEAD):
        doc = _doc(base)
        if version == "missing":
            del doc["format_version"]
        else:
            doc["format_version"] = version
        parse = Manifest.from_json if base is not HEAD else Head.from_json
        with pytest.raises(UnsupportedVersion, match="format_version"):
            parse(_dumps(doc))


def test_version_is_checked_before_anything_else() -> None:
    """A newer writer may change every other field; the reader must still say 'version'."""
    with pytest.raises(UnsupportedVersion):
        Manifest.from_json(b'{"format_version": 3, "whatever": []}')


def test_inventory_digest_mismatch() -> None:
    doc = _doc()
    doc["inventory"][0]["shape"] = [8, 4]
    with pytest.raises(ProtocolError, match="inventory_digest"):
        Manifest.from_json(_dumps(doc))


@pytest.mark.parametrize(
    ("field", "value"),
    [("positions_range", [390, 401]), ("values_range", [0, 401]), ("values_range", [5, 4])],
)
def test_patch_ranges_past_file_size(field: str, value: list[int]) -> None:
    doc = _doc()
    doc["entries"][0][field] = value
    with pytest.raises(ProtocolError):
        Manifest.from_json(_dumps(doc))


def test_anchor_ranges_must_fit_file_and_tensor() -> None:
    base = _anchor_manifest()
    for rng in ([190, 202], [132, 195], [0, 64]):
        doc = _doc(base.to_json())
        doc["entries"][1]["range"] = rng
        if rng == [0, 64]:  # fits the file and the size: structurally fine (the fetcher checks the header)
            Manifest.from_json(_dumps(doc))
            continue
        with pytest.raises(ProtocolError):
            Manifest.from_json(_dumps(doc))
    doc = _doc(base.to_json())
    del doc["entries"][0]
    with pytest.raises(ProtocolError, match="every tensor"):
        Manifest.from_json(_dumps(doc))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["entries"][0].update(tensor="nope"),
        lambda d: d["entries"][0].update(count=33),
        lambda d: d["entries"][0].update(count=0),
        lambda d: d["entries"][0].update(positions="dense"),
        lambda d: d["entries"][0].update(rice_k=63),
        lambda d: d["entries"].append(dict(d["entries"][0])),
        lambda d: d["tensor_digests"].update(ghost="00" * 16),
        lambda d: d["tensor_digests"].update(w="AB" * 16),
        lambda d: d.update(parent_step=3),
        lambda d: d.update(parent_digest=None),
        lambda d: d.update(parent_step=None, parent_digest=None),
        lambda d: d.update(anchor_step=3),
        lambda d: d.update(kind="delta"),
        lambda d: d.update(step=10**12),
        lambda d: d.update(run_id="\ud800"),
        lambda d: d.update(extra={"k": 1}),
        lambda d: d.update(signature="z" * 64),
        lambda d: d.update(signature="é" * 64),
        lambda d: d.update(surprise=1),
        lambda d: d["files"].append(dict(d["files"][0])),
        lambda d: d["inventory"][0].update(dtype="F4"),
        lambda d: d["inventory"][0].update(shape=[-1, 8]),
        lambda d: d["stats"].update(nbytes=-1),
    ],
)
def test_hostile_manifest_fields(mutate: Callable[[dict[str, Any]], None]) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(ProtocolError):
        Manifest.from_json(json.dumps(doc).encode())


def test_pathological_json() -> None:
    for data in (b"[" * 100_000, b"\xff\xfe", b"", b"{" + b'"a":' * 50_000, b'{"format_version":1e999}', b"NaN"):
        with pytest.raises(ProtocolError):
            Manifest.from_json(data)
        with pytest.raises(ProtocolError):
            Head.from_json(data)
    doc = _doc()
    doc["stats"]["changed"] = float("nan")
    with pytest.raises(ProtocolError):
        Manifest.from_json(json.dumps(doc).encode())


def test_head_is_a_hint_with_a_digest() -> None:
    assert Head.from_json(HEAD) == Head(12, "0f" * 16, "fuzz")
    assert len(xxh3_128(MANIFESTS[0])) == 32
    with pytest.raises(ProtocolError):
        Head.from_json(HEAD.replace(b"0f", b"0F", 1))


# ----------------------------------------------------------------- regressions


def test_rice_quotient_that_overflows_int64_is_rejected() -> None:
    """q << k used to wrap silently in int64 (k=62, q=4 -> gap 0): wrong positions, no error."""
    k, count = 62, 2
    unary = bytes([0b00011110])  # LSB first: 0 -> q=0, 1111 0 -> q=4
    rem = bytes(k * ((count + 7) // 8))  # k bit planes of ceil(count / 8) bytes
    with pytest.raises(ProtocolError, match="gap"):
        decode_positions(unary + rem, "rice", k, count, 100, "t")
    # q=2, k=62 wraps to a negative gap: positions would decrease
    with pytest.raises(ProtocolError):
        decode_positions(bytes([0b0000_0110]) + bytes(k * 1), "rice", k, 3, 1000, "t")


def test_big_rice_z_quotients_roundtrip_and_are_checked() -> None:
    """Quotients >= 255 leave the pair stream for a u64 side stream; a tampered one is refused."""
    idx = np.concatenate([np.arange(0, 5000, dtype=np.int64), np.array([5_000_000, 9_000_000])])
    coding, k, blob = positions.encode_positions(idx)
    assert coding == "rice-z"
    np.testing.assert_array_equal(decode_positions(blob, coding, k, idx.size, 10_000_000, "t"), idx)
    with pytest.raises(ProtocolError):
        decode_positions(blob, coding, k, idx.size, 8_000_000, "t")  # the last gap runs outside
    with pytest.raises(ProtocolError):
        decode_positions(blob[:-1], coding, k, idx.size, 10_000_000, "t")


def test_trailing_bytes_after_a_zstd_frame_are_rejected() -> None:
    enc = next(p[0] for p in PATCHES if p[0].values == "raw")
    bits = next(p[2] for p in PATCHES if p[0].values == "raw")
    decode_values(enc.val_blob, "raw", enc.count, bits, "t")
    with pytest.raises(ProtocolError):
        decode_values(enc.val_blob + b"\0", "raw", enc.count, bits, "t")
    with pytest.raises(ProtocolError):
        decode_values(enc.val_blob + enc.val_blob, "raw", enc.count, bits, "t")


def test_empty_rank_table_with_ranks_is_rejected() -> None:
    """tlen=0 and a rank 0 used to index the empty table (IndexError)."""
    import zstandard

    rank_z = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0\0\0")
    blob = (0).to_bytes(2, "little") + len(rank_z).to_bytes(4, "little") + rank_z
    with pytest.raises(ProtocolError, match="rank"):
        decode_values(blob, "xor-rank", 3, np.dtype(np.int16), "t")


@pytest.mark.parametrize("meta", [b"[]", b'""', b"0", b"false", b'{"k":1}'])
def test_safetensors_metadata_must_be_a_string_map(meta: bytes) -> None:
    header = b'{"__metadata__":' + meta + b"}"
    with pytest.raises(ProtocolError, match="__metadata__"):
        parse_safetensors(len(header).to_bytes(8, "little") + header)
    ok = b'{"__metadata__":null}'
    assert parse_safetensors(len(ok).to_bytes(8, "little") + ok).metadata == {}


# ----------------------------------------------------------------- whole patch files and anchors


def _patch_step() -> tuple[Manifest, dict[str, bytes]]:
    from deltasync.protocol import build_patch_files

    rng = np.random.default_rng(3)
    inv = (TensorInfo("a", "BF16", (64,)), TensorInfo("b", "F32", (40,)), TensorInfo("c", "U8", (5,)))
    items = []
    for t, n in zip(inv, (9, 30, 5), strict=True):
        bits = np.dtype({"BF16": np.int16, "F32": np.int32, "U8": np.int8}[t.dtype])
        idx = np.sort(rng.choice(t.numel, n, replace=False)).astype(np.int64)
        old = rng.integers(-100, 100, n).astype(bits)
        items.append((t.name, encode_changes(t.numel, idx, old, old ^ bits.type(3))))
    files, entries = build_patch_files(4, items, shard_bytes=60)
    infos = tuple(FileInfo(k, len(v), xxh3_128(v)) for k, v in sorted(files.items()))
    m = Manifest(
        run_id="r",
        step=4,
        kind="patch",
        parent_step=3,
        parent_digest="0" * 32,
        anchor_step=0,
        inventory=inv,
        inventory_digest=inventory_digest(inv),
        files=infos,
        entries=tuple(entries),
        tensor_digests={},
        stats=Stats(44, 109, sum(f.size for f in infos)),
    )
    return Manifest.from_json(m.to_json()), files


PATCH_STEP = _patch_step()


@FUZZ
@given(which=st.integers(0, 10), ops=mutations)
def test_patch_file_mutations(which: int, ops: list[tuple[str, int, int]]) -> None:
    """A mutated patch file (its manifest unchanged, as if its digest had been fixed up) decodes to
    counts the manifest allows, or raises ProtocolError."""
    from deltasync.protocol import decode_patch

    m, files = PATCH_STEP
    name = sorted(files)[which % len(files)]
    bad = {**files, name: _mutate(files[name], ops)}
    out = _only_protocol_errors(lambda: decode_patch(m, bad))
    for d in out or []:
        info = next(t for t in m.inventory if t.name == d.tensor)
        assert d.idx.size == d.values.size == d.entry.count <= info.numel
        assert d.idx.size == 0 or (int(d.idx.min()) >= 0 and int(d.idx.max()) < info.numel)


@FUZZ
@given(ops=mutations)
def test_anchor_shard_mutations(ops: list[tuple[str, int, int]]) -> None:
    """A mutated anchor shard yields arrays of exactly the inventory's sizes, or a ProtocolError."""
    from deltasync.protocol import anchor_arrays

    inv = (TensorInfo("x", "F16", (3, 4)), TensorInfo("y", "I64", (5,)), TensorInfo("z", "BOOL", ()))
    arrays = {"x": np.arange(12, dtype=np.int16), "y": np.arange(5, dtype=np.int64), "z": np.ones(1, np.int8)}
    m, files = anchor_manifest(inv, arrays)
    shard = next(k for k in files if k.endswith(".safetensors"))
    out = _only_protocol_errors(lambda: anchor_arrays(m, {**files, shard: _mutate(files[shard], ops)}))
    for t in inv:
        assert out is None or out[t.name].size == t.numel
