"""Tensor digests across manifest formats (SPEC.md "Digests"): a chain whose first steps are format 1
and later ones format 2 syncs and proves a tensor over 16 MiB (whose digest format 2 defines as a tree
of chunk digests), and a format-2 manifest that gives such a tensor the whole-bytes digest of format 1
is refused. Also the torch side of the digests: CPU tensors hashed in place, accelerator tensors read
chunk by chunk (checked here through the same code on CPU tensors)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync._util.tensors import DeviceBytes, digest_tensors, flat_bits
from deltasync.errors import ChecksumMismatch
from deltasync.fetcher._target import DeviceTensor, HostTensor, target_digests
from deltasync.protocol import Manifest, manifest_key
from deltasync.protocol.digests import tensor_digest, xxh3_128_array

torch = pytest.importorskip("torch")

CHUNK = 1 << 24
BIG = "model.embed_tokens.weight"  # 17 MiB of bf16: two chunks
BIG_SHAPE = (17 << 9, 1024)


def tree(t: Any) -> str:
    """Format 2's digest of a tensor over CHUNK bytes, from xxhash on its chunks (SPEC.md "Digests")."""
    raw = t.contiguous().view(-1).view(torch.int16).numpy().tobytes()
    assert len(raw) > CHUNK
    return xxhash.xxh3_128_hexdigest(
        b"".join(xxhash.xxh3_128_digest(raw[a : a + CHUNK]) for a in range(0, len(raw), CHUNK))
    )


def whole(t: Any) -> str:
    """Format 1's digest: xxh3-128 of all the bytes."""
    return xxhash.xxh3_128_hexdigest(t.contiguous().view(-1).view(torch.int16).numpy().tobytes())


