"""Bad bytes in the store never reach the target: every corruption is a clear deltasync error.

A small run is written to a LocalStore; objects are then changed behind the store's
back (``<root>/steps/{step:012d}/<name>``), a fresh verifying fetcher syncs, and the
target must be bit-identical to what it was before the failed sync.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync.errors import (
    ChainBroken,
    ChecksumMismatch,
    DeltaSyncError,
    InventoryMismatch,
    ObjectNotFound,
    ProtocolError,
    SignatureMismatch,
    StorageError,
    UnsupportedVersion,
)
from deltasync.protocol import TensorInfo, xxh3_128
from deltasync.protocol.manifest import canonical_json
from deltasync.protocol.manifest_v2 import encode_inventory

torch = pytest.importorskip("torch")

KEY = b"the trainer's secret"
KINDS = ["anchor", "patch", "patch", "anchor", "patch"]
OFFSETS_PER_FILE = 40


def make_states(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    first = {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(300, generator=g),
        "c.bias": torch.randn(16, generator=g).to(torch.float16),
    }
    out = [first]
    for _ in range(1, n):
        s = snapshot(out[-1])
        for v in s.values():
            flat = v.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 20)]
            flat[idx] = (flat[idx].float() + 1).to(v.dtype)
        out.append(s)
    return out


@dataclass
class Run:
    root: Path
    states: list[dict[str, Any]]
    key: bytes | None

    def store(self) -> ds.LocalStore:
        return ds.LocalStore(self.root, fsync=False)

    def name(self, step: int, plain: str) -> str:
        """The stored name of data file ``plain`` of ``step``: the uploader puts its files in its
        own subfolder (``w<writer id>/patch-00000.safetensors``, SPEC.md "Commit rule")."""
        if plain == "manifest.json" or plain in self.files(step):
            return plain
        (own,) = [n for n in self.files(step) if n.startswith("w") and n.endswith("/" + plain)]
        return own

    def path(self, step: int, name: str) -> Path:
        return self.root / "steps" / f"{step:012d}" / self.name(step, name)

    def files(self, step: int) -> list[str]:
        """The step folder's files, by their path relative to it (``w<writer id>/...`` included)."""
        folder = self.root / "steps" / f"{step:012d}"
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def fetcher(self, key: bytes | None | str = "run") -> ds.DeltaFetcher:
        return ds.DeltaFetcher(self.store(), verify=True, signing_key=self.key if key == "run" else key)  # type: ignore[arg-type]


def _write_run(root: Path, key: bytes | None, version: int) -> Run:
    states = make_states(len(KINDS))
    store = ds.LocalStore(root, fsync=False)
    # small shards: the anchors have two shards, so a bad shard next to a good one is covered
    with ds.DeltaUploader(
        store, anchor_every=3, anchor_bytes_fraction=0, shard_bytes=3000, signing_key=key, format_version=version
    ) as up:
        kinds = [up.push(s, i).result(30).kind for i, s in enumerate(states)]
    assert kinds == KINDS
    return Run(root, states, key)


