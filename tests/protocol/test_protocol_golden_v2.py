"""Golden bytes of manifest format 2 (SPEC.md "Manifest, format 2"), frozen exactly, and the checks a
format-2 reader makes on top of format 1's.

The states are test_protocol_golden.py's: the same two pushes, written as format 2. The patch file
holds one group entry for both tensors (named after the first), the manifest the inventory as one
zstd frame and the digests by inventory index. As there, the only legitimate drift is the zstd
encoder (bundled libzstd) emitting other frames after an upgrade; the decode tests must keep passing.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import numpy as np
import pytest
import zstandard
from test_protocol_golden import A_IDX, A_NEW, A_OLD, B_IDX, B_NEW, B_OLD, INVENTORY, WRITER_ID

from deltasync.errors import ProtocolError, SignatureMismatch
from deltasync.protocol import Manifest, TensorInfo, decode_patch, inventory_digest, xxh3_128
from deltasync.protocol.canonical import canonical_json
from deltasync.protocol.encoding import apply_values
from deltasync.protocol.manifest_v2 import encode_inventory

OWN = f"w{WRITER_ID}/"
INVENTORY_BLOB = "KLUv/SBV1QEA5AJbeyJkdHlwZSI6IkJGMTYiLCJuYW1hIiwic2hhcGUiOls0LDhdfSxiOCw4XX1dAwDAEJqCMNZ5Bw=="
V2_ANCHOR_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"file":"w0123456789abcdef/model-00001-of-00001.safetensors","range":[160,224],'
    b'"tensor":"a"},{"file":"w0123456789abcdef/model-00001-of-00001.safetensors","range":[224,352],"tensor":"b"}],'
    b'"files":[{"path":"w0123456789abcdef/model-00001-of-00001.safetensors","size":352,'
    b'"xxh3_128":"f736e2b2a79e4197df70e79d27ee5e2f"},'
    b'{"path":"w0123456789abcdef/model.safetensors.index.json","size":157,"xxh3_128":"778e0171526a7ac3cffa8de9b97932ff"}],'
    b'"format_version":2,"inventory":"' + INVENTORY_BLOB.encode() + b'",'
    b'"inventory_digest":"b908d424c1b631a1056774eab2ac0122","kind":"anchor","parent_digest":null,"parent_step":null,'
    b'"run_id":"golden-run","stats":{"changed":96,"nbytes":509,"total":96},"step":6,'
    b'"tensor_digests":{"tensors":[0,1],"xxh3_128":"da6c9e4b687342c81dd7ce2ac604785c40f8621420eaf2211c7dc0e745a9b352"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)
V2_PATCH_MANIFEST = (
    b'{"anchor_step":6,"entries":[{"count":19,"file":"w0123456789abcdef/patch-00000.safetensors","positions":"rice",'
    b'"positions_range":[192,202],"rice_k":2,"tensors":[0,1],"values":"xor-rank","values_range":[202,237]}],'
    b'"files":[{"path":"w0123456789abcdef/patch-00000.safetensors","size":237,'
    b'"xxh3_128":"2a5f96931d4492cf9c2be6e46d8ba6ef"}],'
    b'"format_version":2,"inventory":"' + INVENTORY_BLOB.encode() + b'",'
    b'"inventory_digest":"b908d424c1b631a1056774eab2ac0122","kind":"patch",'
    b'"parent_digest":"82b4cddfbbe7788912099f866e5f345a","parent_step":6,"run_id":"golden-run",'
    b'"stats":{"changed":19,"nbytes":237,"total":96},"step":7,'
    b'"tensor_digests":{"tensors":[0,1],"xxh3_128":"8bed3924046de2eba8c8f841ddffd2b2d8cef1d4b31508383c101efb4a4bf0cb"},'
    b'"writer":{"epoch":1,"id":"0123456789abcdef"}}'
)
V2_PATCH_FILE = bytes.fromhex(
    "b8000000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a2264656c746173796e632d7061746368222c"
    "2273746570223a2237227d2c22612f706f736974696f6e73223a7b22646174615f6f666673657473223a5b302c31305d2c226474"
    "797065223a225538222c227368617065223a5b31305d7d2c22612f76616c756573223a7b22646174615f6f666673657473223a5b"
    "31302c34355d2c226474797065223a225538222c227368617065223a5b33355d7d7d2020ee000000fbff07f9ff07030001000200"
    "0300170000001300000028b52ffd200a510000020100000f000100000f"
)
V2_HEAD = b'{"format_version":1,"manifest_digest":"aea17e7fca3630b3d196f50450648c39","run_id":"golden-run","step":7}'


def test_uploader_output_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeltaUploader's real format-2 objects for the two pushes of the format-1 golden test."""
    torch = pytest.importorskip("torch")
    import deltasync as ds

    def state(a: np.ndarray, b: np.ndarray) -> dict[str, object]:
        return {
            "a": torch.from_numpy(a.copy()).view(torch.bfloat16).reshape(4, 8),
            "b": torch.from_numpy(b.copy()).view(torch.bfloat16).reshape(8, 8),
        }

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(WRITER_ID * 2))
    store = ds.MemoryStore("golden-v2")
    with ds.DeltaUploader(store, run_id="golden-run", encode_threads=1) as up:  # format 2: the default
        assert up.push(state(A_OLD, B_OLD), 6).result(30).kind == "anchor"
        assert up.push(state(A_NEW, B_NEW), 7).result(30).kind == "patch"
    objs = store.get_many([o.key for o in store.list("")])
    assert objs["steps/000000000006/manifest.json"] == V2_ANCHOR_MANIFEST
    assert xxh3_128(V2_ANCHOR_MANIFEST) == "82b4cddfbbe7788912099f866e5f345a"
    assert objs["steps/000000000007/manifest.json"] == V2_PATCH_MANIFEST
    assert objs[f"steps/000000000007/{OWN}patch-00000.safetensors"] == V2_PATCH_FILE
    assert objs["HEAD.json"] == V2_HEAD
    assert xxh3_128(V2_PATCH_MANIFEST) == "aea17e7fca3630b3d196f50450648c39"