def states() -> list[dict[str, Any]]:
    """Steps 0..3: 0 and 1 change everything a little, 2 leaves the big tensor alone, 3 changes it."""
    g = torch.Generator().manual_seed(0)
    first = {
        BIG: torch.randn(BIG_SHAPE, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(64, generator=g),
        "lm_head.bias": torch.randn(100, generator=g).to(torch.float16),
    }
    out = [first]
    for step in range(1, 4):
        s = snapshot(out[-1])
        for name, v in s.items():
            if name == BIG and step == 2:
                continue
            flat = v.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
            flat[idx] = (flat[idx].float() + 1).to(v.dtype)
        out.append(s)
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Steps 0 (anchor) and 1 written in format 1; then a format-2 uploader resumes at step 1 and
    writes steps 2 and 3 as patches."""
    root = tmp_path_factory.mktemp("mixed")
    st = states()
    store = ds.LocalStore(root, fsync=False)
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, format_version=1) as up:
        assert [up.push(st[i], i).result(60).kind for i in (0, 1)] == ["anchor", "patch"]
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, format_version=2) as up:
        assert up.resume(snapshot(st[1]), 1, strict=True) is True
        assert [up.push(st[i], i).result(60).kind for i in (2, 3)] == ["patch", "patch"]
    return root, st


def manifest(root: Path, step: int) -> Manifest:
    return Manifest.from_json((root / manifest_key(step)).read_bytes())


def test_the_mixed_chain_carries_each_format_s_digests(mixed: tuple[Path, list[dict[str, Any]]]) -> None:
    root, st = mixed
    ms = [manifest(root, s) for s in range(4)]
    assert [m.format_version for m in ms] == [1, 1, 2, 2]
    assert ms[1].tensor_digests[BIG] == whole(st[1][BIG]) != tree(st[1][BIG])
    # step 2 leaves the big tensor's bytes alone, but its digest is format 2's (the resumed uploader
    # did not reuse format 1's), so readers count it as changed and prove it
    assert ms[2].tensor_digests[BIG] == tree(st[2][BIG]) == tree(st[1][BIG])
    assert all(e.tensor != BIG for e in ms[2].entries)
    assert ms[3].tensor_digests[BIG] == tree(st[3][BIG])
    # a small tensor has one digest in both formats
    for name in ("norm.weight", "lm_head.bias"):
        assert ms[1].tensor_digests[name] == whole(st[1][name])
        assert ms[2].tensor_digests[name] == whole(st[2][name])


@pytest.mark.parametrize("verify", [True, "full"])
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start", [None, 0, 1, 2])
def test_the_mixed_chain_syncs_and_verifies(
    mixed: tuple[Path, list[dict[str, Any]]], verify: Any, fold: bool, threads: int, start: int | None
) -> None:
    """From nothing (an anchor plan proven off the target), and from each held step (patches across
    the format change, folded or not)."""
    root, st = mixed
    fetcher = ds.DeltaFetcher(ds.LocalStore(root, fsync=False), verify=verify, fold=fold, threads=threads, spans=False)
    if start is None:
        target = {k: torch.zeros_like(v) for k, v in st[0].items()}
        assert fetcher.sync(target, step=3) == 3
    else:
        target = snapshot(st[start])
        assert fetcher.sync(target, step=3, have_step=start) == 3
        assert fetcher.last_stats is not None and fetcher.last_stats.base_step == start
    assert_state_equal(target, st[3], f"synced from {start}")


def test_a_follower_steps_through_the_format_change(mixed: tuple[Path, list[dict[str, Any]]]) -> None:
    root, st = mixed
    fetcher = ds.DeltaFetcher(ds.LocalStore(root, fsync=False), verify="full", threads=2)
    target = {k: torch.zeros_like(v) for k, v in st[0].items()}
    for step in range(4):
        assert fetcher.sync(target, step=step) == step
        assert_state_equal(target, st[step], f"step {step}")


def test_spans_across_the_format_change(mixed: tuple[Path, list[dict[str, Any]]]) -> None:
    """Whatever spans the uploaders wrote, a fetcher that may use them ends at the same bits."""
    root, st = mixed
    target = snapshot(st[0])
    ds.DeltaFetcher(ds.LocalStore(root, fsync=False), verify="full", spans=True).sync(target, step=3, have_step=0)
    assert_state_equal(target, st[3], "with spans")


# ------------------------------------------------------------------ the old definition in a format-2 manifest


@pytest.fixture(scope="module")
def v2run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("v2")
    st = states()[:2]
    with ds.DeltaUploader(ds.LocalStore(root, fsync=False), anchor_every=100, anchor_bytes_fraction=0) as up:
        assert [up.push(s, i).result(60).kind for i, s in enumerate(st)] == ["anchor", "patch"]
    return root, st


def with_whole_bytes_digest(root: Path, step: int, t: Any) -> bytes:
    """Step ``step``'s manifest with the big tensor's digest replaced by format 1's (of the right bytes)."""
    path = root / manifest_key(step)
    m = Manifest.from_json(path.read_bytes())
    assert m.format_version == 2 and m.tensor_digests[BIG] == tree(t)
    digests = dict(m.tensor_digests)
    digests[BIG] = whole(t)
    return dataclasses.replace(m, tensor_digests=digests).to_json()


@pytest.mark.parametrize("step", [0, 1])
def test_the_whole_bytes_digest_of_a_big_tensor_is_refused_in_format_2(
    v2run: tuple[Path, list[dict[str, Any]]], step: int
) -> None:
    root, st = v2run
    path = root / manifest_key(step)
    orig = path.read_bytes()
    path.write_bytes(with_whole_bytes_digest(root, step, st[step][BIG]))
    try:
        for verify in (True, "full"):
            store = ds.LocalStore(root, fsync=False)
            # from the held parent (a patch), and from nothing (the anchor, proven off the target)
            starts = [(snapshot(st[0]), 0), ({k: torch.zeros_like(v) for k, v in st[0].items()}, None)]
            for target, have in starts if step else starts[1:]:
                before = snapshot(target)
                with pytest.raises(ChecksumMismatch, match=BIG.replace(".", r"\.")):
                    ds.DeltaFetcher(store, verify=verify, threads=2).sync(target, step=step, have_step=have)
                assert_state_equal(target, before, "after the refused sync")
    finally:
        path.write_bytes(orig)
    target = {k: torch.zeros_like(v) for k, v in st[0].items()}
    ds.DeltaFetcher(ds.LocalStore(root, fsync=False), verify="full").sync(target, step=step)
    assert_state_equal(target, st[step], "the untouched run")


# ------------------------------------------------------------------ the torch side


def test_torch_tensors_digest_like_their_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(BIG_SHAPE, generator=g).to(torch.bfloat16)
    state = {
        "big": big,
        "big.T": big.T,  # not contiguous: copied, then hashed
        "small": torch.randn(7, 5, generator=g),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "flags": torch.rand(33, generator=g) > 0.5,
    }
    for version in (1, 2):
        want = {n: tensor_digest(flat_bits(t).numpy(), version) for n, t in state.items()}
        assert want["big"] == (tree(big) if version == 2 else whole(big))
        assert want["big.T"] == tensor_digest(big.T.contiguous().view(-1).view(torch.int16).numpy(), version)
        assert want["small"] == xxh3_128_array(state["small"].numpy())
        assert digest_tensors(state, version) == want
        assert digest_tensors(state, version, threads=1) == want
        # an accelerator's tensor is read chunk by chunk: the same reads on a CPU tensor
        src = DeviceBytes(big)
        assert src.nbytes == big.numel() * 2
        assert tensor_digest(src, version) == want["big"]
        assert (
            bytes(src.read(CHUNK - 2, CHUNK + 2))
            == flat_bits(big).numpy().view(np.uint8)[CHUNK - 2 : CHUNK + 2].tobytes()
        )
        # the fetcher's two kinds of target tensors
        host = {n: HostTensor(flat_bits(t).numpy()) for n, t in state.items() if n != "big.T"}
        device = {n: DeviceTensor(flat_bits(t)) for n, t in state.items() if n != "big.T"}
        for tensors in (host, device):
            got = target_digests(tensors, sorted(tensors), version, threads=2)
            assert got == {n: want[n] for n in sorted(tensors)}
