"""Helpers of the scripts that the vLLM tests run inside the vLLM venv (test support, not deltasync).

Scripts (see ``tests/vllm_harness.py::run_vllm``) do::

    import engine_checks as ec

    def check(p):                 # p: the params dict the test passed
        llm = ec.make_llm(p["model"])
        return {"fp": ec.fingerprint(llm)}

    if __name__ == "__main__":    # vLLM spawns workers: the guard is required
        ec.main(check)

Worker-side checks are methods of ``CheckWorkerExtension`` (installed by ``make_llm``), called by
name through ``LLM.collective_rpc``. Their arguments are file paths and names, never tensors
(tensors do not survive ``collective_rpc`` in multi-process mode).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

PROMPTS = [
    "deltasync ships sparse",
    "Q: What does deltasync ship? A:",
    "the quick brown fox",
]
MAX_TOKENS = 12
LOGPROBS = 3
MAX_MODEL_LEN = 512  # room for prompts of several KV blocks (128 tokens each on CPU)
PREFIX_BLOCKS = 3  # the shared prefix of prefix_fingerprint's prompts, in KV blocks
TAIL = 40  # each prompt's own tokens after it (less than a block: never cached)


def main(check: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Read params from argv[1], run ``check``, write its result (plus timings) as JSON to argv[2].

    An exception is written as ``{"error": ..., "traceback": ...}`` and the script exits 1.
    """
    params_path, result_path = sys.argv[1], sys.argv[2]
    with open(params_path) as fh:
        params = json.load(fh)
    t0 = time.monotonic()
    try:
        result = check(params)
        code = 0
    except BaseException as exc:  # report it, whatever it is
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    result["script_s"] = round(time.monotonic() - t0, 2)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True, default=str)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's atexit/teardown can hang with workers around; the result is written


def make_llm(model: str, tp: int = 1, **kw: Any) -> Any:
    """A small CPU engine on ``model`` (a checkpoint dir): bf16, eager, 512 tokens, 64 MiB KV cache, prefix
    caching on (vLLM's default)."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=64 << 20,
        tensor_parallel_size=tp,
        seed=0,
        worker_extension_cls="engine_checks.CheckWorkerExtension",
    )
    if tp > 1:
        args["distributed_executor_backend"] = "mp"
    args.update(kw)
    return LLM(**args)


def fingerprint(llm: Any, prompts: list[str] | None = None) -> list[dict[str, Any]]:
    """Greedy completions of ``prompts``: token ids, text and top-k logprobs (exact floats)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, seed=0, ignore_eos=True)
    outs = llm.generate(prompts or PROMPTS, sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted((int(t), float(lp.logprob)) for t, lp in pos.items()) for pos in (c.logprobs or [])]
        result.append({"prompt": o.prompt, "token_ids": list(c.token_ids), "text": c.text, "logprobs": lps})
    return result


def shared_prefix_prompts(block_size: int) -> list[list[int]]:
    """Three prompts (token ids) sharing their first ``PREFIX_BLOCKS`` KV blocks, as the samples of a
    GRPO group share their prompt, each with ``TAIL`` tokens of its own."""
    rng = random.Random(24)
    prefix = [rng.randrange(3, 1024) for _ in range(PREFIX_BLOCKS * block_size)]
    return [prefix + [rng.randrange(3, 1024) for _ in range(TAIL)] for _ in range(3)]