# every hostile edit below runs against a run of each manifest format (SPEC.md "Versioning"): what a
# reader refuses in format 1 it refuses in format 2
@pytest.fixture(scope="module", params=[1, 2], ids=["format1", "format2"])
def plain(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Run:
    return _write_run(tmp_path_factory.mktemp("plain"), None, request.param)


@pytest.fixture(scope="module", params=[1, 2], ids=["format1", "format2"])
def signed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Run:
    return _write_run(tmp_path_factory.mktemp("signed"), KEY, request.param)


def spread_offsets(size: int, n: int = OFFSETS_PER_FILE) -> list[int]:
    """``n`` deterministic offsets spread over a file, first and last byte included."""
    return sorted({round(i * (size - 1) / (n - 1)) for i in range(n)})


@contextmanager
def rewritten(path: Path, data: bytes) -> Iterator[None]:
    """Replace a stored object behind the store's back; put the original back afterwards."""
    orig = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(orig)


@contextmanager
def removed(path: Path) -> Iterator[None]:
    orig = path.read_bytes()
    path.unlink()
    try:
        yield
    finally:
        path.write_bytes(orig)


def start_state(run: Run, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A target and the keyword arguments of the sync that must take ``step``'s files.

    A patch is applied onto a target at its parent step (the fetcher is told so and
    checks it); an anchor is loaded into a target holding some other state.
    """
    if KINDS[step] == "patch":
        return snapshot(run.states[step - 1]), {"step": step, "have_step": step - 1}
    return snapshot(run.states[(step + 1) % len(KINDS)]), {"step": step}


def expect_failed_sync(
    run: Run, step: int, kinds: tuple[type[DeltaSyncError], ...], *, key: Any = "run"
) -> DeltaSyncError:
    """A fresh fetcher's sync to ``step`` raises one of ``kinds`` and leaves the target untouched."""
    target, kwargs = start_state(run, step)
    before = snapshot(target)
    with pytest.raises(kinds) as info:
        run.fetcher(key).sync(target, **kwargs)
    assert_state_equal(target, before, f"target after a failed sync to step {step}")
    msg = str(info.value)
    assert msg and len(msg) > 15, f"unclear error message {msg!r}"
    return info.value


def test_clean_runs_sync(plain: Run, signed: Run) -> None:
    for run in (plain, signed):
        for step in range(len(KINDS)):
            target, kwargs = start_state(run, step)
            run.fetcher().sync(target, **kwargs)
            assert_state_equal(target, run.states[step], f"step {step}")
    own = [plain.name(0, n) for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")]
    own.append(plain.name(0, "model.safetensors.index.json"))
    assert plain.files(0) == ["manifest.json", *sorted(own)]
    assert len({n.split("/", 1)[0] for n in own}) == 1  # one writer's subfolder
    # which is an ordinary HF checkpoint dir: its index names the shards beside it
    folder = plain.path(0, "model.safetensors.index.json").parent
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


# ------------------------------------------------------------ flipped bytes


@pytest.mark.parametrize("step", range(len(KINDS)))
def test_flipped_byte_in_any_data_file(plain: Run, step: int) -> None:
    names = [n for n in plain.files(step) if n != "manifest.json"]
    assert names
    for name in names:
        path = plain.path(step, name)
        orig = path.read_bytes()
        for off in spread_offsets(len(orig)):
            bad = bytearray(orig)
            bad[off] ^= 0xFF
            with rewritten(path, bytes(bad)):
                err = expect_failed_sync(plain, step, (ChecksumMismatch,))
            assert f"step {step}: file {name} fails its xxh3-128 checksum (corrupted)" in str(err)
        assert path.read_bytes() == orig


def test_flipped_data_byte_in_a_multi_step_plan_touches_nothing(plain: Run) -> None:
    """Every file of a plan (anchor + patches) is checked before the first byte is applied."""
    for step in (1, 2):
        path = plain.path(step, "patch-00000.safetensors")
        orig = path.read_bytes()
        bad = bytearray(orig)
        bad[len(bad) // 2] ^= 0x01
        with rewritten(path, bytes(bad)):
            target = snapshot(plain.states[4])
            before = snapshot(target)
            f = plain.fetcher()
            name = plain.name(step, "patch-00000.safetensors")
            with pytest.raises(ChecksumMismatch, match=f"step {step}: file {name} fails"):
                f.sync(target, step=2)  # anchor 0, patch 1, patch 2
            assert_state_equal(target, before)
            assert f.current_step(target) is None


@pytest.mark.parametrize("pattern", [0x01, 0xFF])
@pytest.mark.parametrize("step", range(len(KINDS)))
def test_flipped_byte_in_a_signed_manifest(signed: Run, step: int, pattern: int) -> None:
    path = signed.path(step, "manifest.json")
    orig = path.read_bytes()
    for off in spread_offsets(len(orig)):
        bad = bytearray(orig)
        bad[off] ^= pattern
        with rewritten(path, bytes(bad)):
            expect_failed_sync(signed, step, (SignatureMismatch, ProtocolError, ChainBroken, ChecksumMismatch))
    assert path.read_bytes() == orig


@pytest.mark.parametrize(("step", "top"), [(0, 2), (1, 2), (3, 4)])
def test_flipped_byte_in_an_unsigned_parent_manifest(plain: Run, step: int, top: int) -> None:
    """Without a signature a manifest is still pinned by its child's parent digest."""
    path = plain.path(step, "manifest.json")
    orig = path.read_bytes()
    for off in spread_offsets(len(orig)):
        bad = bytearray(orig)
        bad[off] ^= 0x01  # stays ASCII: the JSON often still parses
        with rewritten(path, bytes(bad)):
            target = snapshot(plain.states[(top + 1) % len(KINDS)])
            before = snapshot(target)
            with pytest.raises((ChainBroken, ProtocolError, ChecksumMismatch)):
                plain.fetcher().sync(target, step=top)
            assert_state_equal(target, before, f"manifest {step} byte {off}")


def test_flipped_byte_in_an_unsigned_top_manifest_never_yields_wrong_weights(plain: Run) -> None:
    """Nothing pins the newest manifest of an unsigned run. Fields that steer the apply
    (files, sizes, digests, ranges, codings, inventory, parent) are still caught; a flip in
    run_id, stats or a patch's anchor_step goes unnoticed, but the weights are right."""
    step = 4
    path = plain.path(step, "manifest.json")
    orig = path.read_bytes()
    caught = 0
    for off in spread_offsets(len(orig), 120):
        bad = bytearray(orig)
        bad[off] ^= 0x01
        with rewritten(path, bytes(bad)):
            target = snapshot(plain.states[3])
            before = snapshot(target)
            try:
                plain.fetcher().sync(target, step=step, have_step=3)
            except DeltaSyncError:
                caught += 1
                assert_state_equal(target, before, f"byte {off}")
            else:
                assert_state_equal(target, plain.states[step], f"byte {off} was accepted")
                key = re.findall(r'"(\w+)":', orig[:off].decode())[-1]  # the field whose value was hit
                assert key in ("run_id", "anchor_step", "changed", "total", "nbytes", "id", "epoch"), (off, key)
    assert caught > 100


# -------------------------------------------------------------- other damage


@pytest.mark.parametrize("name", ["patch-00000.safetensors", "manifest.json"])
def test_truncated_file(plain: Run, name: str) -> None:
    path = plain.path(2, name)
    name = plain.name(2, name)
    orig = path.read_bytes()
    with rewritten(path, orig[: len(orig) // 2]):
        err = expect_failed_sync(plain, 2, (ChecksumMismatch, ProtocolError))
    if name == "manifest.json":
        assert isinstance(err, ProtocolError) and "not valid UTF-8 JSON" in str(err)
    else:
        assert isinstance(err, ChecksumMismatch)
        assert (
            f"step 2: file {name} is {len(orig) // 2} bytes, manifest says {len(orig)} (truncated or replaced)"
            == str(err)
        )


def test_a_patch_file_replaced_by_a_longer_one_is_read_no_further_than_its_manifest_says(plain: Run) -> None:
    """Issue 45: the download is bounded by the manifest's file size (ObjectTooLarge from the
    store's fstat, reported as the ChecksumMismatch of that file)."""
    name = plain.name(2, "patch-00000.safetensors")
    path = plain.path(2, "patch-00000.safetensors")
    orig = path.read_bytes()
    with rewritten(path, orig + b"\0" * (1 << 20)):
        err = expect_failed_sync(plain, 2, (ChecksumMismatch,))
    assert str(err).startswith(f"step 2: file {name} is larger than its manifest says (truncated or replaced)")
    assert f"holds {len(orig) + (1 << 20)} bytes, over the {len(orig)}-byte limit" in str(err)


def test_truncated_anchor_shard(plain: Run) -> None:
    path = plain.path(3, "model-00002-of-00002.safetensors")
    orig = path.read_bytes()
    with rewritten(path, orig[:-1]):
        err = expect_failed_sync(plain, 3, (ChecksumMismatch,))
    assert "truncated or replaced" in str(err)


def test_missing_data_file(plain: Run) -> None:
    for step, name in [
        (0, "model-00001-of-00002.safetensors"),
        (0, "model.safetensors.index.json"),
        (4, "patch-00000.safetensors"),
    ]:
        with removed(plain.path(step, name)):
            err = expect_failed_sync(plain, step, (ObjectNotFound,))
        assert isinstance(err, StorageError) and isinstance(err, FileNotFoundError)
        assert f"steps/{step:012d}/{plain.name(step, name)}" in str(err)


def test_missing_parent_manifest_breaks_the_chain(plain: Run) -> None:
    with removed(plain.path(1, "manifest.json")):
        for have in (None, 1):  # a target said to be at the missing step falls back to anchors too
            target = snapshot(plain.states[1])
            before = snapshot(target)
            with pytest.raises(
                ChainBroken, match="step 2's parent step 1 is not committed, and no anchor is reachable"
            ):
                plain.fetcher().sync(target, step=2, have_step=have)
            assert_state_equal(target, before)
        # the steps that do not need step 1 are still reachable, even from a target
        # that claims the missing (say garbage-collected) step
        target = snapshot(plain.states[1])
        plain.fetcher().sync(target, step=4, have_step=1)
        assert_state_equal(target, plain.states[4])


def test_unknown_step(plain: Run) -> None:
    target = snapshot(plain.states[0])
    with pytest.raises(ChainBroken, match="step 99 is not committed"):
        plain.fetcher().sync(target, step=99)
    assert_state_equal(target, plain.states[0])


def edited_manifest(run: Run, step: int, edit: Any) -> bytes:
    """The manifest of ``step`` parsed, changed by ``edit(obj)`` and written back canonically.

    ``edit`` sees format 1's shape either way: a format-2 manifest is opened up first (inventory
    as a list, digests and group members by name) and packed again after the edit."""
    obj = json.loads(run.path(step, "manifest.json").read_bytes())
    v2 = obj.get("format_version") == 2
    if v2:
        names = [t["name"] for t in open_inventory(obj["inventory"])]
        obj["inventory"] = open_inventory(obj["inventory"])
        d = obj["tensor_digests"]
        obj["tensor_digests"] = {names[i]: d["xxh3_128"][32 * k : 32 * k + 32] for k, i in enumerate(d["tensors"])}
        for e in obj["entries"]:
            if "tensors" in e:
                e["tensors"] = [names[i] for i in e["tensors"]]
    edit(obj)
    if v2:
        inv = obj["inventory"]
        index = {t["name"]: i for i, t in enumerate(inv)}
        obj["inventory"] = encode_inventory([TensorInfo(t["name"], t["dtype"], tuple(t["shape"])) for t in inv])
        listed = sorted(index[n] for n in obj["tensor_digests"])
        hexes = {index[n]: h for n, h in obj["tensor_digests"].items()}
        obj["tensor_digests"] = {"tensors": listed, "xxh3_128": "".join(hexes[i] for i in listed)}
        for e in obj["entries"]:
            if "tensors" in e:
                e["tensors"] = [index[n] for n in e["tensors"]]
    return canonical_json(obj)


def open_inventory(blob: str) -> list[dict[str, Any]]:
    """A format-2 manifest's inventory as format 1 writes it."""
    import base64

    import zstandard

    out: list[dict[str, Any]] = json.loads(zstandard.ZstdDecompressor().decompress(base64.b64decode(blob)))
    return out


def test_newer_format_version(plain: Run) -> None:
    def bump(o: dict[str, Any]) -> None:
        o["format_version"] = 3  # 2 is known (SPEC.md "Manifest, format 2"): the next one is not

    for step in (0, 2):
        with rewritten(plain.path(step, "manifest.json"), edited_manifest(plain, step, bump)):
            err = expect_failed_sync(plain, step, (UnsupportedVersion,))
        assert "format_version 3" in str(err) and "upgrade deltasync" in str(err)


@pytest.mark.parametrize(
    "bad_path", ["../x", "/etc/passwd", "../../../../etc/passwd", "a/b", ".hidden", "..", "manifest.json"]
)
@pytest.mark.parametrize("step", [0, 2])
def test_manifest_with_a_hostile_file_path(plain: Run, step: int, bad_path: str) -> None:
    def hostile(o: dict[str, Any]) -> None:
        old = o["files"][0]["path"]
        o["files"][0]["path"] = bad_path
        for e in o["entries"]:
            if e["file"] == old:
                e["file"] = bad_path

    with rewritten(plain.path(step, "manifest.json"), edited_manifest(plain, step, hostile)):
        err = expect_failed_sync(plain, step, (ProtocolError,))
    assert "invalid file" in str(err) or "may not list itself" in str(err)
    assert not (plain.root / "x").exists()


def test_manifest_moved_to_another_step(plain: Run) -> None:
    with rewritten(plain.path(2, "manifest.json"), plain.path(1, "manifest.json").read_bytes()):
        err = expect_failed_sync(plain, 2, (ProtocolError, ChainBroken))
    assert "step 2" in str(err)


def test_tensor_digest_mismatch_is_undone(plain: Run) -> None:
    """A manifest whose tensor digest is wrong (a bad writer): the applied patch is rolled back."""

    def wrong_digest(o: dict[str, Any]) -> None:
        d = o["tensor_digests"]["b.weight"]
        o["tensor_digests"]["b.weight"] = ("0" if d[0] != "0" else "1") + d[1:]

    with rewritten(plain.path(4, "manifest.json"), edited_manifest(plain, 4, wrong_digest)):
        err = expect_failed_sync(plain, 4, (ChecksumMismatch,))
    assert "step 4: tensor 'b.weight' is not bit-exact after applying" in str(err)


def test_a_fetcher_recovers_once_a_bad_manifest_is_repaired(plain: Run) -> None:
    """Manifests are cached, but not the bad ones: a long-lived fetcher is not wedged forever."""

    def edit_stats(o: dict[str, Any]) -> None:
        o["run_id"] = "another-run"  # parses fine; only the child's parent digest notices

    def wrong_rice_k(o: dict[str, Any]) -> None:
        o["entries"][0]["rice_k"] = (o["entries"][0]["rice_k"] + 3) % 60

    f = plain.fetcher()
    target = snapshot(plain.states[0])
    f.sync(target, step=0)
    with rewritten(plain.path(1, "manifest.json"), edited_manifest(plain, 1, edit_stats)):
        with pytest.raises(ChainBroken, match="parent digest does not match"):
            f.sync(target, step=2)
        assert_state_equal(target, plain.states[0])
    with rewritten(plain.path(1, "manifest.json"), edited_manifest(plain, 1, wrong_rice_k)):
        with pytest.raises((ProtocolError, ChecksumMismatch, ChainBroken)):
            f.sync(target, step=1)
        assert_state_equal(target, plain.states[0])
    assert f.sync(target, step=2) == 2
    assert_state_equal(target, plain.states[2])


def test_failure_late_in_a_plan_leaves_the_target_as_it_was(plain: Run) -> None:
    """A plan is all or nothing: a bad step after good ones leaves the target exactly as it was
    before the call (here: step 0, reached by another fetcher), and a repaired store then syncs."""

    def wrong_digest(o: dict[str, Any]) -> None:
        d = o["tensor_digests"]["a.weight"]
        o["tensor_digests"]["a.weight"] = ("0" if d[0] != "0" else "1") + d[1:]

    for held in (False, True):
        target = snapshot(plain.states[0])
        f = plain.fetcher()
        if held:
            f.sync(target, step=3)  # the plan to 4 is then patch 4 alone, applied in place and rolled back
        before = snapshot(target)
        with rewritten(plain.path(4, "manifest.json"), edited_manifest(plain, 4, wrong_digest)):
            with pytest.raises(ChecksumMismatch):
                f.sync(target, step=4)  # anchor 3, then the bad patch 4
            assert_state_equal(target, before)
            assert f.current_step(target) == (3 if held else None)
        f.sync(target, step=4)  # repaired
        assert_state_equal(target, plain.states[4])


# -------------------------------------------------------------- inventories


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ("missing", "missing in target: ['c.bias']"),
        ("extra", "not in the run: ['d.extra']"),
        ("shape", "dtype/shape differ for ['b.weight'] (e.g. b.weight: target F32[301], run F32[300])"),
        ("dtype", "dtype/shape differ for ['c.bias'] (e.g. c.bias: target F32[16], run F16[16])"),
    ],
)
def test_inventory_mismatch_names_the_tensor(plain: Run, change: str, phrase: str) -> None:
    target = snapshot(plain.states[1])
    if change == "missing":
        del target["c.bias"]
    elif change == "extra":
        target["d.extra"] = torch.zeros(3)
    elif change == "shape":
        target["b.weight"] = torch.zeros(301)
    else:
        target["c.bias"] = torch.zeros(16)
    before = snapshot(target)
    for kwargs in ({"step": 2}, {"step": 3}):  # a patch and an anchor
        with pytest.raises(InventoryMismatch) as info:
            plain.fetcher().sync(target, **kwargs)
        assert re.match(r"target does not match step \d+'s tensors: ", str(info.value))
        assert phrase in str(info.value)
        assert_state_equal(target, before)


def test_non_contiguous_target_is_refused(plain: Run) -> None:
    target = snapshot(plain.states[0])
    target["a.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16).t()
    with pytest.raises(InventoryMismatch, match="not contiguous"):
        plain.fetcher().sync(target, step=0)


# ----------------------------------------------------------------- signing


def test_signed_run_with_the_right_key(signed: Run) -> None:
    target = snapshot(signed.states[4])
    f = signed.fetcher(KEY)
    for step in range(len(KINDS)):
        f.sync(target, step=step)
        assert_state_equal(target, signed.states[step])
    # signatures are optional for a reader without a key
    target = snapshot(signed.states[0])
    signed.fetcher(None).sync(target)
    assert_state_equal(target, signed.states[4])


def test_signed_run_with_another_key(signed: Run) -> None:
    for step in (0, 2):
        err = expect_failed_sync(signed, step, (SignatureMismatch,), key=b"someone else's key")
        assert re.fullmatch(r"step \d+: manifest signature does not match the configured key", str(err))


def test_unsigned_run_with_a_keyed_fetcher(plain: Run) -> None:
    for step in (0, 2):
        err = expect_failed_sync(plain, step, (SignatureMismatch,), key=KEY)
        assert re.fullmatch(r"step \d+: manifest is not signed but a signing key is configured", str(err))


def test_stripped_or_forged_signature(signed: Run) -> None:
    def strip(o: dict[str, Any]) -> None:
        del o["signature"]

    def forge(o: dict[str, Any]) -> None:
        o["stats"]["changed"] += 1  # any change of the body; the old signature no longer fits

    with rewritten(signed.path(2, "manifest.json"), edited_manifest(signed, 2, strip)):
        err = expect_failed_sync(signed, 2, (SignatureMismatch,))
    assert "not signed" in str(err)
    with rewritten(signed.path(2, "manifest.json"), edited_manifest(signed, 2, forge)):
        err = expect_failed_sync(signed, 2, (SignatureMismatch,))
    assert "does not match the configured key" in str(err)


# ------------------------------------------------------------ consistent lies (sizes and digests fixed up)


def test_patch_file_of_another_step_with_its_checksum_fixed_up(plain: Run) -> None:
    """Step 1's patch file under step 2, the manifest's size and xxh3-128 made to match: the file's
    metadata names step 1 (and its entries are not step 2's), so it is refused before anything is applied."""
    other = plain.path(1, "patch-00000.safetensors").read_bytes()

    def point_at_it(o: dict[str, Any]) -> None:
        f = next(f for f in o["files"] if f["path"] == plain.name(2, "patch-00000.safetensors"))
        f["size"], f["xxh3_128"] = len(other), xxh3_128(other)
        o["stats"]["nbytes"] = sum(f["size"] for f in o["files"])

    body = edited_manifest(plain, 2, point_at_it)
    with rewritten(plain.path(2, "patch-00000.safetensors"), other), rewritten(plain.path(2, "manifest.json"), body):
        err = expect_failed_sync(plain, 2, (ProtocolError,))
    assert f"step 2 {plain.name(2, 'patch-00000.safetensors')}" in str(err)


@pytest.mark.parametrize("shape", [[2**40], [2**24, 2**24], [300, 2]])
def test_patch_declaring_another_shape_is_off_the_chain(plain: Run, tmp_path: Path, shape: list[int]) -> None:
    """A patch manifest whose inventory declares another (huge) shape, its inventory digest fixed up:
    a patch has its parent's inventory, so nothing is sized from it (no MemoryError) and nothing changes."""
    from deltasync.protocol import inventory_digest

    def reshape(o: dict[str, Any]) -> None:
        t = next(t for t in o["inventory"] if t["name"] == "b.weight")
        t["shape"] = shape
        inv = [TensorInfo(x["name"], x["dtype"], tuple(x["shape"])) for x in o["inventory"]]
        o["inventory_digest"] = inventory_digest(inv)
        o["stats"]["total"] = sum(x.numel for x in inv)

    with rewritten(plain.path(2, "manifest.json"), edited_manifest(plain, 2, reshape)):
        expect_failed_sync(plain, 2, (InventoryMismatch, ChainBroken, ProtocolError))
        out = tmp_path / "ckpt"
        with pytest.raises((ChainBroken, InventoryMismatch, ProtocolError)):
            plain.fetcher().materialize(out, step=2)
        assert not out.exists()
