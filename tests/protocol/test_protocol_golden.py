"""Golden bytes of protocol v1: one tiny bf16 patch file and one manifest, frozen exactly.

If one of these tests fails, the wire format changed: either revert the change or
bump FORMAT_VERSION and update SPEC.md (readers of older runs must keep working).
The only legitimate drift is the zstd *encoder* (bundled libzstd) emitting different
frames after an upgrade; the decode tests below must keep passing regardless.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from deltasync.errors import ProtocolError, SignatureMismatch
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

pytestmark = pytest.mark.usefixtures("kernel_backend")  # each test on the compiled kernels and on numpy

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
A_POS = bytes.fromhex("0a030106")
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
    "15000000"  # u32 length of the rank pair stream: 21
    "11000000"  # pair stream: u32 length of its pair frame: 17
    "28b52ffd20084100000f000100000f0001"  # zstd frame of 8 pair bytes (15 * a + b); no escaped pairs
)

GOLDEN_FILE = bytes.fromhex(
    "3801000000000000"  # header length 312, little-endian u64
    "7b225f5f6d657461646174615f5f223a7b22666f726d6174223a2264656c746173796e632d7061746368222c"
    "2273746570223a2237227d2c22612f706f736974696f6e73223a7b22646174615f6f666673657473223a5b30"
    "2c345d2c226474797065223a225538222c227368617065223a5b345d7d2c22612f76616c756573223a7b2264"
    "6174615f6f666673657473223a5b342c31395d2c226474797065223a225538222c227368617065223a5b3135"
    "5d7d2c22622f706f736974696f6e73223a7b22646174615f6f666673657473223a5b31392c32355d2c226474"
    "797065223a225538222c227368617065223a5b365d7d2c22622f76616c756573223a7b22646174615f6f6666"
    "73657473223a5b32352c35365d2c226474797065223a225538222c227368617065223a5b33315d7d7d"
    "20202020202020"  # JSON header padded with spaces to a multiple of 8
    "0a030106"  # a/positions
    "28b52ffd20063100006e76573f4143"  # a/values
    "55555555feff"  # b/positions
    "020001000200150000001100000028b52ffd20084100000f000100000f0001"  # b/values
)
GOLDEN_FILE_XXH3 = "c44f18309ce1fd33b65f6e61d7ecbd43"
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
    remainders 3 (011), 5 (101), 4 (100) as 3 bit planes, LSB first:
    bit 0 of each: 1,1,0 -> 0x03; bit 1: 1,0,0 -> 0x01; bit 2: 0,1,1 -> 0x06."""
    assert bytes([0b01010, 0b011, 0b001, 0b110]) == A_POS


def test_pair_stream_golden_by_hand() -> None:
    """B's ranks 1,0,0,0,0,1,0,0,0,0,1,0,0,0,0,1 pair up as (1,0) (0,0) (0,1) (0,0) (0,0) (1,0)
    (0,0) (0,1) -> bytes 15 * a + b = 15, 0, 1, 0, 0, 15, 0, 1."""
    from deltasync.protocol.encoding import _decode_pairs

    ranks = _decode_pairs(B_VAL[10:], 16, "golden")
    assert ranks.tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_patch_file_bytes_are_frozen() -> None:
    data = to_bytes(_patch_tensors(), META)
    assert data == GOLDEN_FILE
    assert xxh3_128(data) == GOLDEN_FILE_XXH3
    st = parse_safetensors(data)
    assert st.metadata == META
    assert st.data_start == 320
    ranges = {n: (e.start, e.end) for n, e in st.entries.items()}
    assert ranges == {
        "a/positions": (320, 324),
        "a/values": (324, 339),
        "b/positions": (339, 345),
        "b/values": (345, 376),
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
    b'"positions_range":[320,324],"rice_k":3,"tensor":"a","values":"raw","values_range":[324,339]},'
    b'{"count":16,"file":"patch-00000.safetensors","positions":"rice","positions_range":[339,345],'
    b'"rice_k":1,"tensor":"b","values":"xor-rank","values_range":[345,376]}],"extra":{"trainer":"golden"},'
    b'"files":[{"path":"patch-00000.safetensors","size":376,"xxh3_128":"c44f18309ce1fd33b65f6e61d7ecbd43"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"patch","parent_digest":"0123456789abcdef0123456789abcdef","parent_step":6,"run_id":"golden-run",'
    b'"stats":{"changed":19,"nbytes":376,"total":96},"step":7,'
    b'"tensor_digests":{"a":"8bed3924046de2eba8c8f841ddffd2b2","b":"d8cef1d4b31508383c101efb4a4bf0cb"}}'
)
GOLDEN_MANIFEST_DIGEST = "03b7d74182dc3d5d552558d09e5a7798"
GOLDEN_KEY = b"golden-key"
GOLDEN_SIGNATURE = "47d37d14049475074b318f07dde9b196bb8b9080f730213685fe669f73c09b3e"


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
            PatchEntry("a", PATCH_FILE, 3, "rice", 3, "raw", ByteRange(320, 324), ByteRange(324, 339)),
            PatchEntry("b", PATCH_FILE, 16, "rice", 1, "xor-rank", ByteRange(339, 345), ByteRange(345, 376)),
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
        dataclasses.replace(s, stats=Stats(19, 96, 377)),
        dataclasses.replace(s, tensor_digests={"a": B_DIGEST, "b": A_DIGEST}),
        dataclasses.replace(s, extra={}),
        Manifest.from_json(body.replace(b'"changed":19', b'"changed":18')),
        Manifest.from_json(body.replace(GOLDEN_SIGNATURE.encode(), b"0" * 64)),
    ):
        with pytest.raises(SignatureMismatch):
            tampered.check_signature(GOLDEN_KEY)


