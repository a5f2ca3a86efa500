"""Kills and readers against a checkpoint dir being rewritten (materialize, ``follow --out``).

After a SIGKILL at any point of the write sequence (a test hook in the child process) or at a
random time, ``out`` is exactly a complete earlier or later step (every shard loaded and compared
bit for bit, the marker's step consistent with the content), and a rerun finishes and leaves no
tmp/old dir. A thread reading the dir while versions are swapped never finds it missing or mixed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from materialize_support import CONFIG_COPIED, SHARD, TIMEOUT, Run, check_dir, cli, leftovers

import deltasync as ds
from deltasync.protocol.checkpoint import INDEX_NAME
from deltasync.protocol.safetensors_io import parse_safetensors

torch = pytest.importorskip("torch")


# --------------------------------------------------------- concurrent reader


def _read_version(fd: int) -> tuple[int, dict[str, bytes]]:
    """Marker, index and every shard, all through one open dir fd."""

    def read(name: str) -> bytes:
        with open(name, "rb", opener=lambda p, flags: os.open(p, flags, dir_fd=fd)) as fh:
            return fh.read()

    step = int(json.loads(read(".deltasync.json"))["step"])
    index = json.loads(read(INDEX_NAME))
    tensors: dict[str, bytes] = {}
    for fname in sorted(set(index["weight_map"].values())):
        data = read(fname)
        for e in parse_safetensors(data).entries.values():
            tensors[e.name] = data[e.start : e.end]
    return step, tensors


def _bytes_of(state: dict[str, Any]) -> dict[str, bytes]:
    return {k: v.contiguous().view(-1).view(torch.int16).numpy().tobytes() for k, v in state.items()}


def test_a_concurrent_reader_never_sees_a_missing_or_mixed_dir(materialize_run: Run, tmp_path: Path) -> None:
    root, states = materialize_run
    want = [_bytes_of(s) for s in states]
    f = ds.DeltaFetcher(ds.LocalStore(root), shard_bytes=SHARD)
    out = tmp_path / "ckpt"
    f.materialize(out, step=0)
    stop, read_done = threading.Event(), threading.Event()
    seen: dict[int, int] = {}
    retired = 0
    errors: list[str] = []

    def reader() -> None:
        nonlocal retired
        while not stop.is_set():
            try:
                fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                errors.append(f"cannot open {out}: {exc}")
                return
            try:
                step, got = _read_version(fd)
                if got != want[step]:
                    errors.append(f"the dir says step {step} but holds other bytes (mixed)")
                    return
                seen[step] = seen.get(step, 0) + 1
                read_done.set()
            except FileNotFoundError as exc:
                # the version this read opened was retired under it (deleted after the swap): the path
                # already names the next version; anything else is a missing file
                if os.stat(out).st_ino == os.fstat(fd).st_ino:
                    errors.append(f"a file of the current version is missing: {exc}")
                    return
                retired += 1
            finally:
                os.close(fd)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i, step in enumerate([1, 2, 3, 4, 5, 1, 5, 2, 4] * 3):
            if i % 3 == 0:  # let the reader finish a read now and then, so it sees many versions
                read_done.clear()
                read_done.wait(TIMEOUT)
            f.materialize(out, step=step)
            assert f.last_materialize is not None and f.last_materialize.swap == "exchange"
    finally:
        stop.set()
        t.join(TIMEOUT)
    assert not errors, errors
    assert len(seen) >= 3, seen
    assert check_dir(out, states) == 4 and leftovers(tmp_path) == []


# ------------------------------------------------------------------ kills

CHILD = r"""
import json, os, random, signal, sys, time
import deltasync as ds
from deltasync.fetcher import _materialize, _swapdir

store, out, plan, kill_at, seed, mode, config, shard = sys.argv[1:9]
rng = random.Random(int(seed))
count = 0


