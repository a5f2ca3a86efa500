"""``deltasync inspect --verify`` as a user runs it (real processes) on a run written by the real uploader:
one ``step N: OK`` / ``step N: FAIL <reason>`` line per step, a summary, exit 1 when any step fails."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_process import TIMEOUT, run

import deltasync as ds
from deltasync.protocol import Manifest, file_key, manifest_key, xxh3_128
from deltasync.run.audit import file_digest
from deltasync.storage import LocalStore

torch = pytest.importorskip("torch")

STEPS = 7  # anchors 0 and 4, patches 1-3 and 5-6


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of tiny states pushed by the real uploader (built once; tests damage copies of it)."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(32, 32, generator=g).to(torch.bfloat16), "b": torch.randn(32, generator=g)}
    root = tmp_path_factory.mktemp("verify") / "run"
    with ds.DeltaUploader(LocalStore(root, fsync=False), anchor_every=4, anchor_bytes_fraction=0) as up:
        for step in range(STEPS):
            if step:
                state = {k: v.clone() for k, v in state.items()}
                state["w"].view(-1)[step * 5 : step * 5 + 4] += 1
            up.push(state, step).result(TIMEOUT)
    return root


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "run")
    return tmp_path / "run"


def manifest(root: Path, step: int) -> Manifest:
    return Manifest.from_json((root / manifest_key(step)).read_bytes())


def verify(root: Path, *args: str) -> tuple[int, dict[int, str], list[str]]:
    """Exit status, ``{step: 'OK' | 'FAIL ...'}`` and the output lines of ``inspect --verify``."""
    r = run("deltasync", "inspect", "run", "--verify", *args, cwd=root.parent)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    verdicts = {}
    for line in lines[:-1]:
        head, _, verdict = line.partition(": ")
        assert head.startswith("step "), line
        verdicts[int(head.removeprefix("step "))] = verdict
    return r.returncode, verdicts, lines


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_clean_run_verifies_and_nothing_is_written(store: Path) -> None:
    assert [manifest(store, s).kind for s in range(STEPS)] == ["anchor", "patch", "patch", "patch", "anchor"] + [
        "patch"
    ] * 2
    before = snapshot(store)
    rc, verdicts, lines = verify(store)
    assert rc == 0, lines
    assert verdicts == dict.fromkeys(range(STEPS), "OK")
    assert lines[-1] == f"{STEPS} steps verified, 0 failed"
    rc, verdicts, lines = verify(store, "--last", "2")  # the window's chain still reaches anchor 4
    assert (rc, verdicts, lines[-1]) == (0, {5: "OK", 6: "OK"}, "2 steps verified, 0 failed")
    assert snapshot(store) == before


def flip_byte(root: Path, step: int) -> str:
    name = manifest(root, step).files[0].path
    path = root / file_key(step, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return file_key(step, name)


def cut_file(root: Path, step: int) -> str:
    name = manifest(root, step).files[0].path
    path = root / file_key(step, name)
    path.write_bytes(path.read_bytes()[:-3])
    return file_key(step, name)


def remove_file(root: Path, step: int) -> str:
    name = manifest(root, step).files[0].path
    (root / file_key(step, name)).unlink()
    return file_key(step, name)


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (flip_byte, "fails its xxh3-128 checksum (corrupted)"),
        (cut_file, "bytes, the manifest says"),  # is N bytes, the manifest says N + 3
        (remove_file, "is missing"),
    ],
)
def test_a_damaged_data_file_fails_its_step_and_the_patches_built_on_it(
    store: Path, damage: Callable[[Path, int], str], what: str
) -> None:
    key = damage(store, 2)
    rc, verdicts, lines = verify(store)
    assert rc == 1, lines
    assert verdicts[2].startswith(f"FAIL file {key} ") and what in verdicts[2].split(";")[0], verdicts[2]
    assert "re-upload the damaged objects of step 2" in verdicts[2]
    assert "`deltasync fetch --step 1` still works" in verdicts[2]
    # step 3 patches onto step 2: a fetch from anchor 0 stops there; anchor 4 starts a good chain
    assert verdicts[3].startswith("FAIL its chain from anchor 0 passes through step 2, which failed"), verdicts[3]
    assert {s: v for s, v in verdicts.items() if s not in (2, 3)} == dict.fromkeys((0, 1, 4, 5, 6), "OK")
    assert lines[-1] == f"{STEPS} steps verified, 2 failed"


def test_a_damaged_anchor_file_fails_the_anchor_and_its_chain(store: Path) -> None:
    key = flip_byte(store, 4)
    rc, verdicts, lines = verify(store, "--last", "3")
    assert rc == 1 and lines[-1] == "3 steps verified, 3 failed", lines
    assert verdicts[4].startswith(f"FAIL file {key} fails its xxh3-128 checksum"), verdicts[4]
    for step in (5, 6):  # the root cause is named, not the nearest failed step
        assert verdicts[step].startswith("FAIL its anchor, step 4, failed (see above)"), verdicts[step]
    assert "no earlier step verified" in verdicts[4]  # --last 3: steps before the window are not vouched for


def test_a_truncated_manifest_fails_its_step_and_the_others_are_still_listed(store: Path) -> None:
    key = manifest_key(2)
    path = store / key
    path.write_bytes(path.read_bytes()[:200])
    rc, verdicts, lines = verify(store)
    assert rc == 1, lines
    assert sorted(verdicts) == list(range(STEPS))
    assert verdicts[2].startswith("FAIL ") and f"step 2 ({key}): manifest is not valid UTF-8 JSON" in verdicts[2]
    assert f"parent step 2's manifest {key} cannot be read" in verdicts[3], verdicts[3]
    assert [s for s, v in verdicts.items() if v == "OK"] == [0, 1, 4, 5, 6]
    assert lines[-1] == f"{STEPS} steps verified, 2 failed"


def test_a_wrong_parent_digest_fails_the_link(store: Path) -> None:
    path = store / manifest_key(5)
    body = json.loads(path.read_bytes())
    right = body["parent_digest"]
    assert right == xxh3_128((store / manifest_key(4)).read_bytes())
    body["parent_digest"] = "0" * 32
    path.write_text(json.dumps(body))  # still valid JSON, still a valid manifest
    rc, verdicts, lines = verify(store)
    assert rc == 1, lines
    assert verdicts[5].startswith(
        f"FAIL {manifest_key(5)} records parent digest {'0' * 32} but step 4's manifest has digest {right}"
    ), verdicts[5]
    assert "`deltasync fetch --step 4` still works" in verdicts[5]
    # step 5's manifest bytes changed, so step 6's recorded parent digest no longer matches either
    assert verdicts[6].startswith(f"FAIL {manifest_key(6)} records parent digest"), verdicts[6]
    assert [s for s, v in verdicts.items() if v == "OK"] == [0, 1, 2, 3, 4]


def test_a_missing_parent_step_fails_the_patch(store: Path) -> None:
    shutil.rmtree(store / "steps" / f"{1:012d}")
    rc, verdicts, lines = verify(store)
    assert rc == 1 and sorted(verdicts) == [0, 2, 3, 4, 5, 6], lines
    assert verdicts[2].startswith(f"FAIL parent step 1 is not committed ({manifest_key(1)} is missing"), verdicts[2]
    assert "step 2's parent step 1 is not committed" in verdicts[3], verdicts[3]  # the planner's own words
    assert lines[-1] == "6 steps verified, 2 failed"


def test_file_digest_streams_in_ranges_and_equals_the_whole_file_digest(store: Path) -> None:
    m = manifest(store, 0)
    f = m.files[0]
    local = LocalStore(store, fsync=False)
    calls: list[tuple[int, int]] = []
    get_range = local.get_range

    def spy(key: str, start: int, end: int) -> bytes:
        calls.append((start, end))
        return get_range(key, start, end)

    local.get_range = spy  # type: ignore[method-assign]
    assert file_digest(local, file_key(0, f.path), f.size, chunk_bytes=1000) == f.xxh3_128
    assert len(calls) == -(-f.size // 1000) and max(e - s for s, e in calls) == 1000