# ----------------------------------------------------------------- the uploader's real output

WRITER_ID = "0123456789abcdef"
# the uploader puts its data files in its own subfolder (SPEC.md "Commit rule"): w<writer id>/<name>
OWN = f"w{WRITER_ID}/"
UPLOADER_ANCHOR_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"file":"w0123456789abcdef/model-00001-of-00001.safetensors","range":[160,224],'
    b'"tensor":"a"},{"file":"w0123456789abcdef/model-00001-of-00001.safetensors","range":[224,352],"tensor":"b"}],'
    b'"files":[{"path":"w0123456789abcdef/model-00001-of-00001.safetensors","size":352,'
    b'"xxh3_128":"f736e2b2a79e4197df70e79d27ee5e2f"},'
    b'{"path":"w0123456789abcdef/model.safetensors.index.json","size":157,"xxh3_128":"778e0171526a7ac3cffa8de9b97932ff"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"anchor","parent_digest":null,"parent_step":null,"run_id":"golden-run",'
    b'"stats":{"changed":96,"nbytes":509,"total":96},"step":6,'
    b'"tensor_digests":{"a":"da6c9e4b687342c81dd7ce2ac604785c","b":"40f8621420eaf2211c7dc0e745a9b352"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)
UPLOADER_PATCH_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"count":3,"file":"w0123456789abcdef/patch-00000.safetensors","positions":"rice",'
    b'"positions_range":[320,324],"rice_k":3,"tensor":"a","values":"raw","values_range":[324,339]},'
    b'{"count":16,"file":"w0123456789abcdef/patch-00000.safetensors","positions":"rice","positions_range":[339,345],'
    b'"rice_k":1,"tensor":"b","values":"xor-rank","values_range":[345,376]}],'
    b'"files":[{"path":"w0123456789abcdef/patch-00000.safetensors","size":376,'
    b'"xxh3_128":"c44f18309ce1fd33b65f6e61d7ecbd43"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"patch","parent_digest":"31f4ae9b5e668ff1ef65a224a1cc0a9f","parent_step":6,"run_id":"golden-run",'
    b'"stats":{"changed":19,"nbytes":376,"total":96},"step":7,'
    b'"tensor_digests":{"a":"8bed3924046de2eba8c8f841ddffd2b2","b":"d8cef1d4b31508383c101efb4a4bf0cb"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)
UPLOADER_HEAD = (
    b'{"format_version":1,"manifest_digest":"05e80d8213ddccd7250e30083d282f30","run_id":"golden-run","step":7}'
)


UPLOADER_CLAIM = b'{"after_step":null,"epoch":1,"format_version":1,"writer":"0123456789abcdef"}'


