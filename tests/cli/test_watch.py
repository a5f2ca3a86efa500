"""``delta-upload watch``: a training output dir fed by a writer process, checkpoint by checkpoint.

The writer writes HF-Trainer-style ``checkpoint-<step>/`` dirs slowly (each shard in two
halves, the index last, itself in two parts), the way a trainer on a slow disk does. The
watcher (the real CLI, a subprocess) must push every complete checkpoint once, in step
order, never a partial one; a fetcher proves each committed step bit-exact. In-process tests
drive the same loop poll by poll through its injected ``wait`` hook.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_process import TIMEOUT, _finish, _lines, _script, read_until, run

import deltasync as ds
from deltasync.cli._watch_scan import SETTLING, CheckpointPattern, Readiness
from deltasync.cli.watch import WatchOptions, run_watch
from deltasync.protocol import Manifest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
SHARDS = ({"w1", "b"}, {"w2"})


def ckpt_state(step: int) -> dict[str, Any]:
    """The weights a trainer saves at ``step`` (deterministic; a few elements move per step)."""
    g = torch.Generator().manual_seed(7)
    st = {
        "w1": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "w2": torch.randn(32, 48, generator=g).to(torch.bfloat16),
        "b": torch.randn(48, generator=g),
    }
    for i in range(1, step + 1):
        st["w1"].view(-1)[(i * 13) % st["w1"].numel()] += 1
        if i % 3 == 0:
            st["w2"].view(-1)[(i * 29) % st["w2"].numel()] -= 1
    return st


def write_steps(out: Path, step: int, *, pause: Callable[[], None], sharded: bool = True) -> Iterator[str]:
    """Write ``checkpoint-<step>`` piece by piece, yielding after each piece (what was written)."""
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True, exist_ok=True)
    st = ckpt_state(step)
    if not sharded:
        data = safetensors_torch.save(st, metadata={"format": "pt"})
        yield from _write_in_halves(d / "model.safetensors", data, pause)
        return
    weight_map = {}
    for i, names in enumerate(SHARDS, 1):
        fname = f"model-{i:05d}-of-{len(SHARDS):05d}.safetensors"
        data = safetensors_torch.save({k: st[k] for k in sorted(names)}, metadata={"format": "pt"})
        yield from _write_in_halves(d / fname, data, pause)
        weight_map.update(dict.fromkeys(names, fname))
    (d / "optimizer.pt").write_bytes(b"\0" * 1000)
    yield "optimizer.pt"
    index = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    yield from _write_in_halves(d / "model.safetensors.index.json", index, pause)


def _write_in_halves(path: Path, data: bytes, pause: Callable[[], None]) -> Iterator[str]:
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
        fh.flush()
        yield f"{path.name} half"
        pause()
        fh.write(data[len(data) // 2 :])
    yield f"{path.name} whole"


def writer(out: str, *steps: str) -> None:
    """The writer process: each given step, slowly; a step written as ``45p`` stays partial."""
    for s in steps:
        partial = s.endswith("p")
        pieces = write_steps(Path(out), int(s.rstrip("p")), pause=lambda: time.sleep(0.03), sharded=s != "30")
        for i, _ in enumerate(pieces):
            if partial and i == 0:
                return  # a trainer killed mid-save: half a shard, forever
            time.sleep(0.02)


def run_writer(out: Path, *steps: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    subprocess.run([sys.executable, __file__, str(out), *steps], check=True, timeout=TIMEOUT, env=env)


def committed(store_dir: Path) -> dict[int, Manifest]:
    store = ds.open_store(store_dir)
    return {s: ds.RunReader(store).manifest(s) for s in ds.RunReader(store).steps()}


def assert_bit_exact(store_dir: Path, steps: list[int]) -> None:
    f = ds.DeltaFetcher(ds.open_store(store_dir), verify="full")
    target = {k: torch.zeros_like(v) for k, v in ckpt_state(0).items()}
    for step in steps:
        assert f.sync(target, step=step) == step
        for k, v in ckpt_state(step).items():
            assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), (step, k)


def pushed_lines(text: str) -> list[int]:
    return [int(line.split(":")[0].split()[1]) for line in text.splitlines() if line.startswith("step ")]


# ------------------------------------------------------------ the real CLI against a writer process


def test_watch_follows_a_writer_process_restarts_and_deletes_only_what_it_pushed(tmp_path: Path) -> None:
    out, store = tmp_path / "out", tmp_path / "store"
    out.mkdir()
    watch = subprocess.Popen(
        [*_script("delta-upload"), "watch", str(out), "--store", str(store), "--interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        q, errq = _lines(watch, watch.stdout), _lines(watch, watch.stderr)
        read_until(errq, "waiting for checkpoints", watch)
        run_writer(out, "10", "20", "30", "40", "45p")
        seen = [read_until(q, f"step {s}:", watch) for s in (10, 20, 30, 40)]
        watch.send_signal(signal.SIGINT)
        assert watch.wait(TIMEOUT) == 0
        read_until(errq, "stopped; the newest committed step is 40", watch)
    finally:
        _finish(watch)
    assert [pushed_lines(line)[0] for line in seen] == [10, 20, 30, 40]
    assert [line.split(":")[1].split(",")[0].strip() for line in seen] == ["anchor", "patch", "patch", "patch"]
    m = committed(store)
    assert sorted(m) == [10, 20, 30, 40]  # 45 is half a shard: never pushed
    assert_bit_exact(store, [10, 20, 30, 40])

    # restart: 10..40 are in the store; 40 is on disk and proven, so 50 is a patch; the partial 45 is skipped
    run_writer(out, "50", "60")
    r = run("delta-upload", "watch", str(out), "--store", str(store), "--once", "--interval", "0.05", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "checkpoint-40: equal to step 40 in the store (digests)" in r.stdout
    assert pushed_lines(r.stdout) == [50, 60]
    assert "checkpoint-45: incomplete" in r.stderr
    m = committed(store)
    assert sorted(m) == [10, 20, 30, 40, 50, 60]
    assert (m[50].kind, m[50].parent_step, m[60].kind) == ("patch", 40, "patch")
    assert (m[10].writer, m[50].writer) != (None, None) and m[10].writer.epoch == 1 and m[50].writer.epoch == 2

    # --delete-pushed: only what this run pushed, never its newest; other dirs untouched
    (out / "logs").mkdir()
    (out / "checkpoint-abc").mkdir()
    run_writer(out, "70", "80", "90")
    r = run(
        "delta-upload", "watch", str(out), "--store", str(store), "--once", "--interval", "0.05", "--delete-pushed",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert pushed_lines(r.stdout) == [70, 80, 90]
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(
        ["checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-40", "checkpoint-45", "checkpoint-50",
         "checkpoint-60", "checkpoint-90", "checkpoint-abc", "logs"]
    )  # fmt: skip

    # the head's checkpoint gone from disk: the next one is an anchor
    import shutil

    shutil.rmtree(out / "checkpoint-90")
    run_writer(out, "100")
    r = run("delta-upload", "watch", str(out), "--store", str(store), "--once", "--interval", "0.05", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "checkpoint of step 90 (the store's newest) is not on disk: the next push is an anchor" in r.stdout
    assert committed(store)[100].kind == "anchor"
    assert_bit_exact(store, [10, 20, 30, 40, 50, 60, 70, 80, 90, 100])


def test_watch_started_before_the_trainer_waits_for_its_output_dir(tmp_path: Path) -> None:
    """Without --once a missing output dir is waited for (the trainer creates it at its first save)."""
    out, store = tmp_path / "out", tmp_path / "store"
    watch = subprocess.Popen(
        [*_script("delta-upload"), "watch", str(out), "--store", str(store), "--interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        q, errq = _lines(watch, watch.stdout), _lines(watch, watch.stderr)
        assert read_until(errq, "waiting", watch) == (
            f"waiting for {out} to be created (the training output dir; nothing there yet: start the trainer, "
            "or check the path; Ctrl-C stops)\n"
        )
        assert sorted(os.listdir(tmp_path)) == []  # waiting creates nothing, in the store or beside it
        run_writer(out, "10", "20")
        assert [pushed_lines(read_until(q, f"step {s}:", watch))[0] for s in (10, 20)] == [10, 20]
        watch.send_signal(signal.SIGINT)
        assert watch.wait(TIMEOUT) == 0
    finally:
        _finish(watch)
    assert_bit_exact(store, [10, 20])


def test_watch_on_a_wrong_dir(tmp_path: Path) -> None:
    """With --once a missing dir, and always a file or a checkpoint dir itself: an error. An empty dir: it
    waits (--once: exits)."""
    store = str(tmp_path / "store")
    (tmp_path / "f.safetensors").write_bytes(b"x")
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(safetensors_torch.save(ckpt_state(0)))
    for path, msg in [
        (tmp_path / "nope", "no such directory"),
        (tmp_path / "f.safetensors", "is a file, not a training output dir"),
        (ck, "holds a checkpoint itself"),
    ]:
        r = run("delta-upload", "watch", str(path), "--store", store, "--once", "--interval", "0.01", cwd=tmp_path)
        assert r.returncode == 1 and msg in r.stderr, r.stderr
    r = run("delta-upload", "watch", str(ck), "--store", store, "--step-regex", "ck(", cwd=tmp_path)
    assert r.returncode == 1 and "not a valid regular expression" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run("delta-upload", "watch", str(empty), "--store", store, "--once", "--interval", "0.01", cwd=tmp_path)
    assert r.returncode == 0 and "waiting for checkpoints in" in r.stderr and "nothing new to push" in r.stdout
    assert not Path(store).exists()  # nothing pushed, nothing claimed


def test_a_checkpoint_dir_named_watch_is_pushed_as_dot_slash_watch(tmp_path: Path) -> None:
    (tmp_path / "watch").mkdir()
    (tmp_path / "watch" / "model.safetensors").write_bytes(safetensors_torch.save(ckpt_state(0)))
    r = run("delta-upload", "./watch", "--store", "s", "--step", "0", "--cache", "c", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 0: anchor" in r.stdout
    h = run("delta-upload", "--help", cwd=tmp_path)
    assert "write ./watch" in " ".join(h.stdout.split())


# ------------------------------------------------------------ the loop, poll by poll (injected wait)


def test_never_a_partial_checkpoint_poll_by_poll(tmp_path: Path) -> None:
    """Each poll the writer adds one piece; a checkpoint is pushed at the poll after its last piece."""
    out = tmp_path / "out"
    pieces = (  # lazy: each next() writes one more piece
        (s, p) for s, sharded in [(1, True), (2, False), (3, True)] for p in write_steps(out, s, pause=lambda: None, sharded=sharded)
    )  # fmt: skip
    log: list[str] = []
    store = ds.MemoryStore()
    last_piece: dict[int, int] = {}
    poll = 0

    def wait(_: float) -> bool:
        nonlocal poll
        poll += 1
        nxt = next(pieces, None)
        if nxt is None:
            return poll > 40
        last_piece[nxt[0]] = poll
        return False

    out.mkdir()
    with ds.DeltaUploader(store) as up:
        # settle=inf: only two polls that see it unchanged make a checkpoint ready, however slow the machine
        opts = WatchOptions(
            interval=1.0, settle=math.inf, wait=wait, say=lambda m: log.append(f"{poll} {m}"), warn=log.append
        )
        assert run_watch(CheckpointPattern(out), up, opts) == 0
    pushes = [(int(line.split()[0]), int(line.split()[2].rstrip(":"))) for line in log if " step " in line[:8]]
    assert [s for _, s in pushes] == [1, 2, 3]
    for at_poll, step in pushes:
        # complete after the poll that follows its last piece, pushed at the next one (sizes stable)
        assert at_poll == last_piece[step] + 1, (step, log)
    assert_store_equals(store, [1, 2, 3])


def test_a_stop_request_finishes_the_current_commit_and_starts_no_other(tmp_path: Path) -> None:
    """What Ctrl-C / SIGTERM do in the CLI (they only set the event that ``stopping`` reads)."""
    out = tmp_path / "out"
    for step in (1, 2, 3):
        for _ in write_steps(out, step, pause=lambda: None):
            pass
    stop = False
    said: list[str] = []

    def say(m: str) -> None:
        nonlocal stop
        said.append(m)
        stop = stop or m.startswith("step ")  # the request arrives while step 1 is being committed

    store = ds.MemoryStore()
    with ds.DeltaUploader(store) as up:
        opts = WatchOptions(interval=1.0, wait=lambda _: False, stopping=lambda: stop, say=say, warn=said.append)
        assert run_watch(CheckpointPattern(out), up, opts) == 0
    assert [m.split(":")[0] for m in said if m.startswith("step ")] == ["step 1"]
    assert ds.RunReader(store).steps() == [1]


def test_two_names_for_one_step_are_pushed_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for _ in write_steps(out, 1, pause=lambda: None):
        pass
    import shutil

    shutil.copytree(out / "checkpoint-1", out / "step_1")
    said: list[str] = []
    store = ds.MemoryStore()
    with ds.DeltaUploader(store) as up:
        opts = WatchOptions(once=True, wait=lambda _: False, say=said.append, warn=said.append)
        assert run_watch(CheckpointPattern(out), up, opts) == 0
    assert [m for m in said if m.startswith("step ")][0].startswith("step 1: anchor")
    assert "step_1: step 1 was just pushed from another checkpoint: skipped" in said
    assert ds.RunReader(store).steps() == [1]


def assert_store_equals(store: ds.Store, steps: list[int]) -> None:
    f = ds.DeltaFetcher(store, verify="full")
    target = {k: torch.zeros_like(v) for k, v in ckpt_state(0).items()}
    for step in steps:
        f.sync(target, step=step)
        for k, v in ckpt_state(step).items():
            assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), (step, k)


def test_readiness_of_a_lying_or_changing_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "checkpoint-5"
    d.mkdir()
    r = Readiness(settle=math.inf)  # two polls decide, not the files' age
    assert r.check(d) == (False, "no *.safetensors file yet")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    assert "not plain file names" in r.check(d)[1]
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    assert "shards not written yet" in r.check(d)[1]
    data = safetensors_torch.save(ckpt_state(0))
    (d / "model-00001-of-00001.safetensors").write_bytes(data + b"extra")  # longer than its header says
    assert "bytes written" in r.check(d)[1]
    (d / "model-00001-of-00001.safetensors").write_bytes(data)
    assert r.check(d) == (False, SETTLING)
    assert r.check(d) == (True, "")
    (d / "model-00001-of-00001.safetensors").write_bytes(data[:-1] + b"\1")  # rewritten: not stable
    os.utime(d / "model-00001-of-00001.safetensors", ns=(1, 1))
    assert r.check(d) == (False, SETTLING)


def settled_checkpoints(out: Path, steps: tuple[int, ...], mtime: float) -> None:
    """Whole checkpoints whose files were last modified at ``mtime`` (seconds, wall clock)."""
    for step in steps:
        for _ in write_steps(out, step, pause=lambda: None):
            pass
        for f in (out / f"checkpoint-{step}").iterdir():
            os.utime(f, (mtime, mtime))


def test_a_checkpoint_modified_long_enough_ago_is_ready_at_first_sight(tmp_path: Path) -> None:
    settled_checkpoints(tmp_path, (5,), 1_000_000.0)
    d = tmp_path / "checkpoint-5"
    young = Readiness(settle=2.0, clock=lambda: 1_000_000.5)
    assert young.check(d) == (False, SETTLING) and young.settles_in(d) == 1.5
    assert young.check(d) == (True, "")  # unchanged over two polls: ready, however young
    assert Readiness(settle=2.0, clock=lambda: 1_000_002.0).check(d) == (True, "")


def test_once_waits_only_for_checkpoints_still_settling(tmp_path: Path) -> None:
    """``watch --once``: checkpoints saved before it started are pushed in one poll, without a wait; one
    modified just now is polled again once it has settled (not a whole --interval later)."""
    out = tmp_path / "out"
    settled_checkpoints(out, (1, 2, 3), 1_000_000.0)
    waits: list[float] = []
    said: list[str] = []

    def options(now: float) -> WatchOptions:
        return WatchOptions(
            once=True, interval=10.0, clock=lambda: now, wait=lambda s: bool(waits.append(s)), say=said.append
        )

    store = ds.MemoryStore()
    with ds.DeltaUploader(store) as up:
        assert run_watch(CheckpointPattern(out), up, options(1_000_100.0)) == 0
    assert waits == [] and pushed_lines("\n".join(said)) == [1, 2, 3]
    settled_checkpoints(out, (4,), 1_000_100.0)
    with ds.DeltaUploader(store) as up:
        assert run_watch(CheckpointPattern(out), up, options(1_000_100.5)) == 0
    assert waits == [1.5] and pushed_lines("\n".join(said)) == [1, 2, 3, 4]
    assert_store_equals(store, [1, 2, 3, 4])


def test_glob_and_step_regex(tmp_path: Path) -> None:
    for name in ("run-a/ckpt_7.safetensors", "run-a/ckpt_12.safetensors", "run-a/notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    p = CheckpointPattern(tmp_path, "run-*/ckpt_*.safetensors")
    assert [(c.step, c.name) for c in p.scan()] == [(7, "ckpt_7.safetensors"), (12, "ckpt_12.safetensors")]
    p = CheckpointPattern(tmp_path, "run-*/*", r"ckpt_(\d+)")
    assert [c.step for c in p.scan()] == [7, 12]
    with pytest.raises(ds.errors.DeltaSyncError, match="without '..'"):
        CheckpointPattern(tmp_path, "../*")


if __name__ == "__main__":
    writer(sys.argv[1], *sys.argv[2:])
