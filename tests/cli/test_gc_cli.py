"""``deltasync gc`` as a real subprocess: the dry-run plan deletes nothing, a real run deletes what it
printed, and a directory that is not a run (or bad arguments) is refused with nothing deleted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gc_support import bits_equal_state, make_states, zeros_like

import deltasync as ds
from deltasync.protocol.retention import Lease, lease_key
from deltasync.run import RunReader
from deltasync.storage import LocalStore

torch = pytest.importorskip("torch")
TIMEOUT = 120.0


def gc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from deltasync.cli import main; sys.exit(main())", "gc", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "DELTASYNC_SIGNING_KEY": ""},
    )


def files(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, list[dict[str, object]]]:
    states = make_states(23)
    root = tmp_path / "run"
    with ds.DeltaUploader(LocalStore(root, fsync=False), anchor_every=5, on_backlog="block") as up:
        for s in range(23):  # anchors 0, 5, 10, 15, 20
            up.push(states[s], s).result(TIMEOUT)
    store = LocalStore(root, fsync=False)
    store.put(lease_key("fetcher-abc"), Lease("fetcher-abc", 12, None, expires=2**40).to_json())
    store.put(lease_key("old"), Lease("old", 1, None, expires=5).to_json())
    store.put("steps/000000000003/patch-00099.safetensors", b"x" * 10)  # a leftover file in a deleted step
    (root / "notes.txt").write_text("someone else's file")
    return root, states  # type: ignore[return-value]


def test_dry_run_prints_the_plan_and_deletes_nothing(run: tuple[Path, list[object]]) -> None:
    root, _ = run
    before = files(root)
    out = gc(str(root), "--keep-anchors", "2", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("23 committed steps, 5 anchors; keeping the last 2 (15, 20)")
    assert lines[1].startswith("would delete: 12 steps (0-11), 0 spans, 0 orphan files, 1 expired lease: ")
    assert lines[2].startswith("kept: 11 steps, ")
    assert "  steps 12-14: lease fetcher-abc holds step 12 (expires in " in out.stdout
    assert "  steps 15, 20: one of the last 2 anchor(s)" in lines
    assert "  steps 16-19, 21: at or after the oldest kept anchor 15" in lines
    assert "  step 22: newest committed step" in lines
    assert "note: 1 key(s) outside the run's layout: left alone" in lines
    assert lines[-1] == "dry run: nothing deleted"
    assert files(root) == before


def test_gc_deletes_what_the_plan_said_and_the_run_still_syncs(run: tuple[Path, list[object]]) -> None:
    root, states = run
    before = files(root)
    out = gc(str(root), "--keep-anchors", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].startswith("deleted: 12 steps (0-11), 0 spans, 0 orphan files, 1 expired lease")
    after = files(root)
    gone = set(before) - set(after)
    assert {k.split("/")[1] for k in gone if k.startswith("steps/")} == {f"{s:012d}" for s in range(12)}
    assert "leases/old.json" in gone and "leases/fetcher-abc.json" in after
    assert {"HEAD.json", "notes.txt", "writers/000000000001.json"} <= set(after)
    assert set(after) <= set(before)
    store = LocalStore(root)
    assert RunReader(store).steps() == list(range(12, 23))
    model = zeros_like(states[0])  # type: ignore[arg-type]
    assert ds.DeltaFetcher(store).sync(model) == 22 and bits_equal_state(model, states[22])  # type: ignore[arg-type]
    again = gc(str(root), "--keep-anchors", "2")
    assert again.returncode == 0 and "deleted: 0 steps" in again.stdout


def test_a_directory_that_is_not_a_run_is_refused_and_untouched(tmp_path: Path) -> None:
    root = tmp_path / "not-a-run"
    (root / "steps" / "000000000001").mkdir(parents=True)
    (root / "steps" / "000000000001" / "patch-00000.safetensors").write_bytes(b"z" * 100)
    (root / "leases").mkdir()
    (root / "leases" / "x.json").write_text('{"expires":1,"format_version":1,"id":"x","step":null,"target":null}')
    (root / "data.bin").write_bytes(b"keep me")
    os.utime(root / "steps" / "000000000001" / "patch-00000.safetensors", (1, 1))
    before = files(root)
    out = gc(str(root), "--keep-anchors", "1", "--grace", "0")
    assert out.returncode == 1
    assert out.stderr.startswith(f"store: {root.as_uri()}\nerror: ") and "no deltasync run here" in out.stderr
    assert "Traceback" not in out.stderr
    assert files(root) == before
    missing = gc(str(tmp_path / "nowhere"), "--keep-anchors", "1")
    assert missing.returncode == 1 and "no deltasync run here" in missing.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep-anchors", "0"], "must be >= 1"),
        (["--keep-anchors", "x"], "expected an integer"),
        (["--keep-anchors", "1", "--grace", "-5"], "must be >= 0 seconds"),
        ([], "--keep-anchors"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    out = gc(str(tmp_path), *args)
    assert out.returncode == 2 and message in out.stderr


def test_follow_takes_a_lease_ttl() -> None:
    from deltasync.cli import build_parser

    args = build_parser().parse_args(["follow", "--store", "s", "--out", "o", "--lease-ttl", "30"])
    assert args.lease_ttl == 30.0
    assert build_parser().parse_args(["follow", "--store", "s", "--out", "o"]).lease_ttl is None