def test_uploader_output_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeltaUploader's REAL objects for a tiny bf16 state pushed twice, to the byte.

    The run id is an option; the writer id is random by nature (a uuid4), so it is
    fixed here by patching ``uuid.uuid4``. Everything else is a pure function of
    the two states: the step-7 patch file is exactly GOLDEN_FILE above.
    """
    import uuid

    torch = pytest.importorskip("torch")
    import deltasync as ds

    def state(a: np.ndarray, b: np.ndarray) -> dict[str, object]:
        return {
            "a": torch.from_numpy(a.copy()).view(torch.bfloat16).reshape(4, 8),
            "b": torch.from_numpy(b.copy()).view(torch.bfloat16).reshape(8, 8),
        }

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(WRITER_ID * 2))
    store = ds.MemoryStore("golden")
    # format 1 as written before format 2 became the default (test_protocol_golden_v2.py freezes 2)
    with ds.DeltaUploader(store, run_id="golden-run", encode_threads=1, format_version=1) as up:
        assert up.push(state(A_OLD, B_OLD), 6).result(30).kind == "anchor"
        assert up.push(state(A_NEW, B_NEW), 7).result(30).kind == "patch"
    objs = store.get_many([o.key for o in store.list("")])
    assert sorted(objs) == [
        "HEAD.json",
        "steps/000000000006/manifest.json",
        f"steps/000000000006/{OWN}model-00001-of-00001.safetensors",
        f"steps/000000000006/{OWN}model.safetensors.index.json",
        "steps/000000000007/manifest.json",
        f"steps/000000000007/{OWN}patch-00000.safetensors",
        "writers/000000000001.json",
    ]
    assert objs[f"steps/000000000007/{OWN}patch-00000.safetensors"] == GOLDEN_FILE
    assert objs["steps/000000000006/manifest.json"] == UPLOADER_ANCHOR_MANIFEST
    assert xxh3_128(UPLOADER_ANCHOR_MANIFEST) == "31f4ae9b5e668ff1ef65a224a1cc0a9f"
    assert objs["steps/000000000007/manifest.json"] == UPLOADER_PATCH_MANIFEST
    assert objs["HEAD.json"] == UPLOADER_HEAD
    assert xxh3_128(UPLOADER_PATCH_MANIFEST) == "05e80d8213ddccd7250e30083d282f30"
    assert objs["writers/000000000001.json"] == UPLOADER_CLAIM
    # the anchor is an ordinary checkpoint of the first state
    st = parse_safetensors(objs[f"steps/000000000006/{OWN}model-00001-of-00001.safetensors"])
    a = st.entries["a"]
    assert (a.dtype, a.shape) == ("BF16", (4, 8))
    raw = objs[f"steps/000000000006/{OWN}model-00001-of-00001.safetensors"][a.start : a.end]
    assert np.frombuffer(raw, "<i2").tolist() == A_OLD.tolist()
    # the writer's subfolder is an HF checkpoint dir: its index names the shards relative to itself,
    # and is byte for byte the index of the plain-named layout (older runs)
    index_bytes = objs[f"steps/000000000006/{OWN}model.safetensors.index.json"]
    assert json.loads(index_bytes)["weight_map"] == dict.fromkeys(["a", "b"], "model-00001-of-00001.safetensors")
    assert (len(index_bytes), xxh3_128(index_bytes)) == (157, "778e0171526a7ac3cffa8de9b97932ff")
    # and the patch decodes through the protocol's patch-file reader
    from deltasync.protocol import decode_patch

    m = Manifest.from_json(UPLOADER_PATCH_MANIFEST)
    decoded = decode_patch(m, {OWN + PATCH_FILE: GOLDEN_FILE})
    assert [(d.tensor, d.coding, d.idx.tolist()) for d in decoded] == [
        ("a", "raw", A_IDX.tolist()),
        ("b", "xor-rank", B_IDX.tolist()),
    ]


# The same two pushes as written before the writers' subfolders (plain names in the step's folder):
# frozen, so that runs of that layout keep reading (SPEC.md "Layout").
PLAIN_ANCHOR_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"file":"model-00001-of-00001.safetensors","range":[160,224],"tensor":"a"},'
    b'{"file":"model-00001-of-00001.safetensors","range":[224,352],"tensor":"b"}],'
    b'"files":[{"path":"model-00001-of-00001.safetensors","size":352,"xxh3_128":"f736e2b2a79e4197df70e79d27ee5e2f"},'
    b'{"path":"model.safetensors.index.json","size":157,"xxh3_128":"778e0171526a7ac3cffa8de9b97932ff"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"anchor","parent_digest":null,"parent_step":null,"run_id":"golden-run",'
    b'"stats":{"changed":96,"nbytes":509,"total":96},"step":6,'
    b'"tensor_digests":{"a":"da6c9e4b687342c81dd7ce2ac604785c","b":"40f8621420eaf2211c7dc0e745a9b352"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)
PLAIN_PATCH_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"count":3,"file":"patch-00000.safetensors","positions":"rice",'
    b'"positions_range":[320,324],"rice_k":3,"tensor":"a","values":"raw","values_range":[324,339]},'
    b'{"count":16,"file":"patch-00000.safetensors","positions":"rice","positions_range":[339,345],'
    b'"rice_k":1,"tensor":"b","values":"xor-rank","values_range":[345,376]}],'
    b'"files":[{"path":"patch-00000.safetensors","size":376,"xxh3_128":"c44f18309ce1fd33b65f6e61d7ecbd43"}],'
    b'"format_version":1,"inventory":[{"dtype":"BF16","name":"a","shape":[4,8]},'
    b'{"dtype":"BF16","name":"b","shape":[8,8]}],"inventory_digest":"b908d424c1b631a1056774eab2ac0122",'
    b'"kind":"patch","parent_digest":"cc68b65e0d50f822a2ef2651da83fd6c","parent_step":6,"run_id":"golden-run",'
    b'"stats":{"changed":19,"nbytes":376,"total":96},"step":7,'
    b'"tensor_digests":{"a":"8bed3924046de2eba8c8f841ddffd2b2","b":"d8cef1d4b31508383c101efb4a4bf0cb"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)


def test_a_run_with_plain_names_reads_as_before(tmp_path: Path) -> None:
    """A run of the plain-name layout (frozen manifests; the data files are those bytes, as their
    checksums prove) syncs and materializes bit-exact with full verification, and verifies."""
    torch = pytest.importorskip("torch")
    import deltasync as ds
    from deltasync.protocol import Head, TensorInfo
    from deltasync.protocol.checkpoint import build_checkpoint
    from deltasync.run.audit import verify_run

    inventory = (TensorInfo("a", "BF16", (4, 8)), TensorInfo("b", "BF16", (8, 8)))
    files, _ = build_checkpoint(inventory, {"a": A_OLD, "b": B_OLD}, 2 << 30)
    assert sorted(files) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    store = ds.MemoryStore("plain")
    store.put_many({f"steps/000000000006/{n}": d for n, d in files.items()})
    store.put("steps/000000000007/patch-00000.safetensors", GOLDEN_FILE)
    store.put("steps/000000000006/manifest.json", PLAIN_ANCHOR_MANIFEST)
    store.put("steps/000000000007/manifest.json", PLAIN_PATCH_MANIFEST)
    store.put("HEAD.json", Head(7, xxh3_128(PLAIN_PATCH_MANIFEST), "golden-run").to_json())
    fetcher = ds.DeltaFetcher(store, verify="full")
    target = {"a": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(8, 8, dtype=torch.bfloat16)}
    for step, (a, b) in ((6, (A_OLD, B_OLD)), (7, (A_NEW, B_NEW))):
        assert fetcher.sync(target, step=step) == step
        assert target["a"].view(torch.int16).flatten().tolist() == a.tolist()
        assert target["b"].view(torch.int16).flatten().tolist() == b.tolist()
    out = fetcher.materialize(tmp_path / "ckpt")
    from safetensors.torch import load_file

    loaded = load_file(str(out / "model-00001-of-00001.safetensors"))
    assert loaded["a"].view(torch.int16).flatten().tolist() == A_NEW.tolist()
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["b"] == (
        "model-00001-of-00001.safetensors"
    )
    assert [c.line() for c in verify_run(store)] == ["step 6: OK", "step 7: OK"]


@pytest.mark.parametrize(
    ("writer_id", "name", "expected"),
    [
        ("0123456789abcdef", "patch-00000.safetensors", "w0123456789abcdef/patch-00000.safetensors"),
        ("A1", "model.safetensors.index.json", "wA1/model.safetensors.index.json"),
        ("Z" * 32, "model-00001-of-00002.safetensors", f"w{'Z' * 32}/model-00001-of-00002.safetensors"),
    ],
)
def test_writer_file_names(writer_id: str, name: str, expected: str) -> None:
    from deltasync.protocol import writer_file_name

    assert writer_file_name(writer_id, name) == expected


@pytest.mark.parametrize("writer_id", ["", "a-b", "a/b", "../x", "é", "a" * 33, 7])
def test_writer_ids_that_cannot_name_files_are_refused(writer_id: Any) -> None:
    from deltasync.protocol import writer_file_name

    with pytest.raises(ProtocolError, match="cannot name files"):
        writer_file_name(writer_id, "patch-00000.safetensors")