def test_manifest_roundtrip_and_inventory() -> None:
    for body in (V2_ANCHOR_MANIFEST, V2_PATCH_MANIFEST):
        m = Manifest.from_json(body)
        assert m.format_version == 2 and m.inventory == INVENTORY
        assert m.to_json() == body
    m = Manifest.from_json(V2_PATCH_MANIFEST)
    (e,) = m.entries
    assert e.tensors == ("a", "b") and e.count == A_IDX.size + B_IDX.size
    assert m.tensor_digests == {"a": "8bed3924046de2eba8c8f841ddffd2b2", "b": "d8cef1d4b31508383c101efb4a4bf0cb"}
    # the inventory string is one zstd frame of format 1's inventory array, in the writer's order
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(INVENTORY_BLOB))
    assert raw == b'[{"dtype":"BF16","name":"a","shape":[4,8]},{"dtype":"BF16","name":"b","shape":[8,8]}]'


def test_a_copy_with_another_inventory_writes_its_own_not_the_string_it_was_read_with() -> None:
    from dataclasses import replace

    m = Manifest.from_json(V2_ANCHOR_MANIFEST)
    inv = tuple(TensorInfo(t.name, t.dtype, (2, *t.shape)) for t in m.inventory)
    copy = replace(m, inventory=inv, inventory_digest=inventory_digest(inv))
    assert copy.to_json() != V2_ANCHOR_MANIFEST
    assert json.loads(copy.to_json())["inventory"] == encode_inventory(inv)
    assert m.to_json() == V2_ANCHOR_MANIFEST  # the original still writes the string it was read with


def test_group_entry_decodes_per_tensor() -> None:
    """One group entry for a and b: its positions run over a's 32 elements, then b's 64."""
    m = Manifest.from_json(V2_PATCH_MANIFEST)
    decoded = decode_patch(m, {OWN + "patch-00000.safetensors": V2_PATCH_FILE})
    assert [(d.tensor, d.idx.tolist()) for d in decoded] == [("a", A_IDX.tolist()), ("b", B_IDX.tolist())]
    for d, old, new in zip(decoded, (A_OLD, B_OLD), (A_NEW, B_NEW), strict=True):
        out = old.copy()
        out[d.idx] = apply_values(d.coding, old[d.idx], d.values)
        assert np.array_equal(out, new)


