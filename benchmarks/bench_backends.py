#!/usr/bin/env python
"""Transfer cost of deltasync per storage backend: local dir vs S3 (SeaweedFS on loopback, or yours).

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_backends.py                          # small preset, starts SeaweedFS
    .venv/bin/python benchmarks/bench_backends.py --out benchmarks/RESULTS-backends.md
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... .venv/bin/python benchmarks/bench_backends.py \\
        --s3-endpoint https://<account>.r2.cloudflarestorage.com --s3-bucket my-bucket

What it does, per learning rate:

1. trains the Qwen3-architecture model of ``benchmarks/bench_payload.py`` (its ``build_model``,
   ``make_optimizer`` and ``bf16_view``: fp32 master weights, real AdamW, random token batches)
   and keeps the bf16 view of the initial weights and after every step;
2. replays that same stream into each backend: a ``DeltaUploader`` pushes step 0 (the anchor)
   and every patch step (``anchor_every`` huge), and a ``DeltaFetcher(verify=True)`` on a separate
   store object syncs a replica one step forward after each commit (checked bit-identical);
3. per step it records the bytes written and read through the store (payloads of put/get, so
   manifests and HEAD.json included, listings not), the upload time (``push()`` until the
   commit's Future resolves: diff, encode, write files, manifest, HEAD) and the download time
   (``sync()``: list, manifests, files, verify, apply);
4. next to it, a full checkpoint: the safetensors file of the last state written with
   ``store.put`` (a Path payload: multipart on S3) and read back with ``store.get``, five times.

Medians over the measured steps (the first ``--warmup`` patch steps are dropped). On loopback
the S3 column shows the per-request and HTTP overhead of the backend, not a network.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import deltasync as ds
from deltasync._util.checkpoint_io import save_checkpoint
from deltasync.storage import Store
from deltasync.storage.base import Data, PutMode, data_size
from deltasync.storage.wrapper import WrapperStore

HERE = Path(__file__).resolve().parent


def _bench_payload() -> Any:
    spec = importlib.util.spec_from_file_location("bench_payload", HERE / "bench_payload.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


bp = _bench_payload()

FULL_REPS = 5
#: the default: ~29M params (70 MiB of bf16), a few minutes on 2 cores
SMALL = dict(hidden=512, layers=4, intermediate=1536, vocab=16000, heads=8, kv_heads=4, head_dim=64)


class CountingStore(WrapperStore[Store]):
    """Counts the payload bytes written and read through ``inner``."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.written = 0
        self.read = 0

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        self.inner.put_many(items, mode=mode)
        self.written += sum(data_size(d) for d in items.values())

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        out = self.inner.get_many(keys)
        self.read += sum(len(v) for v in out.values())
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        out = self.inner.get_range(key, start, end)
        self.read += len(out)
        return out


@dataclass
class Row:
    """Medians of one backend at one learning rate."""

    backend: str
    lr: float
    density: float
    up_bytes: float
    down_bytes: float
    upload_s: float
    download_s: float
    anchor_bytes: int
    anchor_upload_s: float
    anchor_download_s: float
    full_bytes: int = 0
    full_upload_s: float = 0.0
    full_download_s: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)


