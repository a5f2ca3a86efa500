"""``deltasync follow --out DIR`` on a dir already at the newest step says so at start.

It once printed nothing until the trainer's next step, which may be minutes away: a user could not
tell a follower that holds the newest step from one that is stuck.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cli_process import _finish, _lines, _script, read_until, run  # noqa: E402

import deltasync as ds  # noqa: E402


def _push(store: Path, steps: range) -> None:
    with ds.DeltaUploader(ds.open_store(store), anchor_every=10) as up:
        for s in steps:
            w = torch.zeros(64, dtype=torch.bfloat16)
            w[: s + 1] = 1
            up.push({"w": w}, step=s).result(timeout=60)


def test_a_dir_at_the_newest_step_is_named_at_start_then_the_next_step_lands(tmp_path: Path) -> None:
    _push(tmp_path / "store", range(3))
    assert run("deltasync", "fetch", "--store", "store", "--out", "ck", cwd=tmp_path).returncode == 0
    cmd = [*_script("deltasync"), "follow", "--store", "store", "--out", "ck", "--until", "3", "--poll-interval", "0.1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = _lines(proc, proc.stdout), _lines(proc, proc.stderr)
        line = read_until(err, "already holds", proc)
        assert line.strip() == (
            f"ck already holds step 2, the newest committed at {ds.open_store(tmp_path / 'store').url}; "
            "waiting for the next step (Ctrl-C stops)"
        )
        _push(tmp_path / "store", range(3, 4))  # the trainer resumes: step 3 (the same writer's run)
        assert read_until(out, "step 3 -> ck", proc)
        assert proc.wait(60) == 0
    finally:
        _finish(proc)


def test_a_dir_already_at_until_says_there_is_nothing_to_do(tmp_path: Path) -> None:
    _push(tmp_path / "store", range(2))
    assert run("deltasync", "fetch", "--store", "store", "--out", "ck", cwd=tmp_path).returncode == 0
    done = run("deltasync", "follow", "--store", "store", "--out", "ck", "--until", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ck already holds step 1, the newest committed at " in done.stderr
    assert done.stderr.rstrip().endswith("; --until 1 is reached") and "waiting" not in done.stderr
    assert done.stdout.strip() == "stopped at step 1"
