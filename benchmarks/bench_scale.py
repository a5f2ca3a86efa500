"""A step's cost at the sizes RL teams train: Qwen3-8B dense and Qwen3-30B-A3B MoE, real names and shapes.

    python benchmarks/bench_scale.py [--model qwen3-8b,qwen3-30b-a3b] [--scale 0.01] [--density 0.01,0.03,0.1]
                                     [--steps 3] [--threads N] [--per-tensor] [--thread-scan 1,2,4,8,16]
                                     [--device cpu|cuda|both] [--format 1|2] [--out FILE]
                                     [--codec-scan 1,2,4,8,16] [--rates]

The states are synthetic bf16 tensors with the models' real tensor names and shapes (Qwen3-8B: 36
layers, hidden 4096, 399 tensors; Qwen3-30B-A3B: 48 layers x 128 experts x 3 projections plus
attention, norms and routers: 18,867 tensors). ``--scale s`` keeps every tensor and its name and
multiplies each tensor's first dimension by ``s`` (at least 1 row), so a reduced run keeps the
tensor count, which is what the per-tensor costs follow, and holds ``s`` of the elements. Each step
changes ``--density`` of every tensor's elements by one bf16 ulp up or down (what AdamW at RL learning
rates does to bf16 weights: +-1 in the bits), to a local store (``/dev/shm`` when there is one).

Per model and density, medians over ``--steps`` patch steps:

- push: seconds until ``push()`` returns (what training waits);
- commit: push -> committed (the step's Future resolved: encoded, written, manifest, HEAD);
- sync host: a follower's ``DeltaFetcher.sync`` into a dict of host tensors (download, verify, apply);
- sync cuda: the same into CUDA tensors (``--device cuda|both`` with a GPU);
- node: a node mirror's build of the step (``NodeMirror.ensure``, in process) from its previous version;
- bytes: the step's payload; manifest: bytes of ``manifest.json`` per tensor;
- copy: one plain full copy of the state in the same run (host: memcpy into a preallocated buffer;
  cuda: device->host and host->device through pinned memory), and commit / sync over it.

``--per-tensor`` runs the issue's comparison: the same elements as 288 dense tensors and as 18,432
MoE-shaped ones (48 x 128 x 3), commit and sync side by side, and their ratio; ``--repeat R`` runs
the pair R times one after the other (288, 18,432, 288, ...) and prints each pair's ratios and
their medians, so that a noisy machine's drift lands on both sides of a ratio alike.
``--thread-scan`` repeats one model at each thread count (uploader ``encode_threads`` and fetcher
``threads``) and prints the scaling against 1 thread.
``--codec-scan 1,2,4,8,16`` runs the codec alone (diff, encode, decode+apply, xxh3-128 over many
4M-element groups on the product's pool) at each thread count and prints GB/s and the speedup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deltasync as ds  # noqa: E402
from deltasync._util.cpus import usable_cpus  # noqa: E402

State = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- shapes


def _attention(p: str, h: int, q: int, kv: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A Qwen3 layer's norms and attention (head dim 128, q/k norms)."""
    yield p + "input_layernorm.weight", (h,)
    yield p + "post_attention_layernorm.weight", (h,)
    yield p + "self_attn.q_proj.weight", (q, h)
    yield p + "self_attn.k_proj.weight", (kv, h)
    yield p + "self_attn.v_proj.weight", (kv, h)
    yield p + "self_attn.o_proj.weight", (h, q)
    yield p + "self_attn.q_norm.weight", (128,)
    yield p + "self_attn.k_norm.weight", (128,)


def qwen3_8b() -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3-8B's tensors (config: hidden 4096, 36 layers, 32 heads x 128, 8 KV heads, MLP 12288, vocab 151936)."""
    h, inter, vocab, q, kv = 4096, 12288, 151936, 32 * 128, 8 * 128
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(36):
        p = f"model.layers.{i}."
        yield from _attention(p, h, q, kv)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (vocab, h)


def qwen3_30b_a3b() -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3-30B-A3B's tensors (hidden 2048, 48 layers, 32 heads x 128, 4 KV heads, 128 experts of 768)."""
    h, moe, vocab, q, kv = 2048, 768, 151936, 32 * 128, 4 * 128
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(48):
        p = f"model.layers.{i}."
        yield from _attention(p, h, q, kv)
        yield p + "mlp.gate.weight", (128, h)
        for e in range(128):
            yield f"{p}mlp.experts.{e}.gate_proj.weight", (moe, h)
            yield f"{p}mlp.experts.{e}.up_proj.weight", (moe, h)
            yield f"{p}mlp.experts.{e}.down_proj.weight", (h, moe)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (vocab, h)


