"""The CLI as a user runs it (real processes): read-only commands never write, a run that does not
exist is an error, and ``delta-upload`` reports what really happened (committed or not, claims)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import deltasync as ds
from deltasync.protocol import manifest_key

torch = pytest.importorskip("torch")

from cli_process import TIMEOUT, _finish, _lines, _script, checkpoints, claims, read_until, run  # noqa: E402,F401


def test_reading_a_missing_run_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    for args in (["inspect", "runs/typo"], ["fetch", "--store", "runs/typo", "--out", "out"]):
        r = run("deltasync", *args, cwd=tmp_path)
        assert r.returncode == 1, r
        uri = (tmp_path / "runs" / "typo").as_uri()
        assert r.stderr.startswith(f"store: {uri}\nerror: {uri}: no deltasync run here"), r.stderr
        assert "check the URL" in r.stderr and "Traceback" not in r.stderr
        assert sorted(os.listdir(tmp_path)) == []  # no store dir, no .deltasync-tmp, no output dir
    # an existing but empty directory is no run either, and stays empty
    (tmp_path / "empty").mkdir()
    r = run("deltasync", "inspect", "empty", cwd=tmp_path)
    assert r.returncode == 1 and "no deltasync run here" in r.stderr
    assert os.listdir(tmp_path / "empty") == []


def test_inspect_a_run_whose_trainer_has_not_committed_yet(tmp_path: Path) -> None:
    """A writer claim is a run (its trainer started): nothing committed is then not an error."""
    from deltasync.run.claims import claim_epoch

    claim_epoch(ds.open_store(tmp_path / "run"), "w", None)
    r = run("deltasync", "inspect", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{(tmp_path / 'run').as_uri()}: no committed steps"


def test_follow_started_before_the_trainer_waits_and_gets_every_step_bit_exact(tmp_path: Path) -> None:
    """The quickstart's order: follow first (its store dir does not exist yet), then the trainer."""
    from tensors import assert_state_equal

    from deltasync._util.checkpoint_io import load_checkpoint

    store_dir, out = tmp_path / "runs" / "r1", tmp_path / "weights"
    proc = subprocess.Popen(
        [*_script("deltasync"), "follow", "--store", "runs/r1", "--out", "weights", "--until", "3"]
        + ["--poll-interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        stdout, stderr = _lines(proc, proc.stdout), _lines(proc, proc.stderr)
        line = read_until(stderr, "waiting for the first commit", proc)
        assert line == (
            f"waiting for the first commit at {store_dir.as_uri()} (nothing committed there yet: start the "
            "trainer, or check the URL; Ctrl-C stops)\n"
        )
        assert proc.poll() is None
        assert sorted(os.listdir(tmp_path)) == []  # waiting creates nothing: no store dir, no output dir
        g = torch.Generator().manual_seed(0)
        state = {"w": torch.randn(32, 32, generator=g).to(torch.bfloat16), "b": torch.randn(32, generator=g)}
        with ds.DeltaUploader(ds.open_store(store_dir), anchor_every=10) as up:  # the trainer creates the run
            for step in range(4):
                state["w"].view(-1)[step * 5 : step * 5 + 3] += 1
                up.push(state, step=step).result()
                line = read_until(stdout, "step", proc)
                assert re.fullmatch(rf"step {step} -> weights \(\d+\.\d\d s after follow started\)\n", line), line
                assert_state_equal(load_checkpoint(out), state, f"weights/ at step {step}")
        assert proc.wait(TIMEOUT) == 0
        assert read_until(stdout, "stopped", proc) == "stopped at step 3\n"
    finally:
        _finish(proc)


def test_follow_waiting_for_a_run_stops_on_ctrl_c_and_leaves_nothing(tmp_path: Path) -> None:
    """Waiting for a run is bounded by Ctrl-C: it exits 130 and leaves nothing behind."""
    proc = subprocess.Popen(
        [*_script("deltasync"), "follow", "--store", "typo", "--out", "out", "--poll-interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's Ctrl-C finds it
    )
    try:
        stderr = _lines(proc, proc.stderr)
        assert read_until(stderr, "waiting for the first commit", proc).startswith(
            f"waiting for the first commit at {(tmp_path / 'typo').as_uri()}"
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) == 130
        assert read_until(stderr, "interrupted", proc) == "interrupted\n"
    finally:
        _finish(proc)
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------ delta-upload outcomes


def test_upload_interrupted_after_its_commit_says_so_and_drops_the_partial_cache(tmp_path: Path) -> None:
    c0, c1 = checkpoints(tmp_path, 2)
    store_dir, cache, gate = tmp_path / "run", tmp_path / "cache", tmp_path / "gate"
    r = run("delta-upload", str(c0), "--store", "run", "--step", "10", "--cache", "cache", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (cache / "state.json").is_file()
    # the test hook holds delta-upload after its commit, with the cache half written, until `gate` exists
    proc = subprocess.Popen(
        [*_script("delta-upload"), str(c1), "--store", "run", "--step", "20", "--cache", "cache"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "DELTASYNC_TEST_CACHE_GATE": str(gate)},
        # a shell that starts pytest in the background (no job control) ignores SIGINT, and children
        # inherit that: give this one the default, as a terminal's Ctrl-C would find it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        out, err = _lines(proc, proc.stdout), _lines(proc, proc.stderr)
        # the commit line comes as soon as the manifest lands, before the cache is written
        line = read_until(out, "committed", proc)
        assert line.startswith("step 20: patch")
        read_until(err, "test hook: waiting", proc)
        assert store_dir.joinpath(*manifest_key(20).split("/")).is_file()
        assert (cache / "state.safetensors").is_file() and not (cache / "state.json").exists()  # half written
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) == 0  # the step is committed: the upload did its job
        tail = []
        while (chunk := err.get(timeout=TIMEOUT)) != "":
            tail.append(chunk)
    finally:
        _finish(proc)
    assert tail == [
        f"interrupted: step 20 is committed to {store_dir.as_uri()}; the local baseline cache at cache was "
        "removed (the next delta-upload fetches step 20 from the store)\n"
    ]
    assert sorted(os.listdir(cache)) == []  # no partial cache file is left to be trusted
    assert ds.DeltaFetcher(ds.open_store(store_dir)).steps() == [10, 20]


def test_a_refused_upload_leaves_no_writer_claim(tmp_path: Path) -> None:
    c0, c1 = checkpoints(tmp_path, 2)
    store_dir = tmp_path / "run"
    assert (
        run("delta-upload", str(c0), "--store", "run", "--step", "10", "--cache", "cache", cwd=tmp_path).returncode == 0
    )
    assert claims(store_dir) == ["000000000001.json"]
    # a step that is not after the last committed one
    r = run("delta-upload", str(c1), "--store", "run", "--step", "10", "--cache", "cache", cwd=tmp_path)
    assert r.returncode == 1 and "is not after the last committed step 10" in r.stderr, r.stderr
    # a baseline that cannot be rebuilt: no local cache and step 10's data is gone from the store
    for p in (store_dir / "steps" / f"{10:012d}").rglob("*"):  # its writer's subfolder: w<writer id>/...
        if p.is_file() and p.name != "manifest.json":
            p.unlink()
    r = run("delta-upload", str(c1), "--store", "run", "--step", "20", "--cache", "other-cache", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert claims(store_dir) == ["000000000001.json"]  # neither refusal claimed the run
    assert ds.DeltaFetcher(ds.open_store(store_dir)).steps() == [10]


def test_what_an_interrupted_upload_reports_comes_from_its_commit_future() -> None:
    """Ctrl-C before the push, after a failed commit, or after a landed one (the subprocess test covers the last)."""
    from concurrent.futures import Future

    from deltasync.cli.upload import _interrupted_commit
    from deltasync.errors import CommitFailed

    assert _interrupted_commit(None, 5) == (None, False)  # interrupted before pushing: nothing committed
    failed: Future[object] = Future()
    failed.set_exception(CommitFailed("step 5: commit failed"))
    assert _interrupted_commit(failed, 5) == (None, False)
    landed: Future[object] = Future()
    landed.set_result("info")
    assert _interrupted_commit(landed, 5) == ("info", False)


@pytest.mark.parametrize("cmd", [["deltasync"], ["delta-upload"], ["delta-upload", "watch"]])
def test_version(cmd: list[str]) -> None:
    """`--version` prints the installed version and exits 0 (no store, no network)."""
    from deltasync import __version__

    entry = "main" if cmd[0] == "deltasync" else "upload_main"
    code = f"import sys; from deltasync.cli import {entry}; sys.exit({entry}())"
    out = subprocess.run(
        [sys.executable, "-c", code, *cmd[1:], "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" ".join(cmd) + " " + __version__), out.stdout


def test_inspect_takes_store_like_the_other_commands(tmp_path: Path) -> None:
    """`inspect --store URL` and `inspect URL` are the same; two different stores or none is an error."""
    from deltasync.run.claims import claim_epoch

    claim_epoch(ds.open_store(tmp_path / "run"), "w", None)
    want = f"{(tmp_path / 'run').as_uri()}: no committed steps"
    for args in (["--store", "run"], ["run"], ["run", "--store", "run"]):
        r = run("deltasync", "inspect", *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want
    r = run("deltasync", "inspect", "run", "--store", "other", cwd=tmp_path)
    assert r.returncode != 0 and "two different stores" in r.stderr
    r = run("deltasync", "inspect", cwd=tmp_path)
    assert r.returncode != 0 and "deltasync inspect --store URL" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["run"]