def hook(name):
    global count
    count += 1
    if count == int(kill_at):
        print(f"KILL {name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if "sleepy" in mode:
        time.sleep(rng.random() * 0.004)


_swapdir._hook = hook
if "rename" in mode:
    _materialize.exchange = lambda a, b: False
f = ds.DeltaFetcher(ds.LocalStore(store), shard_bytes=int(shard))
steps = json.loads(plan)
for i in range(200 if "loop" in mode else 1):
    for s in steps:
        f.materialize(out, step=s, config_from=config or None)
        print(f"DONE {s}", flush=True)
print(f"POINTS {count}", flush=True)
"""


def _child(run_root: Path, out: Path, plan: list[int], kill_at: int, seed: int, mode: str, config: Path | None):
    script = out.parent.parent / "child.py"
    if not script.exists():
        script.write_text(CHILD)
    args = [str(run_root), str(out), json.dumps(plan), str(kill_at), str(seed), mode, str(config or ""), str(SHARD)]
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )


def _after_kill(out: Path, states: list[dict[str, Any]], allowed: set[int], may_be_missing: bool) -> None:
    if not out.exists():
        assert may_be_missing, f"{out} is missing after the kill"
        return
    step = check_dir(out, states)
    assert step in allowed, f"{out} holds step {step}, expected one of {sorted(allowed)}"


def _finish_and_check(root: Path, out: Path, states: list[dict[str, Any]], config: Path | None) -> None:
    proc = _child(root, out, [5], 0, 0, "exchange", config)
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    assert check_dir(out, states) == 5
    assert leftovers(out.parent) == [], "tmp/old dirs left behind after a clean rerun"
    if config is not None:
        assert {p.name for p in out.iterdir()} >= CONFIG_COPIED


@pytest.mark.parametrize("mode", ["exchange", "rename"])
def test_killed_at_every_kind_of_point(materialize_run: Run, tmp_path: Path, config_dir: Path, mode: str) -> None:
    """SIGKILL at sampled points of the write sequence (tmp made, marker, each shard, kept files,
    config, swap, between the fallback's renames, each file of the old version removed)."""
    root, states = materialize_run
    plan = [1, 2, 5, 4, 5]  # fresh; patch; patch chain; backwards (anchor plan); forward
    probe = tmp_path / "probe" / "ckpt"
    probe.parent.mkdir()
    proc = _child(root, probe, plan, 0, 0, mode, config_dir)
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    total = int(stdout.split("POINTS ")[1])
    rng = random.Random(f"kill-{mode}")
    points = sorted(rng.sample(range(1, total + 1), min(total, 10 if mode == "exchange" else 7)))
    kinds: set[str] = set()
    for k in points:
        out = tmp_path / f"k{k}" / "ckpt"
        out.parent.mkdir()
        proc = _child(root, out, plan, k, k, mode, config_dir)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == -signal.SIGKILL, (k, stdout, stderr)
        kinds.add(stdout.split("KILL ")[1].split()[0])
        done = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("DONE")]
        allowed = {*done[-1:], plan[len(done)]}
        missing_ok = not done or "KILL renamed-old" in stdout
        _after_kill(out, states, allowed, missing_ok)
        _finish_and_check(root, out, states, config_dir)
    assert len(kinds) >= 3, kinds


def test_killed_at_random_times(materialize_run: Run, tmp_path: Path, config_dir: Path) -> None:
    root, states = materialize_run
    rng = random.Random(7)
    plan = [1, 2, 3, 5, 4, 2, 5]
    for i in range(5):
        out = tmp_path / f"r{i}" / "ckpt"
        out.parent.mkdir()
        proc = _child(root, out, plan, 0, i, "exchange-sleepy-loop", config_dir if i % 2 else None)
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("DONE")  # one version is in place
        time.sleep(rng.uniform(0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
        _after_kill(out, states, set(plan), may_be_missing=False)
        _finish_and_check(root, out, states, config_dir if i % 2 else None)


def test_follow_out_killed_at_random_times(materialize_run: Run, tmp_path: Path, config_dir: Path) -> None:
    """``deltasync follow --out`` while steps are committed one by one; SIGKILL at random times."""
    root, states = materialize_run
    rng = random.Random(11)
    manifests = sorted(root.glob("steps/*/manifest.json"))
    for i in range(3):
        live = tmp_path / f"live{i}"
        shutil.copytree(root, live, ignore=shutil.ignore_patterns("manifest.json", "HEAD.json"))
        shutil.copy(manifests[0], live / manifests[0].relative_to(root))
        out = tmp_path / f"f{i}" / "ckpt"
        out.parent.mkdir()
        code = "import sys; from deltasync.cli import main; sys.exit(main())"
        args = ["follow", "--store", str(live), "--out", str(out), "--until", "5", "--poll-interval", "0.01"]
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args, "--config-from", str(config_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("step 0 ->")
        published = 1
        kill_after = rng.randint(1, len(manifests))
        while published < len(manifests) and published < kill_after:
            time.sleep(rng.uniform(0, 0.15))
            shutil.copy(manifests[published], live / manifests[published].relative_to(root))
            published += 1
        time.sleep(rng.uniform(0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
        _after_kill(out, states, set(range(published)), may_be_missing=False)
        assert (out / "config.json").is_file()
        for m in manifests[published:]:
            shutil.copy(m, live / m.relative_to(root))
        res = cli(*args, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert check_dir(out, states) == 5 and leftovers(out.parent) == []
        assert {p.name for p in out.iterdir()} >= CONFIG_COPIED