def per_tensor_pair(total: int) -> dict[str, Iterator[tuple[str, tuple[int, ...]]]]:
    """The issue's comparison: ``total`` elements as 288 dense tensors and as 48 x 128 x 3 experts."""

    def dense() -> Iterator[tuple[str, tuple[int, ...]]]:
        cols = max(1, total // 288 // 256)
        for i in range(288):
            yield f"model.layers.{i // 8}.w{i % 8}.weight", (256, cols)

    def moe() -> Iterator[tuple[str, tuple[int, ...]]]:
        cols = max(1, total // 18432 // 64)
        for i in range(48):
            for e in range(128):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    yield f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", (64, cols)

    return {"288 tensors": dense(), "18,432 tensors": moe()}


MODELS: dict[str, Callable[[], Iterator[tuple[str, tuple[int, ...]]]]] = {
    "qwen3-8b": qwen3_8b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}


def scaled(shapes: Iterator[tuple[str, tuple[int, ...]]], scale: float) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, (max(1, round(s[0] * scale)), *s[1:])) for n, s in shapes]


def make_state(shapes: list[tuple[str, tuple[int, ...]]], device: str, seed: int = 0) -> State:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out: State = {}
    for name, shape in shapes:
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        out[name] = t.to(device)
    return out


def adamw_like(state: State, density: float, seed: int) -> None:
    """Change ``density`` of every tensor's elements by one bf16 ulp (+-1 in the bits), in place."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for t in state.values():
        bits = t.view(torch.int16).reshape(-1)
        n = bits.numel()
        k = max(1, int(n * density))
        pos = torch.randint(0, n, (k,), generator=g).to(t.device)
        step = (torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1).to(t.device)
        bits[pos] += step


# ----------------------------------------------------------------------------- measuring


def shm_dir() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


def full_copy(state: State, device: str, reps: int = 3) -> float:
    """Median seconds of one plain full copy of the state (host: memcpy; cuda: d2h + h2d, pinned)."""
    times = []
    if device == "cpu":
        import numpy as np

        # numpy's copy is a plain memcpy (torch's copy_ threads badly on a loaded machine)
        src = [v.view(torch.int16).numpy() for v in state.values()]
        dst = [np.empty_like(a) for a in src]
        for a, b in zip(src, dst, strict=True):  # warm: the first touch of fresh pages is not the copy's cost
            np.copyto(b, a)
        for _ in range(reps):
            t0 = time.perf_counter()
            for a, b in zip(src, dst, strict=True):
                np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    back = {k: torch.empty_like(v) for k, v in state.items()}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        for k, v in pinned.items():
            back[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_one(
    label: str,
    shapes: list[tuple[str, tuple[int, ...]]],
    density: float,
    args: argparse.Namespace,
    *,
    device: str = "cpu",
    threads: int | None = None,
    node: bool = True,
) -> dict[str, Any]:
    """Anchor, then ``args.steps`` patch steps; medians of each figure."""
    from deltasync.serving.node.mirror import NodeMirror

    state = make_state(shapes, device)
    numel = sum(t.numel() for t in state.values())
    with tempfile.TemporaryDirectory(dir=shm_dir(), prefix="bench-scale-") as tmp:
        store = ds.LocalStore(Path(tmp) / "run", fsync=False)
        up = ds.DeltaUploader(
            store,
            anchor_every=10**6,
            anchor_bytes_fraction=0,
            span_levels=(),
            encode_threads=threads,
            format_version=args.format,
        )
        up.push(state, 0).result()
        fetch = ds.DeltaFetcher(store, threads=threads)
        host = {k: v.detach().cpu().clone() for k, v in state.items()}
        fetch.sync(host, step=0)
        cuda_fetch = cuda_target = None
        if device == "cuda":
            cuda_fetch = ds.DeltaFetcher(store, threads=threads)
            cuda_target = {k: v.clone() for k, v in state.items()}
            cuda_fetch.sync(cuda_target, step=0)
        mirror = None
        if node:
            mirror = NodeMirror(ds.DeltaFetcher(store, threads=threads), root=Path(tmp) / "node", spawn=False)
            mirror.seed({k: v.detach().cpu() for k, v in state.items()}, 0)
        rows: dict[str, list[float]] = {
            k: [] for k in ("push", "commit", "sync_host", "sync_cuda", "node", "bytes", "manifest")
        }
        try:
            for step in range(1, args.steps + 1):
                adamw_like(state, density, seed=step)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fut = up.push(state, step)
                t1 = time.perf_counter()
                info = fut.result()
                t2 = time.perf_counter()
                rows["push"].append(t1 - t0)
                rows["commit"].append(t2 - t0)
                rows["bytes"].append(info.nbytes)
                rows["manifest"].append(len(store.get(f"steps/{step:012d}/manifest.json")) / len(state))
                t0 = time.perf_counter()
                fetch.sync(host, step=step)
                rows["sync_host"].append(time.perf_counter() - t0)
                if cuda_fetch is not None and cuda_target is not None:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    cuda_fetch.sync(cuda_target, step=step)
                    torch.cuda.synchronize()
                    rows["sync_cuda"].append(time.perf_counter() - t0)
                if mirror is not None:
                    t0 = time.perf_counter()
                    mirror.ensure(step)
                    rows["node"].append(time.perf_counter() - t0)
            for k, v in state.items():  # bit-exact, or the figures mean nothing (bits: a +-1 may make a NaN)
                if not torch.equal(host[k].view(torch.int16), v.detach().cpu().view(torch.int16)):
                    raise AssertionError(f"{label}: follower differs at {k}")
        finally:
            up.close()
            if mirror is not None:
                mirror.close()
        copy_s = full_copy(state, device)
    med = {k: (statistics.median(v) if v else None) for k, v in rows.items()}
    return {
        "label": label,
        "device": device,
        "tensors": len(state),
        "numel": numel,
        "density": density,
        "copy": copy_s,
        **med,
    }


def per_core_rates(density: float, numel: int = 1 << 22, reps: int = 5) -> str:
    """One core's rates on one format-2 group of ``numel`` bf16 elements: diff, encode, decode+apply, xxh3."""
    import numpy as np

    from deltasync.protocol.digests import xxh3_128_array
    from deltasync.protocol.encoding import decode_positions, decode_values, encode_changes
    from deltasync.protocol.kernels import impl
    from deltasync.uploader._diff import diff_tensor

    rng = np.random.default_rng(0)
    base = rng.integers(-(2**15), 2**15, numel, dtype=np.int16)
    new = base.copy()
    pos = rng.choice(numel, int(numel * density), replace=False)
    new[pos] += rng.choice(np.array([-1, 1], dtype=np.int16), pos.size)

    def med(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    d = diff_tensor(torch.from_numpy(base.copy()), torch.from_numpy(new))
    assert d is not None
    t_diff = med(lambda: diff_tensor(torch.from_numpy(base.copy()), torch.from_numpy(new)))
    t_copy = med(lambda: base.copy())
    enc = encode_changes(numel, d.idx, d.old, d.new)
    t_enc = med(lambda: encode_changes(numel, d.idx, d.old, d.new))
    arr = base.copy()

    def dec() -> None:
        idx = decode_positions(enc.pos_blob, enc.positions, enc.rice_k, enc.count, numel, "bench")
        vals = decode_values(enc.val_blob, enc.values, enc.count, np.dtype(np.int16), "bench")
        arr[idx] = arr[idx] ^ vals if enc.values == "xor-rank" else vals

    t_dec = med(dec)
    t_hash = med(lambda: xxh3_128_array(new))
    n = d.idx.size
    return (
        f"one core, one group of {numel:,} bf16 elements, {density:.0%} changed ({n:,} elements, "
        f"{enc.nbytes / n:.2f} B each; kernels: {'numba' if impl() is not None else 'numpy'}): "
        f"diff {numel / max(t_diff - t_copy, 1e-9) / 1e9:.2f} G elements/s (the copy it needs excluded), "
        f"encode {n / t_enc / 1e6:.1f} M changed/s, decode+apply {n / t_dec / 1e6:.1f} M changed/s, "
        f"xxh3-128 {new.nbytes / t_hash / 1e9:.1f} GB/s"
    )


def codec_scan(threads: list[int], density: float = 0.03, numel: int = 1 << 22, groups: int = 0, reps: int = 5) -> str:
    """The codec alone across threads: ``groups`` format-2 groups of ``numel`` bf16 elements (distinct
    arrays, 3% changed), each of diff, encode, decode+apply and xxh3-128 run over all of them on the
    product's pool (``parallel_map``) of 1, 2, ... threads; medians of ``reps``, speedups against 1 thread.
    What the issue's ">= 10x from 1 to 16 threads" is about: the kernels release the GIL, so this
    follows the cores (and memory bandwidth), not one interpreter."""
    import numpy as np

    from deltasync._util.cpus import parallel_map
    from deltasync.protocol.digests import xxh3_128_array
    from deltasync.protocol.encoding import decode_positions, decode_values, encode_changes
    from deltasync.protocol.kernels import impl
    from deltasync.uploader._diff import diff_tensor

    groups = groups or max(4 * max(threads), 16)
    k = impl()
    rng = np.random.default_rng(0)
    bases, news = [], []
    for _ in range(groups):
        base = rng.integers(-(2**15), 2**15, numel, dtype=np.int16)
        new = base.copy()
        pos = rng.choice(numel, int(numel * density), replace=False)
        new[pos] += rng.choice(np.array([-1, 1], dtype=np.int16), pos.size)
        bases.append(torch.from_numpy(base))
        news.append(torch.from_numpy(new))
    diffs = [diff_tensor(b, n) for b, n in zip(bases, news, strict=True)]
    assert all(d is not None for d in diffs)
    encs = [encode_changes(numel, d.idx, d.old, d.new) for d in diffs if d is not None]
    outs = [b.numpy().copy() for b in bases]
    undo = [np.empty(e.count, np.int16) for e in encs]
    items = list(range(groups))

    def diff(i: int) -> None:
        diff_tensor(bases[i], news[i])

    def enc(i: int) -> None:
        d = diffs[i]
        assert d is not None
        encode_changes(numel, d.idx, d.old, d.new)

    def dec(i: int) -> None:
        e, arr = encs[i], outs[i]
        idx = decode_positions(e.pos_blob, e.positions, e.rice_k, e.count, numel, "bench")
        vals = decode_values(e.val_blob, e.values, e.count, np.dtype(np.int16), "bench")
        if k is None:  # the numpy backend (holds the GIL in the scatter)
            arr[idx] = arr[idx] ^ vals if e.values == "xor-rank" else vals
        else:  # the compiled apply the fetcher uses, keeping the old values for its undo log
            (k.xor_apply if e.values == "xor-rank" else k.set_apply)(arr, idx, vals, undo[i])

    def hsh(i: int) -> None:
        xxh3_128_array(news[i].numpy())

    stages = {"diff": diff, "encode": enc, "decode+apply": dec, "xxh3-128": hsh}
    times: dict[str, list[float]] = {k: [] for k in stages}
    for t in threads:
        for name, fn in stages.items():
            parallel_map(fn, items, threads=t)  # warm (compiles, faults the pages in)
            runs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                parallel_map(fn, items, threads=t)
                runs.append(time.perf_counter() - t0)
            times[name].append(statistics.median(runs))
    mb = groups * numel * 2 / 1e6
    lines = [
        f"codec across threads: {groups} groups of {numel:,} bf16 elements ({mb:.0f} MB), {density:.0%} changed, "
        f"medians of {reps}; speedup against 1 thread",
        "",
        "| stage | " + " | ".join(f"{t} thr" for t in threads) + " |",
        "|---|" + "---:|" * len(threads),
    ]
    for name, ts in times.items():
        lines.append(f"| {name} | " + " | ".join(f"{mb / x / 1e3:.2f} GB/s ({ts[0] / x:.2f}x)" for x in ts) + " |")
    return "\n".join(lines)


def fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s")


def fmt_b(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | device | tensors | elements | changed | push | commit | sync host | sync cuda | node build "
        "| bytes | manifest / tensor | full copy | commit / copy | sync / copy |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        sync = r["sync_cuda"] if r["sync_cuda"] is not None else r["sync_host"]
        lines.append(
            f"| {r['label']} | {r['device']} | {r['tensors']:,} | {r['numel'] / 1e6:.0f}M | {r['density']:.0%} "
            f"| {fmt_s(r['push'])} | {fmt_s(r['commit'])} | {fmt_s(r['sync_host'])} | {fmt_s(r['sync_cuda'])} "
            f"| {fmt_s(r['node'])} | {fmt_b(r['bytes'])} | {r['manifest']:.0f} B | {fmt_s(r['copy'])} "
            f"| {r['commit'] / r['copy']:.0f}x | {sync / r['copy']:.0f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each tensor's first dimension")
    ap.add_argument("--density", default="0.01,0.03,0.1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    ap.add_argument("--device", default="both", choices=("cpu", "cuda", "both"))
    ap.add_argument("--format", type=int, default=2, choices=(1, 2))
    ap.add_argument("--per-tensor", type=float, default=0, metavar="ELEMENTS", help="e.g. 200e6")
    ap.add_argument("--thread-scan", default="", help="thread counts, e.g. 1,2,4,8,16 (first model, 3%%)")
    ap.add_argument("--no-node", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="--per-tensor: run the pair this many times")
    ap.add_argument("--rates", action="store_true", help="one core's diff/encode/decode/hash rates, then exit")
    ap.add_argument("--codec-scan", default="", help="thread counts, e.g. 1,2,4,8,16: the codec alone, then exit")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    devices = [d for d in (["cpu", "cuda"] if args.device == "both" else [args.device]) if d == "cpu" or has_cuda]
    out: list[str] = [
        f"Machine: {os.uname().machine}, {usable_cpus()} usable CPUs, "
        f"{torch.cuda.get_device_name() if has_cuda else 'no GPU'}; torch {torch.__version__}; "
        f"format {args.format}; scale {args.scale}; threads {args.threads or usable_cpus()}",
        "",
    ]
    if args.codec_scan:
        out.append(codec_scan([int(x) for x in args.codec_scan.split(",")]))
        print("\n".join(out))
        return
    if args.rates:
        for d in [float(x) for x in args.density.split(",")]:
            out.append(per_core_rates(d))
        print("\n".join(out))
        return
    if args.per_tensor:
        ratios: dict[str, list[float]] = {"commit": [], "sync_host": []}
        for _ in range(max(1, args.repeat)):
            rows = []
            for label, shapes in per_tensor_pair(int(args.per_tensor)).items():
                rows.append(run_one(label, list(shapes), 0.03, args, threads=args.threads, node=not args.no_node))
            out += [table(rows), ""]
            a, b = rows
            for k in ratios:
                ratios[k].append(b[k] / a[k])
            out.append(
                f"per-tensor ratio (18,432 / 288 tensors, same elements): commit {b['commit'] / a['commit']:.2f}x, "
                f"sync {b['sync_host'] / a['sync_host']:.2f}x, manifest per step {b['manifest'] * b['tensors']:.0f} B vs "
                f"{a['manifest'] * a['tensors']:.0f} B ({b['manifest']:.0f} B per tensor)"
            )
            out.append("")
        if len(ratios["commit"]) > 1:
            out.append(
                f"over {len(ratios['commit'])} pairs: commit {statistics.median(ratios['commit']):.2f}x "
                f"({min(ratios['commit']):.2f}-{max(ratios['commit']):.2f}x), sync "
                f"{statistics.median(ratios['sync_host']):.2f}x "
                f"({min(ratios['sync_host']):.2f}-{max(ratios['sync_host']):.2f}x), medians (ranges)"
            )
            out.append("")
    models = [m for m in args.model.split(",") if m]
    if args.thread_scan:
        rows = []
        for t in [int(x) for x in args.thread_scan.split(",")]:
            rows.append(
                run_one(
                    f"{models[0]} x{args.scale}, {t} threads",
                    scaled(MODELS[models[0]](), args.scale),
                    0.03,
                    args,
                    threads=t,
                    node=False,
                )
            )
        out += [table(rows), ""]
        base = rows[0]
        for r in rows[1:]:
            out.append(
                f"{r['label']}: commit {base['commit'] / r['commit']:.2f}x, sync {base['sync_host'] / r['sync_host']:.2f}x "
                "faster than 1 thread"
            )
        out.append("")
    elif not args.per_tensor:
        rows = []
        for model in models:
            model_shapes = scaled(MODELS[model](), args.scale)
            for device in devices:
                for d in [float(x) for x in args.density.split(",")]:
                    rows.append(
                        run_one(
                            f"{model} x{args.scale}",
                            model_shapes,
                            d,
                            args,
                            device=device,
                            threads=args.threads,
                            node=not args.no_node,
                        )
                    )
                    print(table(rows[-1:]), flush=True)
        out += [table(rows), ""]
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
