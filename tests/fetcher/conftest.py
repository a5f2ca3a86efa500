"""Fixtures of the fetcher tests: ``deltasync.fetcher`` (DeltaFetcher, materialize, fold, metrics).

The area covers sync and its proofs of what a target holds, allocation of an empty target, corrupt
stores, folding decoded steps, checkpoint dirs rewritten for engines (``materialize``, ``fetch
--out``, ``follow --out``, killed at every point) and the Prometheus metrics.

Fixtures defined here, both module scope, for test_materialize and test_materialize_kill:

* ``materialize_run``: a tiny Qwen3 run in a local store, steps 0..5 (anchors at 0 and 3),
  with the state of every step (``materialize_support.Run``). Named apart from the ``run``
  fixtures of test_fetcher_alloc and test_fetcher_identity, which are other runs (a
  MemoryStore each, of their own states and scope) and stay in their modules.
* ``config_dir``: an HF model dir (config, tokenizer files, chat template, remote code) plus
  files that must not be copied.

No root fixture is used. Helper modules: ``materialize_support``, ``qwen3``, ``tensors``,
``cli_process``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from materialize_support import STEPS, Run
from qwen3 import make_qwen3, qwen3_config

import deltasync as ds


@pytest.fixture(scope="module")
def materialize_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Steps 0..5 (anchors at 0 and 3); each later step rewrites 1% of two tensors."""
    torch = pytest.importorskip("torch")
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