def train_stream(cfg: Any, lr: float, log: Callable[[str], None]) -> list[dict[str, torch.Tensor]]:
    """The bf16 view after 0..warmup+steps optimizer steps (bench_payload's model, optimizer and batches)."""
    model = bp.build_model(cfg)
    opt = bp.make_optimizer(model, cfg, lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    states = [bp.bf16_view(model)]
    for step in range(1, cfg.warmup + cfg.steps + 1):
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(bp.bf16_view(model))
        log(f"  trained lr {lr:g} step {step}")
    return states


def measure(
    name: str, lr: float, states: list[dict[str, torch.Tensor]], open_: Callable[[], Store], cfg: Any, tmp: Path
) -> Row:
    """Replay ``states`` into a fresh store and measure every step."""
    up_store, down_store = CountingStore(open_()), CountingStore(open_())
    up = ds.DeltaUploader(
        up_store, anchor_every=1 << 30, anchor_bytes_fraction=0.0, on_backlog="block", encode_threads=2
    )
    fetcher = ds.DeltaFetcher(down_store, verify=True)
    replica = {k: torch.zeros_like(v) for k, v in states[0].items()}
    total = sum(v.numel() for v in states[0].values())
    recs = []
    try:
        for step, state in enumerate(states):
            w0, r0 = up_store.written, down_store.read
            t0 = time.perf_counter()
            info = up.push(state, step=step).result()
            t1 = time.perf_counter()
            fetcher.sync(replica, step=step)
            t2 = time.perf_counter()
            bad = [k for k in state if not torch.equal(replica[k].view(torch.int16), state[k].view(torch.int16))]
            if bad:
                raise RuntimeError(f"{name}: step {step} not bit-identical: {bad[:3]}")
            want = "anchor" if step == 0 else "patch"
            if info.kind != want:
                raise RuntimeError(f"{name}: step {step} is a {info.kind}, expected {want}")
            recs.append(
                dict(
                    step=step,
                    density=info.changed / total,
                    up_bytes=up_store.written - w0,
                    down_bytes=down_store.read - r0,
                    upload_s=t1 - t0,
                    download_s=t2 - t1,
                )
            )
        # a full checkpoint through the same store: one safetensors file, put and get
        ckpt = save_checkpoint(states[-1], tmp / f"full-{uuid.uuid4().hex[:8]}.safetensors")
        ups, downs = [], []
        for i in range(FULL_REPS):
            key = f"full/{i}/model.safetensors"
            t0 = time.perf_counter()
            up_store.put(key, ckpt)
            t1 = time.perf_counter()
            blob = down_store.get(key)
            downs.append(time.perf_counter() - t1)
            ups.append(t1 - t0)
            if len(blob) != ckpt.stat().st_size:
                raise RuntimeError(f"{name}: full checkpoint read back {len(blob)} bytes")
            del blob
        full_bytes = ckpt.stat().st_size
        ckpt.unlink()
    finally:
        up.close()
        up_store.close()
        down_store.close()
    measured = recs[1 + cfg.warmup :]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in measured)

    return Row(
        backend=name,
        lr=lr,
        density=med("density"),
        up_bytes=med("up_bytes"),
        down_bytes=med("down_bytes"),
        upload_s=med("upload_s"),
        download_s=med("download_s"),
        anchor_bytes=int(recs[0]["up_bytes"]),
        anchor_upload_s=recs[0]["upload_s"],
        anchor_download_s=recs[0]["download_s"],
        full_bytes=full_bytes,
        full_upload_s=statistics.median(ups),
        full_download_s=statistics.median(downs),
        steps=recs,
    )


