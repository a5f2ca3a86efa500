"""Shared by the materialize tests: a small run (tiny Qwen3, steps 0..5), an HF model dir, checks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_state_equal, make_qwen3, qwen3_config

import deltasync as ds
from deltasync._checkpoint_io import load_checkpoint
from deltasync.protocol.checkpoint import INDEX_NAME

torch = pytest.importorskip("torch")

STEPS = 6
SHARD = 24 * 1024  # the tiny Qwen3 (~200 kB in bf16) in about ten shards
TIMEOUT = 120.0
Run = tuple[Path, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Steps 0..5 (anchors at 0 and 3); each later step rewrites 1% of two tensors."""
    root = tmp_path_factory.mktemp("mat") / "run"
    state = {k: v.detach().clone() for k, v in make_qwen3(seed=3, dtype=torch.bfloat16).state_dict().items()}
    names = sorted(state)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    states = []
    with ds.DeltaUploader(ds.LocalStore(root, fsync=False), anchor_every=3) as up:
        for step in range(STEPS):
            for n in rng.sample(names, 2) if step else []:
                flat = state[n].view(-1)
                idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
                flat[idx] = torch.randn(len(idx), generator=gen).to(torch.bfloat16)
            up.push(state, step=step).result()
            states.append({k: v.clone() for k, v in state.items()})
    return root, states


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model dir: config, tokenizer files, chat template, remote code; plus what must not be copied."""
    d = tmp_path_factory.mktemp("cfg") / "model"
    qwen3_config().save_pretrained(d)
    (d / "generation_config.json").write_text("{}")
    (d / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (d / "special_tokens_map.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "modeling_x.py").write_text("# remote code\n")
    (d / "model.safetensors").write_bytes(b"weights: never copied")
    (d / "pytorch_model.bin").write_bytes(b"weights")
    (d / "model.safetensors.index.json").write_text("{}")
    (d / ".hidden").write_text("no")
    (d / "sub").mkdir()
    (d / "sub" / "x.txt").write_text("no subdirs")
    return d


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
