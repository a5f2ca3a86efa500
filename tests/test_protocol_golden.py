"""Golden bytes of protocol v1: one tiny bf16 patch file and one manifest, frozen exactly.

If one of these tests fails, the wire format changed: either revert the change or
bump FORMAT_VERSION and update SPEC.md (readers of older runs must keep working).
The only legitimate drift is the zstd *encoder* (bundled libzstd) emitting different
frames after an upgrade; the decode tests below must keep passing regardless.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from deltasync.errors import SignatureMismatch
from deltasync.protocol import (
    ByteRange,
    FileInfo,
    Manifest,
    PatchEntry,
    Stats,
    TensorInfo,
    decode_positions,
    decode_values,
    encode_changes,
    inventory_digest,
    xxh3_128,
)
from deltasync.protocol.encoding import apply_values
from deltasync.protocol.safetensors_io import TensorBytes, parse_safetensors, to_bytes

# ----------------------------------------------------------------- the patch

PATCH_FILE = "patch-00000.safetensors"
META = {"format": "deltasync-patch", "step": "7"}


def _bf16_bits(n: int) -> np.ndarray:
    """Fixed bf16 bit patterns (0x3f00 + 37 i: values around 0.5 .. 2)."""
    return (np.arange(n, dtype=np.int16) * 37 + 0x3F00).astype(np.int16)


# tensor "a": 4x8 bf16, elements 3, 17 and 30 change (Rice k=3 positions, raw values)
A_OLD = _bf16_bits(32)
A_IDX = np.array([3, 17, 30], dtype=np.int64)
A_NEW = A_OLD.copy()
A_NEW[A_IDX] ^= np.array([0x0001, 0x0003, 0x0001], dtype=np.int16)
A_POS = bytes.fromhex("0a2b01")
A_VAL = bytes.fromhex("28b52ffd20063100006e76573f4143")

# tensor "b": 8x8 bf16, every 4th element from 2 flips its low bit(s) (Rice k=1, xor-rank)
B_OLD = _bf16_bits(64)
B_IDX = np.arange(2, 64, 4, dtype=np.int64)
B_XOR = np.where(np.arange(16) % 5 == 0, 2, 1).astype(np.int16)
B_NEW = B_OLD.copy()
B_NEW[B_IDX] ^= B_XOR
B_POS = bytes.fromhex("55555555feff")
B_VAL = bytes.fromhex(
    "0200"  # u16 table length: 2
    "01000200"  # the table, most frequent first: XOR 0x0001, XOR 0x0002
    "14000000"  # u32 length of the rank stream: 20
    "28b52ffd20105d00002801000000000100308a16"  # zstd frame of the 16 ranks; no escapes follow
)

GOLDEN_FILE = bytes.fromhex(
    "3801000000000000"  # header length 312, little-endian u64
    "7b225f5f6d657461646174615f5f223a7b22666f726d6174223a2264656c746173796e632d7061746368222c"
    "2273746570223a2237227d2c22612f706f736974696f6e73223a7b22646174615f6f666673657473223a5b30"
    "2c335d2c226474797065223a225538222c227368617065223a5b335d7d2c22612f76616c756573223a7b2264"
    "6174615f6f666673657473223a5b332c31385d2c226474797065223a225538222c227368617065223a5b3135"
    "5d7d2c22622f706f736974696f6e73223a7b22646174615f6f666673657473223a5b31382c32345d2c226474"
    "797065223a225538222c227368617065223a5b365d7d2c22622f76616c756573223a7b22646174615f6f6666"
    "73657473223a5b32342c35345d2c226474797065223a225538222c227368617065223a5b33305d7d7d"
    "20202020202020"  # JSON header padded with spaces to a multiple of 8
    "0a2b01"  # a/positions
    "28b52ffd20063100006e76573f4143"  # a/values
    "55555555feff"  # b/positions
    "0200010002001400000028b52ffd20105d00002801000000000100308a16"  # b/values
)
GOLDEN_FILE_XXH3 = "cf1100cdefc0c7b66c8ce328374adcc5"
A_DIGEST = "8bed3924046de2eba8c8f841ddffd2b2"  # xxh3-128 of A_NEW's little-endian bytes
B_DIGEST = "d8cef1d4b31508383c101efb4a4bf0cb"


def _patch_tensors() -> list[TensorBytes]:
    return [
        TensorBytes("a/positions", "U8", (len(A_POS),), A_POS),
        TensorBytes("a/values", "U8", (len(A_VAL),), A_VAL),
        TensorBytes("b/positions", "U8", (len(B_POS),), B_POS),
        TensorBytes("b/values", "U8", (len(B_VAL),), B_VAL),
    ]


def test_encoder_emits_the_golden_blobs() -> None:
    a = encode_changes(32, A_IDX, A_OLD[A_IDX], A_NEW[A_IDX])
    assert (a.count, a.positions, a.rice_k, a.values) == (3, "rice", 3, "raw")
    assert (a.pos_blob, a.val_blob) == (A_POS, A_VAL)
    b = encode_changes(64, B_IDX, B_OLD[B_IDX], B_NEW[B_IDX])
    assert (b.count, b.positions, b.rice_k, b.values) == (16, "rice", 1, "xor-rank")
    assert (b.pos_blob, b.val_blob) == (B_POS, B_VAL)


@pytest.mark.parametrize(
    ("old", "new", "idx", "pos", "val", "k", "coding"),
    [
        (A_OLD, A_NEW, A_IDX, A_POS, A_VAL, 3, "raw"),
        (B_OLD, B_NEW, B_IDX, B_POS, B_VAL, 1, "xor-rank"),
    ],
)
def test_golden_blobs_decode(
    old: np.ndarray, new: np.ndarray, idx: np.ndarray, pos: bytes, val: bytes, k: int, coding: str
) -> None:
    got_pos = decode_positions(pos, "rice", k, idx.size, old.size, "golden")
    np.testing.assert_array_equal(got_pos, idx)
    out = old.copy()
    out[got_pos] = apply_values(coding, old[got_pos], decode_values(val, coding, idx.size, old.dtype, "golden"))
    np.testing.assert_array_equal(out, new)


def test_rice_golden_by_hand() -> None:
    """A's gaps 3, 13, 12 with k=3: quotients 0,1,1 -> unary bits 0 10 10 -> 0x0a;
    remainders 3,5,4 as 3 bits each, LSB first: 110 101 001 -> 0x2b 0x01."""
    assert bytes([0b01010, 0b00101011, 0b1]) == A_POS


def test_patch_file_bytes_are_frozen() -> None:
    data = to_bytes(_patch_tensors(), META)
    assert data == GOLDEN_FILE
    assert xxh3_128(data) == GOLDEN_FILE_XXH3
    st = parse_safetensors(data)
    assert st.metadata == META
    assert st.data_start == 320
    ranges = {n: (e.start, e.end) for n, e in st.entries.items()}
    assert ranges == {
        "a/positions": (320, 323),
        "a/values": (323, 338),
        "b/positions": (338, 344),
        "b/values": (344, 374),
    }


def test_safetensors_package_opens_the_patch(tmp_path: Path) -> None:
    loaded = safetensors.numpy.load(GOLDEN_FILE)
    expected = {t.name: bytes(t.data) for t in _patch_tensors()}
    assert sorted(loaded) == sorted(expected)
    for name, arr in loaded.items():
        assert arr.dtype == np.uint8 and arr.ndim == 1
        assert arr.tobytes() == expected[name]
    path = tmp_path / PATCH_FILE
    path.write_bytes(GOLDEN_FILE)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == META
        assert f.get_tensor("b/values").tobytes() == B_VAL


def test_safetensors_package_writes_what_we_read() -> None:
    """The reference writer's output parses with our strict reader, with the same tensors."""
    arrays: dict[str, np.ndarray] = {
        "x": np.arange(6, dtype=np.float32).reshape(2, 3),
        "y/positions": np.frombuffer(A_POS, np.uint8),
    }
    data = safetensors.numpy.save(arrays, metadata={"k": "v"})
    st = parse_safetensors(data)
    assert st.metadata == {"k": "v"}
    assert st.entries["x"].dtype == "F32" and st.entries["x"].shape == (2, 3)
    x = st.entries["x"]
    assert data[x.start : x.end] == arrays["x"].tobytes()


