"""Shared by the materialize tests: the checks of a materialized dir and the CLI (the fixtures
``materialize_run`` and ``config_dir`` are in ``tests/fetcher/conftest.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tensors import assert_state_equal

from deltasync._util.checkpoint_io import load_checkpoint
from deltasync.protocol.checkpoint import INDEX_NAME

torch = pytest.importorskip("torch")

STEPS = 6
SHARD = 24 * 1024  # the tiny Qwen3 (~200 kB in bf16) in about ten shards
TIMEOUT = 120.0
Run = tuple[Path, list[dict[str, Any]]]


CONFIG_COPIED = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "modeling_x.py",
    "special_tokens_map.json",
    "tokenizer_config.json",
}


def check_dir(out: Path, states: list[dict[str, Any]]) -> int:
    """``out`` is exactly one complete step (marker, index, shards, bits); returns that step."""
    marker = json.loads((out / ".deltasync.json").read_text())
    step = int(marker["step"])
    index = json.loads((out / INDEX_NAME).read_text())
    assert {p.name for p in out.glob("*.safetensors")} == set(index["weight_map"].values())
    assert_state_equal(load_checkpoint(out), states[step], f"{out} at step {step}")
    return step


def leftovers(parent: Path, name: str = "ckpt") -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != name)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from deltasync.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, check=False
    )