@contextmanager
def s3_backend(args: argparse.Namespace, tmp: Path) -> Iterator[Callable[[str], Store]]:
    """``open(prefix) -> S3Store``: on ``--s3-endpoint`` (keys from AWS_*), else on a SeaweedFS started here."""
    run = f"bench-backends/{uuid.uuid4().hex[:12]}"
    if args.s3_endpoint:
        yield lambda prefix: ds.open_store(f"s3://{args.s3_bucket}/{run}/{prefix}", endpoint=args.s3_endpoint)
        return
    from deltasync.testing.seaweedfs import SeaweedFS

    with SeaweedFS(tmp / "seaweedfs", buckets=[args.s3_bucket]) as server:
        yield lambda prefix: server.store(args.s3_bucket, f"{run}/{prefix}")


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render(rows: list[Row], cfg: Any, params: int, command: str, wall: float, endpoint: str) -> str:
    lines = [
        "## deltasync transfer cost per storage backend",
        "",
        f"Command: `{command}`  ",
        f"Model: Qwen3ForCausalLM (random init) hidden {cfg.hidden}, {cfg.layers} layers, intermediate "
        f"{cfg.intermediate}, vocab {cfg.vocab}: {params / 1e6:.1f}M params, bf16 view pushed "
        f"({_mib(2 * params)}).  ",
        f"Stream: AdamW (fp32 master), batch {cfg.batch} x seq {cfg.seq}; step 0 = anchor, then "
        f"{cfg.warmup} warm-up + {cfg.steps} measured patch steps per lr; medians over the measured steps.  ",
        f"Backends: local = LocalStore in a temp dir (fsync on); s3 = S3Store on {endpoint}.  ",
        f"Machine: {platform.machine()}, os.cpu_count()={os.cpu_count()}, python {platform.python_version()}, "
        f"torch {torch.__version__}. Wall time: {wall:.0f} s.",
        "",
        "### Per patch step (medians)",
        "",
        "| lr | backend | changed | bytes up / step | upload (push -> committed) | bytes down / step "
        "| download (sync: fetch+verify+apply) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.lr:g} | {r.backend} | {100 * r.density:.2f}% | {_mib(r.up_bytes)} | {1e3 * r.upload_s:.0f} ms "
            f"| {_mib(r.down_bytes)} | {1e3 * r.download_s:.0f} ms |"
        )
    lines += [
        "",
        "### Next to a full checkpoint",
        "",
        "| lr | backend | full ckpt bytes | full upload (put) | full download (get) | anchor step upload "
        "| anchor step download | patch / full bytes | patch upload / full upload | patch download / full download |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.lr:g} | {r.backend} | {_mib(r.full_bytes)} | {1e3 * r.full_upload_s:.0f} ms "
            f"| {1e3 * r.full_download_s:.0f} ms | {1e3 * r.anchor_upload_s:.0f} ms | {1e3 * r.anchor_download_s:.0f} ms "
            f"| {r.up_bytes / r.full_bytes:.4f} | {r.upload_s / r.full_upload_s:.2f} "
            f"| {r.download_s / r.full_download_s:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    d = bp.BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--preset", choices=["small", *sorted(bp.PRESETS)], default="small")
    p.add_argument("--steps", type=int, default=8, help="measured patch steps per lr")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lrs", type=float, nargs="+", default=list(d.lrs))
    p.add_argument("--backends", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    p.add_argument("--s3-endpoint", default=None, help="use this S3 endpoint (keys from AWS_*) instead of SeaweedFS")
    p.add_argument("--s3-bucket", default="bench")
    p.add_argument("--tmpdir", default=None)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    shape = SMALL if args.preset == "small" else bp.PRESETS[args.preset]
    cfg = replace(d, **shape, steps=args.steps, warmup=args.warmup, lrs=tuple(args.lrs))

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-backends-", dir=args.tmpdir) as tmp_s:
        tmp = Path(tmp_s)
        with s3_backend(args, tmp) as open_s3:
            endpoint = args.s3_endpoint or "SeaweedFS 4.48 `weed mini` on 127.0.0.1"
            params = 0
            for lr in cfg.lrs:
                states = train_stream(cfg, lr, log)
                params = sum(v.numel() for v in states[0].values())
                for backend in args.backends:
                    where = f"lr-{lr:g}"

                    def opener(backend: str = backend, where: str = where) -> Store:
                        return ds.LocalStore(tmp / "local" / where) if backend == "local" else open_s3(where)

                    log(f"  lr {lr:g}: replaying {len(states)} steps into {backend}")
                    rows.append(measure(backend, lr, states, opener, cfg, tmp))
                del states
    command = "python " + " ".join(["benchmarks/bench_backends.py", *(sys.argv[1:] if argv is None else argv)])
    text = render(rows, cfg, params, command, time.perf_counter() - t_start, endpoint)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