# ----------------------------------------------------------------- the manifest

INVENTORY = (TensorInfo("a", "BF16", (4, 8)), TensorInfo("b", "BF16", (8, 8)))
GOLDEN_MANIFEST = (
    b'{"anchor_step":0,"entries":[{"count":3,"file":"patch-00000.safetensors","positions":"rice",'
    b'"positions_range":[320,323],"rice_k":3,"tensor":"a","values":"raw","values_range":[323,338]},'
    b'{"count":16,"file":"patch-00000.safetensors","positions":"rice","positions_range":[338,344],'
    b'"rice_k":1,"tensor":"b","values":"xor-rank","values_range":[344,374]}],"extra":{"trainer":"golden"},'
    b'"files":[{"path":"patch-00000.safetensors","size":374,"xxh3_128":"cf1100cdefc0c7b66c8ce328374adcc5"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"patch","parent_digest":"0123456789abcdef0123456789abcdef","parent_step":6,"run_id":"golden-run",'
    b'"stats":{"changed":19,"nbytes":374,"total":96},"step":7,'
    b'"tensor_digests":{"a":"8bed3924046de2eba8c8f841ddffd2b2","b":"d8cef1d4b31508383c101efb4a4bf0cb"}}'
)
GOLDEN_MANIFEST_DIGEST = "b3d817324f70f5a9a85610e36473635a"
GOLDEN_KEY = b"golden-key"
GOLDEN_SIGNATURE = "7ea5106c99538b894f1d331c41222c95984940a7289655f040f995c8d826ff22"


