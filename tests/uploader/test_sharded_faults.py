"""Faults of a sharded push on real multi-process groups: FSDP2 (``fully_shard``) on CPU, gloo, real AdamW.

Each test starts ``world`` processes of tests/sharded_faults_worker.py; see its docstring for the
scenarios. Every test ends with each committed step read back bit-exact by a single-process
``DeltaFetcher(verify="full")`` against the gathered model, and checks that no rank was told a
false outcome: every surviving rank reports the same outcome (and, for a commit, the same digest)
for every step, and a step is reported committed exactly when its manifest is in the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "sharded_faults_worker.py"


def _run(world: int, scenario: str, run_dir: Path, *, killed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over the loopback interface only
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(run_dir), scenario],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=400)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        want = -9 if r in killed else 0
        assert p.returncode == want, f"rank {r} exited with {p.returncode}:\n{logs[r][-6000:]}"
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world) if r not in killed]


def _committed_steps(store: Path) -> set[int]:
    return {int(p.name) for p in (store / "steps").iterdir() if (p / "manifest.json").exists()}


def _check_agreed(ranks: list[dict[str, Any]], store: Path) -> dict[int, dict[str, Any]]:
    """Every surviving rank tells the same story, the store agrees with it, and every commit reads back bit-exact."""
    first = ranks[0]["events"]
    for r in ranks[1:]:
        assert len(r["events"]) == len(first)
        for a, b in zip(first, r["events"], strict=True):
            assert a["ok"] == b["ok"], (a, b)
            if a["ok"]:
                assert (a["kind"], a["digest"], a["committed_step"]) == (b["kind"], b["digest"], b["committed_step"])
            else:
                assert a["type"] == b["type"] == "CommitFailed"
    reported = {e["step"] for e in first if e["ok"] and e["kind"] != "skipped"}
    assert reported == _committed_steps(store)  # reported committed <=> its manifest is in the store
    assert ranks[0]["verified"] == {str(s): True for s in sorted(reported)}
    return {e["step"]: e for e in first}


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_pushing_a_stale_step_fails_that_step_everywhere_and_the_group_goes_on(
    tmp_path: Path, world: int
) -> None:
    ranks = _run(world, "stale", tmp_path)
    _check_agreed(ranks, tmp_path / "store")
    for r in ranks:
        ev = {e["step"]: e for e in r["events"]}
        assert [s for s, e in ev.items() if not e["ok"]] == [4]
        # the same CommitFailed, naming the rank and what to push, on every rank
        assert ev[4]["error"] == ranks[0]["events"][4]["error"]
        assert "rank 1: ProtocolError: step 3 is not after the last step 3; push step 4 or later" in ev[4]["error"]
        assert [ev[s]["kind"] for s in (5, 6, 7)] == ["anchor", "patch", "patch"]  # recovered, in step
    assert _committed_steps(tmp_path / "store") == {0, 1, 2, 3, 5, 6, 7}


def test_a_rank_killed_after_its_report_does_not_turn_a_commit_into_a_failure(tmp_path: Path) -> None:
    ranks = _run(3, "kill", tmp_path, killed=(2,))
    _check_agreed(ranks, tmp_path / "store")
    for r in ranks:  # ranks 0 and 1: step 3 is committed (rank 0 wrote its manifest after rank 2 died)
        ev = {e["step"]: e for e in r["events"]}
        assert all(e["ok"] for e in ev.values()), ev
        assert ev[3]["committed_step"] == 3
    assert _committed_steps(tmp_path / "store") == {0, 1, 2, 3}


def test_a_straggler_past_the_timeout_fails_one_step_then_the_group_rejoins_and_goes_on(tmp_path: Path) -> None:
    ranks = _run(2, "straggler", tmp_path)
    _check_agreed(ranks, tmp_path / "store")
    for r in ranks:
        ev = {e["step"]: e for e in r["events"]}
        assert [s for s, e in ev.items() if not e["ok"]] == [3]
        assert "the rank group lost contact during the step" in ev[3]["error"]
        assert "Keep pushing on every rank" in ev[3]["error"]
        assert [ev[s]["kind"] for s in (4, 5, 6)] == ["anchor", "patch", "patch"]
    assert _committed_steps(tmp_path / "store") == {0, 1, 2, 4, 5, 6}


def test_a_restarted_group_re_pushing_the_head_writes_nothing_and_goes_on(tmp_path: Path) -> None:
    ranks = _run(2, "resume", tmp_path)
    _check_agreed(ranks, tmp_path / "store")
    for r in ranks:
        evs = r["events"]
        assert [e["step"] for e in evs] == [0, 1, 2, 3, 3, 4, 5]
        assert all(e["ok"] for e in evs), evs
        again = evs[4]
        assert (again["kind"], again["committed_step"], again["digest"]) == ("skipped", 3, evs[3]["digest"])
        assert [e["kind"] for e in evs[5:]] == ["anchor", "patch"]  # a sharded state is not proven: an anchor
    assert _committed_steps(tmp_path / "store") == {0, 1, 2, 3, 4, 5}
