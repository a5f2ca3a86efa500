"""Checkpoint dirs that engines reload from disk: ``materialize`` / ``fetch --out`` / ``follow --out``.

``out`` is swapped atomically, unchanged shards are hard-linked, config files come from
``config_from`` and carry over, stale dirs of a killed run are cleaned only when they are ours.
Kills and a concurrent reader: tests/test_materialize_kill.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
from materialize_support import CONFIG_COPIED, SHARD, Run, check_dir, cli, leftovers
from tensors import assert_state_equal

import deltasync as ds
from deltasync.errors import ObjectNotFound, StorageError
from deltasync.fetcher import _materialize, _swapdir
from deltasync.protocol.checkpoint import build_checkpoint

torch = pytest.importorskip("torch")

# ------------------------------------------------------- swap, reuse, stats


def test_patch_steps_rewrite_only_changed_shards(materialize_run: Run, tmp_path: Path) -> None:
    root, states = materialize_run
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    f.materialize(out, step=1)
    first = f.last_materialize
    assert first is not None and first.swap == "new" and first.shards_linked == 0
    n_shards = first.shards_written
    assert n_shards >= 8
    inodes = {p.name: p.stat().st_ino for p in out.glob("*.safetensors")}
    f.materialize(out, step=2)
    st = f.last_materialize
    assert st is not None and st.step == 2
    assert st.swap == ("exchange" if sys.platform.startswith("linux") else "rename")
    assert st.shards_written + st.shards_linked == n_shards
    assert 1 <= st.shards_written <= 2 and st.shards_linked >= n_shards - 2  # two tensors changed
    assert check_dir(out, states) == 2
    # the linked shards are the very same files, and the whole dir is what build_checkpoint makes
    now = {p.name: p.stat().st_ino for p in out.glob("*.safetensors")}
    assert sum(now[n] == inodes[n] for n in now) == st.shards_linked
    m = f.manifest(2)
    arrays = {k: v.view(-1).view(torch.int16).numpy() for k, v in states[2].items()}
    files, _ = build_checkpoint(m.inventory, arrays, SHARD)
    assert {n: (out / n).read_bytes() for n in files} == files
    assert leftovers(tmp_path) == []
    # the same step again: nothing written; back to an anchor plan: only the differing shards
    f.materialize(out, step=2)
    assert (f.last_materialize.shards_written, f.last_materialize.shards_linked) == (0, n_shards)  # type: ignore[union-attr]
    f.materialize(out, step=4)  # patch chain 2 -> 4 crosses anchor 3: may be replayed from it
    st4 = f.last_materialize
    assert st4 is not None and st4.shards_linked >= n_shards - 4
    assert check_dir(out, states) == 4
    f.materialize(out, step=1)  # backwards: an anchor plan; unchanged shards found by comparing tensors
    st1 = f.last_materialize
    assert st1 is not None and st1.shards_linked >= n_shards - 6 and st1.shards_written >= 1
    assert check_dir(out, states) == 1
    assert leftovers(tmp_path) == []


def test_fallback_without_exchange_warns_once(
    materialize_run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root, states = materialize_run
    monkeypatch.setattr(_materialize, "exchange", lambda a, b: False)
    monkeypatch.setattr(_materialize, "_warned", set())
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    with caplog.at_level(logging.INFO, logger="deltasync.materialize"):
        for step in (1, 2, 5):
            f.materialize(out, step=step)
            assert check_dir(out, states) == step
    assert f.last_materialize is not None and f.last_materialize.swap == "rename"
    warnings = [r.getMessage() for r in caplog.records if "two renames" in r.getMessage()]
    assert len(warnings) == 1 and "does not exist" in warnings[0]
    assert any("hard-linked unchanged" in r.getMessage() for r in caplog.records)
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux-only")
@pytest.mark.parametrize("use_syscall", [False, True])
def test_renameat2_exchange_swaps_two_dirs(tmp_path: Path, use_syscall: bool) -> None:
    import platform

    if use_syscall and platform.machine().lower() not in _swapdir._SYS_RENAMEAT2:
        pytest.skip("no syscall number for this machine")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    _swapdir._renameat2(a, b, _swapdir._RENAME_EXCHANGE, use_syscall=use_syscall)
    assert ((a / "x").read_text(), (b / "x").read_text()) == ("b", "a")
    with pytest.raises(FileNotFoundError):
        _swapdir._renameat2(a, tmp_path / "missing", _swapdir._RENAME_EXCHANGE, use_syscall=use_syscall)


# ------------------------------------------------------------------ config


def test_config_from_copies_non_weight_files_and_they_carry_over(
    materialize_run: Run, tmp_path: Path, config_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, states = materialize_run
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="deltasync.materialize"):
        f.materialize(out, step=1)
        f.materialize(out, step=1)
    assert len([r for r in caplog.records if "no config.json" in r.getMessage()]) == 1  # once per dir
    assert any("no config.json" in r.getMessage() and "--config-from" in r.getMessage() for r in caplog.records)
    (out / "notes.txt").write_text("mine")
    (out / "extra").mkdir()
    (out / "extra" / "a.txt").write_text("kept too")
    f.materialize(out, step=2, config_from=config_dir)
    assert f.last_materialize is not None and set(f.last_materialize.config) == CONFIG_COPIED
    names = {p.name for p in out.iterdir()}
    assert names >= CONFIG_COPIED and {"notes.txt", "extra"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", ".hidden", "sub"}
    assert (out / "config.json").read_bytes() == (config_dir / "config.json").read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltasync.materialize"):
        f.materialize(out, step=3)  # no config_from: what the dir has carries over
    assert not [r for r in caplog.records if "no config.json" in r.getMessage()]
    assert CONFIG_COPIED | {"notes.txt", "extra"} <= {p.name for p in out.iterdir()}
    assert (out / "extra" / "a.txt").read_text() == "kept too"
    assert check_dir(out, states) == 3
    assert leftovers(tmp_path) == []


def test_config_from_must_be_a_model_dir(materialize_run: Run, tmp_path: Path, config_dir: Path) -> None:
    root, _ = materialize_run
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    no_config = tmp_path / "tok-only"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    for bad in (tmp_path / "missing", no_config):
        with pytest.raises(ObjectNotFound, match="config"):
            f.materialize(tmp_path / "ckpt", config_from=bad)
        with pytest.raises(ObjectNotFound, match="config"):
            f.follow(tmp_path / "ckpt", config_from=bad, until_step=5, poll_interval=0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok-only"]


def test_fetch_config_from_loads_with_from_pretrained(
    materialize_run: Run, tmp_path: Path, config_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    root, states = materialize_run
    out = tmp_path / "weights"
    res = cli("fetch", "--store", str(root), "--out", str(out), "--config-from", str(config_dir), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "wrote step 5" in res.stdout and "shards written" in res.stdout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert_state_equal(model, states[5], "from_pretrained of the fetched dir")
    bad = cli("fetch", "--store", str(root), "--out", str(tmp_path / "x"), "--config-from", str(tmp_path), cwd=tmp_path)
    assert bad.returncode != 0 and "error:" in bad.stderr and "config.json" in bad.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------- stale dirs


def test_stale_dirs_of_a_killed_run_are_cleaned_only_when_ours(materialize_run: Run, tmp_path: Path) -> None:
    root, states = materialize_run
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    f.materialize(out, step=1)
    shutil.copytree(out, tmp_path / ".ckpt.tmp-0123abcd")  # ours: marker
    (tmp_path / ".ckpt.old-89abcdef").mkdir()  # ours: empty
    foreign = [tmp_path / ".ckpt.tmp-deadbeef", tmp_path / ".ckpt.tmp-nothex00", tmp_path / ".other.tmp-01234567"]
    for d in foreign:
        d.mkdir()
        (d / "user.txt").write_text("not ours")
    (tmp_path / ".other.tmp-01234567" / ".deltasync.json").write_text("{}")  # another dir's
    live = tmp_path / ".ckpt.tmp-feedf00d"  # a live writer's: locked
    shutil.copytree(out, live)
    fd = _swapdir.lock_dir(live, wait=True)
    try:
        f.materialize(out, step=2)
    finally:
        if fd is not None:
            os.close(fd)
    assert f.last_materialize is not None
    assert sorted(f.last_materialize.recovered) == ["removed .ckpt.old-89abcdef", "removed .ckpt.tmp-0123abcd"]
    assert leftovers(tmp_path) == sorted(p.name for p in [*foreign, live])
    assert check_dir(out, states) == 2


def test_killed_between_fallback_renames_is_put_back(materialize_run: Run, tmp_path: Path) -> None:
    root, states = materialize_run
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    f.materialize(out, step=2)
    os.rename(out, tmp_path / ".ckpt.old-00000001")  # what a kill between the two renames leaves
    assert _swapdir.recover(out) == ["restored .ckpt.old-00000001"]
    assert check_dir(out, states) == 2
    f.materialize(out, step=4)
    assert check_dir(out, states) == 4 and leftovers(tmp_path) == []


def test_foreign_dir_is_never_replaced(materialize_run: Run, tmp_path: Path) -> None:
    root, _ = materialize_run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(StorageError, match="refusing to replace"):
        ds.DeltaFetcher(ds.LocalStore(root)).materialize(out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and leftovers(tmp_path, "mine") == []
