#!/usr/bin/env python
"""deltasync over HF Storage Buckets, measured against a FAKE Hub with hf_xet's local CAS.

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_hf.py                   # small preset (~10M params), lr 1e-6 and 1e-5
    .venv/bin/python benchmarks/bench_hf.py --out benchmarks/RESULTS-hf.md

The script starts ``tests/fakehub.py`` on 127.0.0.1 (the real huggingface_hub + hf_xet code
talks to it; file bytes go to hf_xet's ``local://`` CAS in a temp dir) and replays the update
stream of ``benchmarks/bench_payload.py`` (same model builder, optimizer and bf16 view): a
Qwen3-architecture model with fp32 master weights trained with AdamW, the bf16 view pushed
every step through a ``DeltaUploader`` over an ``HFBucketStore`` (``anchor_every`` huge, so
every measured step is a patch) and synced one step forward by a ``DeltaFetcher(verify=True)``
over a second ``HFBucketStore``. The replica is checked bit-identical to the pushed state.

Per step it also uploads and downloads the same bf16 state as ONE full safetensors checkpoint
(into another prefix of the same bucket, so Xet dedups it against earlier full checkpoints, as
it would on the Hub) and reports:

* wire bytes: what hf_xet stored in the CAS for the step (xorbs + shards, after Xet's chunk
  dedup and compression: the upload volume) plus the HTTP request/response bodies the fake Hub
  saw (JSON, NDJSON), and the object bytes downloaded;
* times: the store's ``put_many`` / ``get_many`` wall time for the patch vs for the full
  checkpoint, and push->committed, fetch+verify+apply.

What a fake Hub + local CAS CANNOT tell about the real Hub: network bandwidth and latency (every
request here is a loopback round trip, the CAS a local disk), the CDN, Xet dedup against the
real global CAS, token refresh, rate limits, and listing consistency.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import deltasync as ds
from deltasync.storage import HFBucketStore
from deltasync.storage.base import Data, PutMode, data_size
from deltasync.storage.wrapper import WrapperStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from fakehub import TOKEN, FakeHub, new_bucket  # noqa: E402


def _load_bench_payload() -> Any:
    spec = importlib.util.spec_from_file_location("bench_payload", ROOT / "benchmarks" / "bench_payload.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bp = _load_bench_payload()

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden=64, layers=2, intermediate=128, vocab=512, heads=4, kv_heads=2, head_dim=16),  # smoke test
    "small": dict(hidden=256, layers=4, intermediate=768, vocab=8192, heads=4, kv_heads=2, head_dim=64),
    "medium": dict(hidden=512, layers=8, intermediate=1536, vocab=32000, heads=8, kv_heads=4, head_dim=64),
}


class TimedStore(WrapperStore[ds.Store]):
    """Delegates to ``inner``; adds up the wall time and object bytes of puts and gets."""

    def __init__(self, inner: ds.Store) -> None:
        super().__init__(inner)
        self.put_s = self.get_s = 0.0
        self.put_bytes = self.get_bytes = 0

    def reset(self) -> None:
        self.put_s = self.get_s = 0.0
        self.put_bytes = self.get_bytes = 0

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        t0 = time.perf_counter()
        self.inner.put_many(items, mode=mode)
        self.put_s += time.perf_counter() - t0
        self.put_bytes += sum(data_size(d) for d in items.values())

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        t0 = time.perf_counter()
        out = self.inner.get_many(keys)
        self.get_s += time.perf_counter() - t0
        self.get_bytes += sum(len(v) for v in out.values())
        return out


@dataclass
class Row:
    lr: float
    step: int
    patch_bytes: int
    patch_cas: int
    patch_http: int
    patch_requests: int
    patch_put_s: float
    commit_s: float
    fetch_get_bytes: int
    fetch_get_s: float
    fetch_s: float
    full_bytes: int
    full_cas: int
    full_put_s: float
    full_get_s: float


def full_checkpoint(state: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in state.items()})


def run_lr(hub: FakeHub, cfg: Any, lr: float, steps: int, warmup: int, log: Any) -> tuple[int, list[Row]]:
    bucket = new_bucket(hub)
    store = TimedStore(HFBucketStore(bucket, "run", endpoint=hub.endpoint, token=TOKEN))
    fetch_store = TimedStore(HFBucketStore(bucket, "run", endpoint=hub.endpoint, token=TOKEN))
    full_store = HFBucketStore(bucket, "full", endpoint=hub.endpoint, token=TOKEN)
    model = bp.build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = bp.make_optimizer(model, cfg, lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rows: list[Row] = []
    up = ds.DeltaUploader(
        store, anchor_every=1 << 30, anchor_bytes_fraction=0.0, on_backlog="block", cast_dtype=torch.bfloat16
    )
    try:
        fetcher = ds.DeltaFetcher(fetch_store, verify=True)
        state = bp.bf16_view(model)
        up.push(state, step=0).result()
        replica = {k: v.clone() for k, v in state.items()}
        fetcher.sync(replica, step=0)
        for step in range(1, warmup + steps + 1):
            x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = bp.bf16_view(model)

            store.reset()
            fetch_store.reset()
            cas0, http0, req0 = hub.cas_bytes(), hub.http_bytes_in + hub.http_bytes_out, len(hub.requests)
            t0 = time.perf_counter()
            info = up.push(model, step=step).result()
            commit_s = time.perf_counter() - t0
            cas1, http1, req1 = hub.cas_bytes(), hub.http_bytes_in + hub.http_bytes_out, len(hub.requests)
            t0 = time.perf_counter()
            fetcher.sync(replica, step=step)
            fetch_s = time.perf_counter() - t0
            bad = [k for k in state if not torch.equal(replica[k].view(torch.int16), state[k].view(torch.int16))]
            if bad or info.kind != "patch":
                raise RuntimeError(f"step {step}: kind {info.kind}, replica differs in {bad[:3]}")

            blob = full_checkpoint(state)
            key = f"step-{step:06d}/model.safetensors"
            t0 = time.perf_counter()
            full_store.put(key, blob)
            full_put_s = time.perf_counter() - t0
            cas2 = hub.cas_bytes()
            t0 = time.perf_counter()
            got = full_store.get(key)
            full_get_s = time.perf_counter() - t0
            if got != blob:
                raise RuntimeError("full checkpoint round trip differs")
            row = Row(
                lr,
                step,
                info.nbytes,
                cas1 - cas0,
                http1 - http0,
                req1 - req0,
                store.put_s,
                commit_s,
                fetch_store.get_bytes,
                fetch_store.get_s,
                fetch_s,
                len(blob),
                cas2 - cas1,
                full_put_s,
                full_get_s,
            )
            log(
                f"lr {lr:g} step {step}{' (warmup)' if step <= warmup else ''}: patch {info.nbytes} B "
                f"({row.patch_put_s * 1e3:.0f} ms up, {row.fetch_get_s * 1e3:.0f} ms down), "
                f"full {len(blob)} B ({full_put_s * 1e3:.0f} ms up, {full_get_s * 1e3:.0f} ms down)"
            )
            if step > warmup:
                rows.append(row)
    finally:
        up.close()
    return params, rows


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render(params: dict[float, int], rows: list[Row], cfg: Any, args: argparse.Namespace, wall: float) -> str:
    out = io.StringIO()
    w = out.write
    w("# deltasync over HF Storage Buckets: FAKE Hub + local Xet CAS\n\n")
    w(
        "**Read this first.** These numbers come from `benchmarks/bench_hf.py` against `tests/fakehub.py`: "
        "the real `huggingface_hub` 2.4.0 + `hf_xet` 1.8.0 client code, a fake Hub on 127.0.0.1 and hf_xet's "
        "`local://` CAS on local disk. They show the client-side cost (Xet chunking, hashing, compression, "
        "request count) and the bytes that leave the process. They cannot show the real Hub's network "
        "bandwidth and latency, the CDN, Xet dedup against the real global CAS, token refresh, rate limits, "
        "or listing consistency.\n\n"
    )
    w(
        f"Model: Qwen3 architecture, preset `{args.preset}` (hidden {cfg.hidden}, {cfg.layers} layers, vocab "
        f"{cfg.vocab}), fp32 master weights, AdamW, bf16 view pushed every step. "
        f"{args.steps} measured steps per lr after {args.warmup} warm-up steps; medians. "
        f"Machine: {platform.machine()}, {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. Total wall time {wall:.0f} s.\n\n"
    )
    w(
        "Columns: *patch* = the step's patch files + manifest + HEAD.json; *CAS* = bytes hf_xet stored "
        "(xorbs + shards, after chunk dedup and compression) = upload volume; *HTTP* = request + response "
        "bodies the Hub saw (JSON/NDJSON: batch, paths-info, tree, tokens); *Hub requests* = HTTP requests to the Hub per committed step (push side); *up* = the store's `put_many` "
        "wall time summed over the step's 3 writes; *commit* = `push()` to committed; *down* = `get_many` "
        "time of the fetcher; *fetch* = `sync()` (plan, download, verify, apply). *full* = the same bf16 "
        "state as one safetensors file, uploaded to another prefix of the same bucket (Xet dedups it "
        "against the previous steps' full checkpoints) and downloaded back.\n\n"
    )
    header = [
        "lr",
        "params",
        "full ckpt",
        "patch",
        "patch CAS",
        "patch HTTP",
        "Hub requests",
        "full CAS",
        "patch up",
        "full up",
        "commit",
        "patch down",
        "full down",
        "fetch",
    ]
    w("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
    for lr, n in params.items():
        rs = [r for r in rows if r.lr == lr]
        cells = [
            f"{lr:g}",
            f"{n / 1e6:.1f}M",
            _mb(_med([r.full_bytes for r in rs])),
            _mb(_med([r.patch_bytes for r in rs])),
            _mb(_med([r.patch_cas for r in rs])),
            _mb(_med([r.patch_http for r in rs])),
            f"{_med([r.patch_requests for r in rs]):.0f}",
            _mb(_med([r.full_cas for r in rs])),
            f"{_med([r.patch_put_s for r in rs]) * 1e3:.0f} ms",
            f"{_med([r.full_put_s for r in rs]) * 1e3:.0f} ms",
            f"{_med([r.commit_s for r in rs]) * 1e3:.0f} ms",
            f"{_med([r.fetch_get_s for r in rs]) * 1e3:.0f} ms",
            f"{_med([r.full_get_s for r in rs]) * 1e3:.0f} ms",
            f"{_med([r.fetch_s for r in rs]) * 1e3:.0f} ms",
        ]
        w("| " + " | ".join(cells) + " |\n")
    w("\nRatios (medians per step):\n\n")
    for lr in params:
        rs = [r for r in rows if r.lr == lr]
        w(
            f"- lr {lr:g}: upload volume patch/full-checkpoint = "
            f"{_med([r.patch_cas / max(r.full_cas, 1) for r in rs]):.4f} (CAS bytes), "
            f"{_med([r.patch_bytes / r.full_bytes for r in rs]):.4f} (object bytes); "
            f"upload time {_med([r.patch_put_s / r.full_put_s for r in rs]):.3f}x, "
            f"download time {_med([r.fetch_get_s / r.full_get_s for r in rs]):.3f}x of the full checkpoint's.\n"
        )
    w("\nPer step:\n\n| lr | step | patch | patch CAS | full CAS | patch up | full up | patch down | full down |\n")
    w("|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        w(
            f"| {r.lr:g} | {r.step} | {_mb(r.patch_bytes)} | {_mb(r.patch_cas)} | {_mb(r.full_cas)} | "
            f"{r.patch_put_s * 1e3:.0f} ms | {r.full_put_s * 1e3:.0f} ms | {r.fetch_get_s * 1e3:.0f} ms | "
            f"{r.full_get_s * 1e3:.0f} ms |\n"
        )
    w(f"\nCommand: `python benchmarks/bench_hf.py {' '.join(args.argv)}`\n")
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    cfg = bp.BenchConfig(**PRESETS[args.preset], adamw="foreach")
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    params: dict[float, int] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-hf-") as tmp, FakeHub(Path(tmp), token=TOKEN) as hub:
        for lr in args.lrs:
            n, rs = run_lr(hub, cfg, lr, args.steps, args.warmup, log)
            params[lr] = n
            rows += rs
    text = render(params, rows, cfg, args, time.perf_counter() - t0)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