def prefix_fingerprint(llm: Any) -> dict[str, Any]:
    """Greedy completions (token ids, top-k logprobs) of ``shared_prefix_prompts``, one request after the
    other, each with the number of its prompt tokens vLLM took from the prefix cache
    (``num_cached_tokens``): the first request hits only KV that was in the cache before the call,
    the next two hit the prefix the first one just computed."""
    from vllm import SamplingParams

    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, seed=0, ignore_eos=True)
    outputs = []
    for ids in shared_prefix_prompts(block_size):
        (o,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        c = o.outputs[0]
        lps = [sorted((int(t), float(lp.logprob)) for t, lp in pos.items()) for pos in (c.logprobs or [])]
        outputs.append({"token_ids": list(c.token_ids), "logprobs": lps, "cached": int(o.num_cached_tokens or 0)})
    return {"block_size": block_size, "prompt_len": PREFIX_BLOCKS * block_size + TAIL, "outputs": outputs}


def checksums(llm: Any) -> dict[str, str]:
    """vLLM's own per-parameter sha256 digests, all workers merged (names carry ``dp0:pp0:pcp0:tpN:``)."""
    merged: dict[str, str] = {}
    for part in llm.collective_rpc("compute_weight_checksums"):
        merged.update(part)
    return merged


def rank_of(name: str) -> str:
    """The ``tpN`` of a checksum key."""
    return name.split(":")[3]


def param_of(name: str) -> str:
    """The parameter name of a checksum key."""
    return name.split(":", 4)[4]


# ------------------------------------------------------------------------------- worker side


class CheckWorkerExtension:
    """Worker methods the checks call by name: ``llm.collective_rpc("check_load_tensors", args=...)``.

    ``make_llm`` installs it (``worker_extension_cls``). A worker extension rather than callables:
    with multiprocessing on, vLLM refuses to send a function through ``collective_rpc`` unless
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Names start with ``check_`` so that they cannot
    clash with the worker's own attributes.
    """

    def check_load_tensors(self, path: str, names: list[str] | None = None) -> list[str]:
        """``model.load_weights`` of tensors ``names`` (default all) of a safetensors file; the params it loaded."""
        from safetensors.torch import load_file

        state = load_file(path)
        wanted = list(state) if names is None else list(names)
        loaded = self.model_runner.model.load_weights((n, state[n]) for n in wanted)  # type: ignore[attr-defined]
        return sorted(loaded) if loaded is not None else []

    def check_row_digests(self, param: str, blocks: list[list[int]]) -> list[str]:
        """sha256 of rows ``[start, stop)`` of parameter ``param``, for each block."""
        p = dict(self.model_runner.model.named_parameters())[param]  # type: ignore[attr-defined]
        return [sha256_of(p.detach()[a:b]) for a, b in blocks]

    def check_describe_param(self, param: str) -> dict[str, Any]:
        """Shape and dtype of ``param``, and whether the TEST-ONLY CPU GEMM patch is active here."""
        from vllm.model_executor.layers import utils

        p = dict(self.model_runner.model.named_parameters())[param]  # type: ignore[attr-defined]
        return {
            "shape": list(p.shape),
            "dtype": str(p.dtype),
            "patched": bool(getattr(utils.dispatch_cpu_unquantized_gemm, "deltasync_test_patch", False)),
        }

    def check_scatter(self, model_dir: str, seed: int, cast: list[str]) -> dict[str, Any]:
        """Apply one random update of every tensor of the engine's checkpoint twice, through
        ``ScatterLoader`` and through ``model.load_weights``, from the same starting bits; report
        the parameters whose bits differ (must be none), what went where, and the maps' reasons.

        Each tensor gets its own density (some below the loader's threshold: scattered, some above:
        copied whole, one ``None``: copied whole); the tensors named in ``cast`` are given to the
        loader as fp32 (their load casts: no map, the loader takes them).
        """
        import dataclasses
        import glob

        import torch
        from safetensors.torch import load_file

        from deltasync.serving.engine.scatter import ScatterLoader

        model = self.model_runner.model  # type: ignore[attr-defined]
        old: dict[str, Any] = {}
        for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
            old.update(load_file(f))
        for n in cast:
            old[n] = old[n].float()
        g = torch.Generator().manual_seed(seed)
        densities = [0.001, 0.05, 0.17, 0.6]
        items = []
        for i, (name, t) in enumerate(sorted(old.items())):
            new = t.clone()
            flat = new.view(-1)
            d = densities[i % len(densities)]
            k = max(1, int(flat.numel() * d))
            pos = torch.randperm(flat.numel(), generator=g)[:k].sort().values
            flat[pos] = flat[pos] + torch.randn(k, generator=g).to(flat.dtype) * 0.01 + 0.001
            items.append((name, new, None if i == 3 else pos))

        def load(pairs: Any) -> Any:
            with torch.no_grad():
                return model.load_weights(pairs)

        params = dict(model.named_parameters())
        load(iter(old.items()))
        start = {n: p.detach().clone() for n, p in params.items()}
        loader = ScatterLoader(model, {n: (t.dtype, tuple(t.shape)) for n, t in old.items()}, load, max_density=0.3)
        counts = loader(iter(items))
        via_scatter = {n: p.detach().clone() for n, p in params.items()}
        load(iter(old.items()))
        back = [n for n, p in params.items() if not torch.equal(p, start[n])]
        load(iter((n, t) for n, t, _ in items))
        differ = [
            n for n, p in params.items() if not torch.equal(p.view(torch.uint8), via_scatter[n].view(torch.uint8))
        ]
        changed = [n for n, p in params.items() if not torch.equal(p, start[n])]
        return {
            "counts": dataclasses.asdict(counts),
            "differ": differ,
            "not_restored": back,
            "changed": changed,
            "params": sorted(params),
            "mapped": sorted(loader.map.maps),
            "unmapped": loader.map.unmapped,
            "segments": {
                n: [[list(s.shape), s.src_offset, list(s.src_strides), s.dst_offset, list(s.dst_strides)] for s in segs]
                for n, segs in loader.map.maps.items()
            },
        }


def sha256_of(t: Any) -> str:
    """sha256 of a tensor's bytes, as vLLM's ``compute_weight_checksums`` computes it."""
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def expected_checksums(path: str | dict[str, Any], tp: int = 1, tied: bool = False) -> dict[str, str]:
    """What ``compute_weight_checksums`` must report for a Qwen3 checkpoint file on ``tp`` ranks.

    Keys as vLLM makes them (``dp0:pp0:pcp0:tp<r>:<param>``). vLLM fuses ``q/k/v_proj`` into
    ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` (rows of each part, concatenated);
    with tensor parallelism each rank holds its slice of every part: rows of the column-parallel
    weights (qkv, gate_up, embeddings, lm_head), columns of the row-parallel ones (o_proj,
    down_proj); norms are replicated. Assumes no vocab padding (vocab a multiple of 64 * tp) and
    at least ``tp`` kv heads, as the tiny test model has. ``tied``: the engine ties ``lm_head.weight``
    to ``model.embed_tokens.weight`` (one parameter, reported once under the embeddings' name).
    """
    import torch
    from safetensors.torch import load_file

    state = load_file(path) if isinstance(path, str) else path
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    fused = {
        "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    }
    parts = {m for _, ms in fused.values() for m in ms}
    cols = ("o_proj", "down_proj")

    def rows(t: Any, r: int) -> Any:
        n = t.shape[0] // tp
        return t[r * n : (r + 1) * n]

    out: dict[str, str] = {}
    for r in range(tp):
        prefix = f"dp0:pp0:pcp0:tp{r}:"
        for name, t in state.items():
            module = name.rsplit(".", 2)[-2]
            if module in fused:
                target, members = fused[module]
                whole = torch.cat([rows(state[name.replace(module, m)], r) for m in members])
                out[prefix + name.replace(module, target)] = sha256_of(whole)
            elif module in parts:
                continue
            elif t.ndim == 1 or tp == 1:
                out[prefix + name] = sha256_of(t)
            elif module in cols:
                n = t.shape[1] // tp
                out[prefix + name] = sha256_of(t[:, r * n : (r + 1) * n])
            else:
                out[prefix + name] = sha256_of(rows(t, r))
    return out