def _manifest() -> Manifest:
    return Manifest(
        run_id="golden-run",
        step=7,
        kind="patch",
        parent_step=6,
        parent_digest="0123456789abcdef0123456789abcdef",
        anchor_step=0,
        inventory=INVENTORY,
        inventory_digest=inventory_digest(INVENTORY),
        files=(FileInfo(PATCH_FILE, len(GOLDEN_FILE), GOLDEN_FILE_XXH3),),
        entries=(
            PatchEntry("a", PATCH_FILE, 3, "rice", 3, "raw", ByteRange(320, 323), ByteRange(323, 338)),
            PatchEntry("b", PATCH_FILE, 16, "rice", 1, "xor-rank", ByteRange(338, 344), ByteRange(344, 374)),
        ),
        tensor_digests={"a": A_DIGEST, "b": B_DIGEST},
        stats=Stats(changed=19, total=96, nbytes=len(GOLDEN_FILE)),
        extra={"trainer": "golden"},
    )


def test_manifest_bytes_are_frozen() -> None:
    m = _manifest()
    assert m.inventory_digest == "b908d424c1b631a1056774eab2ac0122"
    assert m.to_json() == GOLDEN_MANIFEST
    assert xxh3_128(m.to_json()) == GOLDEN_MANIFEST_DIGEST


def test_manifest_roundtrip() -> None:
    m = _manifest()
    assert Manifest.from_json(GOLDEN_MANIFEST) == m
    assert Manifest.from_json(m.to_json()).to_json() == GOLDEN_MANIFEST


def test_tensor_digests_are_of_little_endian_bytes() -> None:
    assert xxh3_128(A_NEW.astype("<i2").tobytes()) == A_DIGEST
    assert xxh3_128(B_NEW.astype("<i2").tobytes()) == B_DIGEST
    assert xxh3_128(GOLDEN_FILE) == GOLDEN_FILE_XXH3


def test_signature_roundtrip_and_tamper() -> None:
    m = _manifest()
    s = m.signed(GOLDEN_KEY)
    assert s.signature == GOLDEN_SIGNATURE
    s.check_signature(GOLDEN_KEY)
    # the signature covers the body without itself; the stored bytes gain that one field
    body = s.to_json()
    assert body == GOLDEN_MANIFEST.replace(b'"stats":', b'"signature":"' + GOLDEN_SIGNATURE.encode() + b'","stats":')
    parsed = Manifest.from_json(body)
    assert parsed == s
    parsed.check_signature(GOLDEN_KEY)

    with pytest.raises(SignatureMismatch):
        s.check_signature(b"another-key")
    with pytest.raises(SignatureMismatch):
        m.check_signature(GOLDEN_KEY)  # unsigned while a key is configured
    for tampered in (
        dataclasses.replace(s, step=8),
        dataclasses.replace(s, stats=Stats(19, 96, 375)),
        dataclasses.replace(s, tensor_digests={"a": B_DIGEST, "b": A_DIGEST}),
        dataclasses.replace(s, extra={}),
        Manifest.from_json(body.replace(b'"changed":19', b'"changed":18')),
        Manifest.from_json(body.replace(GOLDEN_SIGNATURE.encode(), b"0" * 64)),
    ):
        with pytest.raises(SignatureMismatch):
            tampered.check_signature(GOLDEN_KEY)
