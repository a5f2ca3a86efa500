"""Errors a user meets at the command line say what is wrong, name the file or step, and what to
do; the store and the local baseline cache stay at their last good state (real processes)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_process import TIMEOUT, _finish, _lines, _script, checkpoints, read_until, run

import deltasync as ds
from deltasync._util.checkpoint_io import load_checkpoint, save_checkpoint
from deltasync.errors import ChainBroken, ProtocolError
from deltasync.protocol import manifest_key
from deltasync.protocol.safetensors_io import parse_safetensors

torch = pytest.importorskip("torch")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to prove nothing changed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------ not a safetensors file


@pytest.mark.parametrize(
    ("data", "looks_like"),
    [
        (b"PK\x03\x04" + b"\x00" * 60, "zip archive"),
        (pickle.dumps({"w": 1}, protocol=4), "Python pickle"),
        (b"GGUF\x03\x00\x00\x00" + b"\x00" * 32, "GGUF file"),
        (b"this is a text file, not weights\n" * 4, "text file"),
        (b"hello\n", "text file"),
    ],
)
def test_a_file_of_another_format_is_named_as_such(data: bytes, looks_like: str) -> None:
    with pytest.raises(ProtocolError, match="not a safetensors file") as err:
        parse_safetensors(data, what="x/model.bin")
    assert str(err.value).startswith("x/model.bin: not a safetensors file")
    assert looks_like in str(err.value) and "header length" not in str(err.value).split("(")[0]


def test_a_cut_safetensors_file_reads_as_truncated(tmp_path: Path) -> None:
    (ckpt,) = checkpoints(tmp_path, 1)
    whole = ckpt.read_bytes()
    for cut, where in ((40, "-byte header"), (len(whole) - 10, "tensor 'w' ends at byte")):
        with pytest.raises(ProtocolError, match=f"truncated safetensors file.*{where}"):
            parse_safetensors(whole[:cut], what="f")


def test_delta_upload_of_a_non_safetensors_checkpoint_says_how_to_convert(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4)}, tmp_path / "model.pt")  # a zip archive
    assert zipfile.is_zipfile(tmp_path / "model.pt")
    hf = tmp_path / "hf-dir"
    hf.mkdir()
    (hf / "pytorch_model.bin").write_bytes((tmp_path / "model.pt").read_bytes())
    (hf / "config.json").write_text("{}")
    (tmp_path / "notes.safetensors").write_text("not weights at all\n")
    cases = {
        "model.pt": ("model.pt: not a safetensors file (it looks like a zip archive", "safe_serialization=True"),
        "hf-dir": ("hf-dir: no *.safetensors files", "it holds pytorch_model.bin, not safetensors"),
        "notes.safetensors": ("notes.safetensors: not a safetensors file (it looks like a text file", "save_file"),
    }
    for path, needles in cases.items():
        r = run("delta-upload", path, "--store", "run", "--step", "0", "--cache", "cache", cwd=tmp_path)
        assert r.returncode == 1, r
        assert r.stderr.startswith(f"store: {(tmp_path / 'run').as_uri()}\nerror: "), r.stderr
        assert "Traceback" not in r.stderr and "7142837043854339433" not in r.stderr
        for needle in (*needles, "deltasync reads safetensors only"):
            assert needle in r.stderr, (needle, r.stderr)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # nothing written


# ------------------------------------------------------------ a damaged manifest


def push_run(root: Path, n: int) -> list[Path]:
    """``n`` checkpoints pushed with ``delta-upload`` (real processes) as steps 0..n-1 to ``root/run``
    (baseline cache in ``root/cache``)."""
    ckpts = checkpoints(root, n)
    for i, ckpt in enumerate(ckpts):
        r = run("delta-upload", str(ckpt), "--store", "run", "--step", str(i), "--cache", "cache", cwd=root)
        assert r.returncode == 0, r
    return ckpts


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, int], list[Path]]:
    """``pushed_run(tmp_path, n)``: ``n`` checkpoints pushed as steps 0..n-1 to ``tmp_path/run``, baseline
    cache in ``tmp_path/cache``; returns the checkpoints (``tmp_path/ckpt-<i>.safetensors``).

    Each ``n`` is pushed once per module by :func:`push_run` and copied into each test's dir: the
    store, the cache and the checkpoints, byte for byte, except the store URL that the cache's
    ``state.json`` names, which becomes the copy's (what ``delta-upload`` would have written there).
    """
    templates: dict[int, tuple[Path, list[Path]]] = {}

    def make(tmp_path: Path, n: int) -> list[Path]:
        if n not in templates:
            root = tmp_path_factory.mktemp(f"pushed-{n}")
            templates[n] = (root, push_run(root, n))
        root, ckpts = templates[n]
        for name in ("run", "cache"):
            shutil.copytree(root / name, tmp_path / name)
        old, new = (root / "run").as_uri(), (tmp_path / "run").as_uri()
        for meta in (tmp_path / "cache").glob("*.json"):
            text = meta.read_text()
            assert old in text, (meta, text)
            meta.write_text(text.replace(old, new))
        return [Path(shutil.copy2(c, tmp_path / c.name)) for c in ckpts]

    return make


def cut_manifest(store: Path, step: int) -> str:
    key = manifest_key(step)
    path = store / key
    path.write_bytes(path.read_bytes()[:200])  # an interrupted copy of the store, a disk error
    return key


def test_a_cut_manifest_names_its_step_and_key_and_inspect_lists_the_rest(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    pushed_run(tmp_path, 4)
    key = cut_manifest(tmp_path / "run", 2)
    before = snapshot(tmp_path / "run")
    r = run("deltasync", "inspect", "run", cwd=tmp_path)
    assert r.returncode == 1, r
    rows = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines()[1:]}
    assert rows == {"0": "anchor", "1": "patch", "2": "BROKEN", "3": "patch"}, r.stdout
    assert f"step 2 ({key}): manifest is not valid UTF-8 JSON" in r.stderr, r.stderr
    assert "damaged or cut short" in r.stderr and "Traceback" not in r.stderr
    # fetching through the broken link names it; a step before it still fetches, bit-exact
    r = run("deltasync", "fetch", "--store", "run", "--out", "out", cwd=tmp_path)
    assert r.returncode == 1 and f"cannot reach step 3: {(tmp_path / 'run').as_uri()}: step 2 ({key})" in r.stderr, r
    assert not (tmp_path / "out").exists()
    r = run("deltasync", "fetch", "--store", "run", "--out", "out", "--step", "1", cwd=tmp_path)
    assert r.returncode == 0, r
    assert snapshot(tmp_path / "run") == before  # readers never write


def test_reader_names_the_broken_link_of_a_chain(tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]) -> None:
    pushed_run(tmp_path, 3)
    cut_manifest(tmp_path / "run", 1)
    with ds.open_store(str(tmp_path / "run")) as store:
        reader = ds.RunReader(store)
        assert reader.steps() == [0, 1, 2]
        with pytest.raises(ProtocolError, match=r"cannot reach step 2: .*step 1 \(steps/000000000001/manifest.json\)"):
            reader.plan(2)
        assert reader.plan(0).steps == (0,)
        reader.forget([1])  # a forgotten step is read again
        with pytest.raises(ProtocolError, match=r"step 1 \(steps/000000000001/manifest.json\): manifest is not"):
            reader.committed(1)


# ------------------------------------------------------------ a broken chain under delta-upload


@pytest.mark.parametrize("damage", ["cut manifest", "deleted manifest", "deleted patch file"])
@pytest.mark.parametrize("cache", [True, False])
def test_delta_upload_on_a_broken_chain_suggests_anchor_and_anchor_works(
    tmp_path: Path, damage: str, cache: bool, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    ckpts = pushed_run(tmp_path, 4)
    store = tmp_path / "run"
    step2 = store / "steps" / "000000000002"
    if damage == "cut manifest":
        cut_manifest(store, 2)
    elif damage == "deleted manifest":
        (step2 / "manifest.json").unlink()
    else:
        (patch,) = step2.glob("w*/patch-00000.safetensors")  # in the uploader's own subfolder
        patch.unlink()
    if not cache:
        for p in (tmp_path / "cache").iterdir():
            p.unlink()
    before = snapshot(store)
    args = [str(ckpts[3]), "--store", "run", "--step", "4", "--cache", "cache"]
    r = run("delta-upload", *args, cwd=tmp_path)
    assert r.returncode == 1, r
    assert "error: cannot continue the chain of step 3" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "--step 4 --anchor" in r.stderr.splitlines()[-1], r.stderr
    assert snapshot(store) == before  # nothing written: no patch on the broken chain, no writer claim
    r = run("delta-upload", *args, "--anchor", cwd=tmp_path)
    assert r.returncode == 0 and "step 4: anchor" in r.stdout, r
    r = run("deltasync", "fetch", "--store", "run", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r
    got = load_checkpoint(tmp_path / "out")
    want = load_checkpoint(ckpts[3])
    assert got.keys() == want.keys() and all(
        torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)) for k in want
    )


def test_delta_upload_after_an_unreadable_newest_step_says_what_to_do(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    ckpts = pushed_run(tmp_path, 2)
    key = cut_manifest(tmp_path / "run", 1)
    before = snapshot(tmp_path / "run")
    for extra in ([], ["--anchor"]):
        r = run(
            "delta-upload", str(ckpts[1]), "--store", "run", "--step", "2", "--cache", "cache", *extra, cwd=tmp_path
        )
        assert r.returncode == 1, r
        assert f"step 1 ({key})" in r.stderr and "restore that object from a copy" in r.stderr, r.stderr
    assert snapshot(tmp_path / "run") == before


# ------------------------------------------------------------ errors that say what to do next


def test_fetch_of_a_step_that_is_not_committed_names_the_newest_and_inspect(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    pushed_run(tmp_path, 3)
    (tmp_path / "run" / manifest_key(1)).unlink()  # as gc leaves a step it collected
    before = snapshot(tmp_path / "run")
    url = (tmp_path / "run").as_uri()
    for step, why in (
        (999, "not yet: the newest committed step is 2"),
        (1, "never pushed, or deleted by gc; the newest committed step is 2"),
    ):
        r = run("deltasync", "fetch", "--store", "run", "--out", "out", "--step", str(step), cwd=tmp_path)
        assert (r.returncode, r.stdout) == (1, ""), r
        assert r.stderr == (
            f"store: {url}\nerror: step {step} is not committed in {url} ({why}); `deltasync inspect --store run` "
            "lists the committed steps\n"
        )
    r = run("deltasync", "inspect", "--store", "run", cwd=tmp_path)  # and the hint works as written
    assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["0", "2"], r
    assert snapshot(tmp_path / "run") == before and not (tmp_path / "out").exists()
    with ds.open_store(tmp_path / "run") as store, pytest.raises(ChainBroken) as err:  # the library says it too
        ds.DeltaFetcher(store).materialize(tmp_path / "out", step=999)
    assert str(err.value) == f"step 999 is not committed in {url} (not yet: the newest committed step is 2)"


def test_delta_upload_of_a_step_not_after_the_head_says_which_step_to_use(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    ckpts = pushed_run(tmp_path, 2)
    before = snapshot(tmp_path / "run")
    for step in ("1", "0"):
        r = run("delta-upload", str(ckpts[1]), "--store", "run", "--step", step, "--cache", "cache", cwd=tmp_path)
        assert r.returncode == 1, r
        assert r.stderr.splitlines()[-1] == (
            f"error: step {step} is not after the last committed step 1 in {(tmp_path / 'run').as_uri()}: use --step "
            "2 or more"
        )
    assert snapshot(tmp_path / "run") == before


def test_a_corrupt_patch_on_fetch_points_to_inspect_verify(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    pushed_run(tmp_path, 3)
    (patch,) = (tmp_path / "run" / "steps" / f"{2:012d}").rglob("patch-00000.safetensors")  # in its writer's folder
    name = patch.relative_to(tmp_path / "run" / "steps" / f"{2:012d}").as_posix()
    data = bytearray(patch.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the values: the checksum catches it
    patch.write_bytes(bytes(data))
    before = snapshot(tmp_path / "run")
    r = run("deltasync", "fetch", "--store", "run", "--out", "out", cwd=tmp_path)
    assert r.returncode == 1, r
    assert r.stderr == (
        f"store: {(tmp_path / 'run').as_uri()}\n"
        f"error: step 2: file {name} fails its xxh3-128 checksum (corrupted); `deltasync inspect "
        "--store run --verify` checks every step and names the newest one that is intact\n"
    )
    assert not (tmp_path / "out").exists()
    r = run("deltasync", "inspect", "--store", "run", "--verify", cwd=tmp_path)  # the hint, as written
    assert r.returncode == 1 and "step 2: FAIL" in r.stdout and "`deltasync fetch --step 1` still works" in r.stdout
    assert snapshot(tmp_path / "run") == before


def test_an_uploader_taken_over_says_so_once_naming_the_store_url(tmp_path: Path) -> None:
    """``delta-upload watch`` fenced by a second uploader: one error line, with the store's URL."""
    (c0, c1, c2) = checkpoints(tmp_path, 3)
    out = tmp_path / "out"
    for i, ckpt in enumerate((c0, c2)):
        (out / f"checkpoint-{2 * i}").mkdir(parents=True)
        ckpt.rename(out / f"checkpoint-{2 * i}" / "model.safetensors")
    (out / "checkpoint-2").rename(tmp_path / "later")  # written by the trainer once the other uploader is in
    watch = subprocess.Popen(
        [*_script("delta-upload"), "watch", "out", "--store", "run", "--interval", "0.05"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_until(_lines(watch, watch.stdout), "step 0:", watch)
        r = run("delta-upload", str(c1), "--store", "run", "--step", "1", "--no-cache", cwd=tmp_path)
        assert r.returncode == 0, r
        (tmp_path / "later").rename(out / "checkpoint-2")
        assert watch.wait(TIMEOUT) == 1
        assert watch.stderr is not None
        err = watch.stderr.read()
    finally:
        _finish(watch)
    url = (tmp_path / "run").as_uri()
    assert err.count("took over") == 1 and "LocalStore(" not in err, err
    assert (
        err.splitlines()[-1].startswith("error: another uploader (writer ")
        and f"took over run prefix {url} after step 0" in err
    )
    assert ds.RunReader(ds.open_store(tmp_path / "run")).steps() == [0, 1]  # the fenced step 2 was not committed


# ------------------------------------------------------------ signal server tokens


def test_signal_401_and_403_name_the_token_variable_to_set(tmp_path: Path) -> None:
    from server_harness import ThreadServer

    from deltasync.server import Settings, create_app

    app = create_app(
        Settings(publish_token="pub-token-123", subscribe_token="sub-token-456", db_path=str(tmp_path / "s.db"))
    )
    no_tokens = {"DELTASYNC_PUBLISH_TOKEN": "", "DELTASYNC_SUBSCRIBE_TOKEN": ""}
    ckpts = checkpoints(tmp_path, 2)
    with ThreadServer(app) as srv:
        for token, why in (("", "no token was sent"), ("wrong-token", "the token sent was refused")):
            env = {**no_tokens, "DELTASYNC_PUBLISH_TOKEN": token}
            args = ["--store", f"run-{bool(token)}", "--step", "0", "--signal", srv.url, "--run", "r"]
            r = run("delta-upload", str(ckpts[0]), *args, cwd=tmp_path, env=env)
            assert r.returncode == 0, r  # the store is the truth: a refused signal never fails the push
            assert f"HTTP {403 if token else 401}" in r.stderr and why in r.stderr, r.stderr
            assert "set DELTASYNC_PUBLISH_TOKEN to the server's publish token" in r.stderr, r.stderr
        # a follower without the subscribe token: told which variable to set, and it polls the store meanwhile
        follow = [*_script("deltasync"), "follow", "--store", "run-False", "--out", "out", "--signal", srv.url]
        proc = subprocess.Popen(
            [*follow, "--run", "r", "--until", "1", "--poll-interval", "0.2"],
            cwd=tmp_path,
            env={**os.environ, **no_tokens},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            err = _lines(proc, proc.stderr)
            line = read_until(err, "HTTP 401", proc)
            assert "set DELTASYNC_SUBSCRIBE_TOKEN to the server's subscribe token" in line, line
            r = run("delta-upload", str(ckpts[1]), "--store", "run-False", "--step", "1", cwd=tmp_path, env=no_tokens)
            assert r.returncode == 0, r
            assert proc.wait(TIMEOUT) == 0
        finally:
            _finish(proc)


# ------------------------------------------------------------ fp32 pushed into a bf16 run


def test_dtype_change_warning_names_tensors_and_the_size_cost() -> None:
    from deltasync.protocol import TensorInfo
    from deltasync.uploader._dtypes import dtype_change_warning

    bf16 = [TensorInfo("a", "BF16", (4, 4)), TensorInfo("b", "BF16", (8,)), TensorInfo("n", "I64", (2,))]
    fp32 = [TensorInfo("a", "F32", (4, 4)), TensorInfo("b", "F32", (8,)), TensorInfo("n", "I64", (2,))]
    msg = dtype_change_warning(7, bf16, fp32)
    assert msg is not None and msg.startswith("step 7: 2 tensors change dtype (2 BF16 -> F32, e.g. 'a')")
    assert "full anchor of 112 B instead of 64 B (1.75x)" in msg and "--cast bf16" in msg
    assert "cast_dtype=torch.bfloat16" in msg
    assert dtype_change_warning(7, bf16, bf16) is None
    assert dtype_change_warning(7, bf16, [TensorInfo("a", "F32", (2, 8))]) is None  # another shape: another model


def test_fp32_into_a_bf16_run_warns_and_cast_keeps_it_a_patch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g).bfloat16()}
    ckpt = save_checkpoint(state, tmp_path / "bf16.safetensors")
    fp32 = {k: v.float() for k, v in state.items()}
    fp32["w"].view(-1)[:3] += 1
    save_checkpoint(fp32, tmp_path / "fp32.safetensors")
    base = ["--store", "run", "--cache", "cache"]
    assert run("delta-upload", str(ckpt), *base, "--step", "0", cwd=tmp_path).returncode == 0
    r = run("delta-upload", "fp32.safetensors", *base, "--step", "1", "--cast", "bf16", cwd=tmp_path)
    assert r.returncode == 0 and "step 1: patch" in r.stdout and "change dtype" not in r.stderr, r
    r = run("delta-upload", "fp32.safetensors", *base, "--step", "2", cwd=tmp_path)
    assert r.returncode == 0 and "step 2: anchor" in r.stdout, r
    assert "step 2: 2 tensors change dtype (2 BF16 -> F32" in r.stderr, r.stderr
    assert "(2.00x)" in r.stderr and "delta-upload --cast bf16" in r.stderr, r.stderr
    for step, want in ((1, {k: v.to(torch.bfloat16) for k, v in fp32.items()}), (2, fp32)):
        out = tmp_path / f"out-{step}"
        r = run("deltasync", "fetch", "--store", "run", "--out", str(out), "--step", str(step), cwd=tmp_path)
        assert r.returncode == 0, r
        got = load_checkpoint(out)
        assert {k: (v.dtype, v.view(-1).view(torch.uint8).tolist()) for k, v in got.items()} == {
            k: (v.dtype, v.view(-1).view(torch.uint8).tolist()) for k, v in want.items()
        }


# ------------------------------------------------------------ the baseline cache


def cache_listing(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


def fetched_equals(tmp_path: Path, ckpt: Path, step: int) -> bool:
    out = tmp_path / f"check-{step}"
    r = run("deltasync", "fetch", "--store", "run", "--out", str(out), "--step", str(step), cwd=tmp_path)
    assert r.returncode == 0, r
    got, want = load_checkpoint(out), load_checkpoint(ckpt)
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want
    )


def test_the_cache_keeps_one_copy_says_where_and_rebuilds_in_memory(tmp_path: Path) -> None:
    ckpts = checkpoints(tmp_path, 4)
    cache = tmp_path / "cache"
    args = ["--store", "run", "--cache", "cache"]
    r = run("delta-upload", str(ckpts[0]), *args, "--step", "0", cwd=tmp_path)
    assert r.returncode == 0, r
    size = sum(p.stat().st_size for p in cache.iterdir())
    assert f"baseline cache: cache ({size / 1000:.2f} kB, one copy of step 0;" in r.stderr, r.stderr
    (cache / "state.json").unlink()  # no valid cache: step 1's baseline comes from the store
    r = run("delta-upload", str(ckpts[1]), *args, "--step", "1", cwd=tmp_path)
    assert r.returncode == 0 and "step 1: patch" in r.stdout and "fetching it from" in r.stderr, r
    save_checkpoint(load_checkpoint(ckpts[0]), cache / "state.safetensors")  # a stale cache (not step 1's state)
    r = run("delta-upload", str(ckpts[2]), *args, "--step", "2", cwd=tmp_path)
    assert r.returncode == 0 and "step 2: patch" in r.stdout and "is stale; rebuilding" in r.stderr, r
    assert cache_listing(cache) == ["state.json", "state.safetensors"]  # one copy, no materialized/ dir
    assert fetched_equals(tmp_path, ckpts[2], 2)
    r = run("delta-upload", str(ckpts[3]), *args, "--step", "3", "--no-cache", cwd=tmp_path)
    assert r.returncode == 0 and "step 3: patch" in r.stdout and "--no-cache: no local baseline kept" in r.stderr
    assert cache_listing(cache) == []
    assert fetched_equals(tmp_path, ckpts[3], 3)


def test_a_materialized_copy_left_by_earlier_versions_goes_and_nothing_else(
    tmp_path: Path, pushed_run: Callable[[Path, int], list[Path]]
) -> None:
    ckpts = pushed_run(tmp_path, 2)
    cache = tmp_path / "cache"
    # what earlier versions left: step 1 materialized into the cache, never removed
    r = run("deltasync", "fetch", "--store", "run", "--out", "cache/materialized", cwd=tmp_path)
    assert r.returncode == 0, r
    (cache / "materialized" / "notes.txt").write_text("the user's own file")
    other = tmp_path / "other-cache"
    r = run("deltasync", "fetch", "--store", "run", "--out", "other-cache/materialized", cwd=tmp_path)
    assert r.returncode == 0, r
    marker = other / "materialized" / ".deltasync.json"
    marker.write_text(marker.read_text().replace((tmp_path / "run").as_uri(), "file:///somewhere/else"))
    before_other = snapshot(other)
    r = run("delta-upload", str(ckpts[1]), "--store", "run", "--step", "2", "--cache", "cache", cwd=tmp_path)
    assert r.returncode == 0 and "removed cache/materialized (" in r.stderr, r
    assert cache_listing(cache) == ["materialized", "materialized/notes.txt", "state.json", "state.safetensors"]
    r = run("delta-upload", str(ckpts[1]), "--store", "run", "--step", "3", "--cache", "other-cache", cwd=tmp_path)
    assert r.returncode == 0 and "removed" not in r.stderr, r
    assert {k: v for k, v in snapshot(other).items() if k.startswith("materialized")} == before_other
