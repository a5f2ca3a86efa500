"""Per-tensor cost of an engine update: the loader's full copy vs scattering only the changed elements.

Plain torch, no vLLM: for each tensor shape of a model (Qwen3-0.6B by default, bf16), a host tensor
(the mirror) and a parameter on ``--device``, it times

- ``copy``: ``param.copy_(host)``, what ``load_weights`` does with each tensor it is handed;
- ``scatter``: :func:`deltasync.serving.engine.scatter.scatter` of the changed elements (their
  positions and values, as a decoded patch gives them): positions cross to the device as int32,
  parameter indices are computed there, one ``index_copy_``;
- ``scatter+gather``: the same, gathering the values from the host tensor first (a caller that has
  only the positions),

at each ``--densities`` (uniformly random changed elements, as RL steps at small learning rates
give). With ``--tp 2`` the parameter is rank 0's shard (rows of column-parallel weights, columns
of row-parallel ones, as vLLM splits Qwen3), through the same maps ``ScatterMap`` builds. Prints
the whole model's time (sum over tensors, medians of ``--repeat`` runs) and the ratios::

    python benchmarks/bench_scatter.py --device cpu
    python benchmarks/bench_scatter.py --device cuda --densities 0.01 0.05 0.17 0.3 0.5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deltasync.serving.engine.scatter import Segment, scatter

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, head dim, vocab)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "small": (512, 1536, 8, 8, 4, 64, 32000),
}


def tensors(shape: str) -> list[tuple[str, tuple[int, ...], int, str]]:
    """``(kind, checkpoint shape, count, split)`` of a Qwen3 model; split: how TP divides it."""
    h, inter, layers, heads, kv, hd, vocab = SHAPES[shape]
    return [
        ("embed_tokens", (vocab, h), 1, "rows"),
        ("q_proj", (heads * hd, h), layers, "rows"),
        ("k_proj", (kv * hd, h), layers, "rows"),
        ("v_proj", (kv * hd, h), layers, "rows"),
        ("o_proj", (h, heads * hd), layers, "cols"),
        ("gate_proj", (inter, h), layers, "rows"),
        ("up_proj", (inter, h), layers, "rows"),
        ("down_proj", (h, inter), layers, "cols"),
        ("norms", (h,), 2 * layers + 1, "none"),
        ("qk_norms", (hd,), 2 * layers, "none"),
    ]


def segment(param: torch.Tensor, shape: tuple[int, ...], split: str, tp: int) -> Segment:
    """Rank 0's copy of a checkpoint tensor of ``shape`` into ``param`` (as vLLM's loaders narrow it)."""
    contiguous = torch.empty(shape, device="meta").stride()
    view = list(shape)
    if tp > 1 and split == "rows":
        view[0] //= tp
    elif tp > 1 and split == "cols":
        view[1] //= tp
    dst = torch.empty(view, device="meta").stride()
    return Segment(param, tuple(view), 0, tuple(contiguous), 0, tuple(dst))


def timed(fn: Callable[[], object], sync: Callable[[], None], repeat: int) -> float:
    fn()
    sync()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.17, 0.3])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pin", action="store_true", help="pin the host tensors (as a mirror in pinned memory would be)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync: Callable[[], None] = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    # every tensor of the model, distinct (a whole-model pass does not run from the CPU's caches)
    model: list[tuple[str, torch.Tensor, Segment]] = []
    for kind, shape, count, split in tensors(args.shape):
        for _ in range(count):
            host = torch.randn(shape, generator=g).to(torch.bfloat16)
            if args.pin and dev.type == "cuda":
                host = host.pin_memory()
            view = segment(torch.empty(0), shape, split, args.tp)
            param = torch.zeros(view.shape, dtype=torch.bfloat16, device=dev)
            model.append((kind, host, Segment(param, view.shape, 0, view.src_strides, 0, view.dst_strides)))
    numel = sum(h.numel() for _, h, _ in model)
    print(f"{args.shape}: {len(model)} tensors, {numel / 1e6:.1f} M elements, bf16", flush=True)

    def copy_all() -> None:
        for _, host, seg in model:
            seg.dst_view().copy_(seg.src_view(host))

    rows = []
    for d in args.densities:
        changes = []
        for _, host, _ in model:
            flat = host.view(-1)
            pos = (torch.rand(flat.numel(), generator=g) < d).nonzero().view(-1)
            changes.append((flat, pos, flat.index_select(0, pos)))

        def scatter_all(changes: list[tuple[torch.Tensor, ...]] = changes) -> None:
            for (_, _, seg), (_, pos, values) in zip(model, changes, strict=True):
                scatter(seg, pos, values)

        def gather_scatter_all(changes: list[tuple[torch.Tensor, ...]] = changes) -> None:
            for (_, _, seg), (flat, pos, _) in zip(model, changes, strict=True):
                scatter(seg, pos, flat.index_select(0, pos))

        # timed next to each other: a shared machine's load moves both alike
        t_copy = timed(copy_all, sync, args.repeat)
        t_sc = timed(scatter_all, sync, args.repeat)
        t_sg = timed(gather_scatter_all, sync, args.repeat)
        copy_all()
        for _, _, seg in model:
            seg.param.zero_()
        scatter_all()
        wrong = []
        for (kind, host, seg), (_, pos, _) in zip(model, changes, strict=True):
            mask = _changed(host, seg, pos)
            got, want = seg.dst_view().cpu().reshape(-1), seg.src_view(host).reshape(-1)
            if not torch.equal(got[mask], want[mask]) or bool(got[~mask].any()):
                wrong.append(kind)
        if wrong:
            raise SystemExit(f"the scatter did not write the changed elements of {wrong[:3]}")
        del changes
        rows.append({"density": d, "copy_s": t_copy, "scatter_s": t_sc, "gather_scatter_s": t_sg})
        print(
            f"  density {d}: copy {t_copy * 1e3:.1f} ms, scatter {t_sc * 1e3:.1f} ms, "
            f"gather+scatter {t_sg * 1e3:.1f} ms",
            flush=True,
        )
    print()
    print(
        f"{args.shape}, bf16, TP={args.tp} (rank 0's shards), device {dev}, {torch.get_num_threads()} CPU threads; "
        f"whole model, medians of {args.repeat}"
    )
    print(f"{'density':>8}{'copy ms':>10}{'scatter ms':>12}{'ratio':>7}{'+gather ms':>12}{'ratio':>7}")
    for r in rows:
        print(
            f"{r['density']:>8.2f}{r['copy_s'] * 1e3:>10.1f}{r['scatter_s'] * 1e3:>12.1f}"
            f"{r['scatter_s'] / r['copy_s']:>7.2f}{r['gather_scatter_s'] * 1e3:>12.1f}"
            f"{r['gather_scatter_s'] / r['copy_s']:>7.2f}"
        )
    if args.out:
        out = {"rows": rows, "device": str(dev), "tp": args.tp, "shape": args.shape, "threads": torch.get_num_threads()}
        Path(args.out).write_text(json.dumps(out, indent=1))


def _changed(host: torch.Tensor, seg: Segment, pos: torch.Tensor) -> torch.Tensor:
    """Mask, over the segment's view (row-major), of the changed positions it covers."""
    mask = torch.zeros(host.numel(), dtype=torch.bool)
    mask[pos] = True
    return mask.as_strided(seg.shape, seg.src_strides, seg.src_offset).reshape(-1)


if __name__ == "__main__":
    main()