def test_signature_covers_the_stored_inventory_string() -> None:
    key = b"golden-key"
    s = Manifest.from_json(V2_PATCH_MANIFEST).signed(key)
    parsed = Manifest.from_json(s.to_json())
    parsed.check_signature(key)
    # another spelling of the same inventory (another zstd level) is another body: the signature fails
    other = base64.b64encode(
        zstandard.ZstdCompressor(level=19, write_content_size=True).compress(
            canonical_json([t.to_json() for t in INVENTORY])
        )
    ).decode()
    assert other != INVENTORY_BLOB
    body = json.loads(s.to_json())
    body["inventory"] = other
    with pytest.raises(SignatureMismatch):
        Manifest.from_json(canonical_json(body)).check_signature(key)


def _edited(base: bytes, edit: Any) -> bytes:
    o = json.loads(base)
    edit(o)
    return canonical_json(o)


def _blob(raw: bytes, *, size: bool = True) -> str:
    return base64.b64encode(zstandard.ZstdCompressor(write_content_size=size).compress(raw)).decode()


def _set(path: str, value: Any) -> Any:
    def edit(o: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for k in head:
            o = o[int(k)] if k.isdigit() else o[k]  # type: ignore[assignment]
        o[int(last) if last.isdigit() else last] = value  # type: ignore[index]

    return edit


HOSTILE = {
    "inventory not a string": _set("inventory", [{"dtype": "BF16", "name": "a", "shape": [4, 8]}]),
    "inventory not base64": _set("inventory", "not base64!"),
    "inventory not zstd": _set("inventory", base64.b64encode(b"plain bytes").decode()),
    "inventory frame without size": _set("inventory", _blob(b"[]", size=False)),
    "inventory not a list": _set("inventory", _blob(b'{"a":1}')),
    "inventory not JSON": _set("inventory", _blob(b"[{")),
    "inventory entry with an extra field": _set(
        "inventory",
        _blob(b'[{"dtype":"BF16","name":"a","shape":[4,8],"x":1},{"dtype":"BF16","name":"b","shape":[8,8]}]'),
    ),
    "inventory with a float dimension": _set(
        "inventory", _blob(b'[{"dtype":"BF16","name":"a","shape":[4,8.0]},{"dtype":"BF16","name":"b","shape":[8,8]}]')
    ),
    "inventory with a duplicate name": _set(
        "inventory", _blob(b'[{"dtype":"BF16","name":"a","shape":[4,8]},{"dtype":"BF16","name":"a","shape":[8,8]}]')
    ),
    "inventory with an unknown dtype": _set(
        "inventory", _blob(b'[{"dtype":"BF17","name":"a","shape":[4,8]},{"dtype":"BF16","name":"b","shape":[8,8]}]')
    ),
    "inventory of another digest": _set(
        "inventory", _blob(b'[{"dtype":"BF16","name":"a","shape":[4,8]},{"dtype":"BF16","name":"b","shape":[8,9]}]')
    ),
    "group index out of range": _set("entries.0.tensors", [0, 2]),
    "group index negative": _set("entries.0.tensors", [-1, 1]),
    "group index repeated": _set("entries.0.tensors", [0, 0]),
    "group index a bool": _set("entries.0.tensors", [False, 1]),
    "empty group": _set("entries.0.tensors", []),
    "group named by names": _set("entries.0.tensors", ["a", "b"]),
    "group count beyond its elements": _set("entries.0.count", 97),
    "group count beyond a one-tensor entry": (
        lambda o: (_set("entries.0.tensors", [0])(o), _set("entries.0.count", 33)(o))
    ),
    "entry in format 1's form": _set("entries.0", {**json.loads(V2_PATCH_MANIFEST)["entries"][0], "tensor": "a"}),
    "digests not ascending": _set("tensor_digests.tensors", [1, 0]),
    "digests repeated": _set("tensor_digests.tensors", [0, 0]),
    "digests short": _set("tensor_digests.xxh3_128", "8bed3924046de2eba8c8f841ddffd2b2"),
    "digests upper case": _set(
        "tensor_digests.xxh3_128", "8BED3924046DE2EBA8C8F841DDFFD2B2d8cef1d4b31508383c101efb4a4bf0cb"
    ),
    "digests by name": _set("tensor_digests", {"a": "8bed3924046de2eba8c8f841ddffd2b2"}),
    # every tensor in order is read in one compare with [0, 1, ...]: values equal to those ints but
    # not ints are still refused
    "digests every tensor, a float": _set("tensor_digests.tensors", [0, 1.0]),
    "digests every tensor, bools": _set("tensor_digests.tensors", [False, True]),
    "group index a float": _set("entries.0.tensors", [0, 1.0]),
    "group not an object": _set("entries.0", [0, 1]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_format2_fields_are_protocol_errors(case: str) -> None:
    with pytest.raises(ProtocolError):
        Manifest.from_json(_edited(V2_PATCH_MANIFEST, HOSTILE[case]))


def test_group_of_two_dtypes_is_refused() -> None:
    inv = (TensorInfo("a", "BF16", (4, 8)), TensorInfo("b", "F16", (8, 8)))

    def edit(o: dict[str, Any]) -> None:
        o["inventory"], o["inventory_digest"] = encode_inventory(inv), inventory_digest(inv)

    with pytest.raises(ProtocolError, match="share one dtype"):
        Manifest.from_json(_edited(V2_PATCH_MANIFEST, edit))


def test_a_tensor_in_two_entries_is_refused() -> None:
    def two(o: dict[str, Any]) -> None:
        e = o["entries"][0]
        o["entries"] = [
            {**e, "tensors": [0, 1], "values_range": [202, 220]},
            {**e, "tensors": [1], "count": 1, "positions_range": [220, 225], "values_range": [225, 237]},
        ]

    with pytest.raises(ProtocolError, match="twice"):
        Manifest.from_json(_edited(V2_PATCH_MANIFEST, two))


def test_inventory_bomb_is_refused_before_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame declaring more than a manifest may hold is refused from its header, before zstd runs."""
    from deltasync.protocol import manifest_v2

    monkeypatch.setattr(manifest_v2, "MAX_INVENTORY_BYTES", 84)  # the golden inventory is 85 bytes
    monkeypatch.setattr(manifest_v2, "_PARSED", {})  # parsed under the real limit by earlier tests
    with pytest.raises(ProtocolError, match="declares 85 bytes"):
        Manifest.from_json(V2_PATCH_MANIFEST)


def test_format1_cannot_write_a_group() -> None:
    m = Manifest.from_json(V2_PATCH_MANIFEST)
    import dataclasses

    with pytest.raises(ValueError, match="format 1 cannot write it"):
        dataclasses.replace(m, format_version=1).to_json()


def test_encode_inventory_is_what_the_writer_stores() -> None:
    assert encode_inventory(INVENTORY) == INVENTORY_BLOB


def test_inventory_digest_is_of_the_stored_bytes_only_when_they_are_canonical_and_sorted() -> None:
    """The reader takes the digest of the decompressed bytes only when they are the canonical JSON of
    the inventory sorted by name; any other spelling is digested the long way and must still match."""
    unsorted = (INVENTORY[1], INVENTORY[0])  # the same inventory in another order: the same digest

    def edit(o: dict[str, Any]) -> None:
        o["inventory"] = encode_inventory(unsorted)
        o["tensor_digests"] = {
            "tensors": [0, 1],
            "xxh3_128": o["tensor_digests"]["xxh3_128"][32:] + o["tensor_digests"]["xxh3_128"][:32],
        }
        o["entries"][0]["tensors"] = [1, 0]

    m = Manifest.from_json(_edited(V2_PATCH_MANIFEST, edit))
    assert m.inventory == unsorted and m.inventory_digest == inventory_digest(INVENTORY)
    spaced = _blob(
        b'[{"dtype": "BF16", "name": "a", "shape": [4, 8]}, {"dtype": "BF16", "name": "b", "shape": [8, 8]}]'
    )
    assert Manifest.from_json(_edited(V2_PATCH_MANIFEST, _set("inventory", spaced))).inventory == INVENTORY
    surrogate = _blob(b'[{"dtype":"BF16","name":"\\ud800","shape":[4,8]},{"dtype":"BF16","name":"b","shape":[8,8]}]')
    with pytest.raises(ProtocolError):
        Manifest.from_json(_edited(V2_PATCH_MANIFEST, _set("inventory", surrogate)))
