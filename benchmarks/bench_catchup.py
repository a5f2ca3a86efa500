#!/usr/bin/env python
"""Catch-up of a replica k steps behind: spans + folding vs patches only vs the anchor route.

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_catchup.py                     # ~15M params, 210 steps, lr 1e-5
    .venv/bin/python benchmarks/bench_catchup.py --behind 10,50,200 --levels "4,16,64;8,64;16" --out r.md

What it does:

1. trains a small Qwen3-architecture model (random init, nothing downloaded; fp32 master weights,
   real ``torch.optim.AdamW`` on random token batches, the stream of ``bench_payload.py``) for
   ``steps`` optimizer steps and pushes the bf16 view of every step through one ``DeltaUploader``
   per configuration, all fed the same states: ``span_levels=()`` (no spans) and each of
   ``--levels``, each with ``anchor_every`` = ``--anchor-every`` (large: one anchor, so 200 behind
   stays within one anchor interval) and again with the default anchor policy
   (``anchor_every=50``, ``anchor_bytes_fraction=0.5``) for the first span configuration;
2. reports what each writer uploaded: patch bytes, span bytes and their ratio;
3. for each k in ``--behind``: a replica holding step ``last - k`` (proven by digests, untimed)
   syncs to ``last`` with ``DeltaFetcher(spans=True, fold=True)`` (default), with
   ``DeltaFetcher(spans=False, fold=False)`` (patches only, the behaviour before spans), and a
   fresh replica loads the anchor route (default fetcher, holding nothing). Bytes downloaded and
   sync time (``SyncStats``), medians of ``--reps`` runs; every result is checked bit-exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_payload as bp  # noqa: E402

import deltasync as ds  # noqa: E402


@dataclass
class Row:
    config: str
    behind: int
    route: str
    nbytes: int
    seconds: float
    elements: int
    spans: int


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: bp._bits(v).numpy().tobytes() for k, v in state.items()}


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1152)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--steps", type=int, default=210)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--behind", default="10,50,200")
    p.add_argument("--levels", default="4,16,64;8,64;4,16;16", help="span level sets, ';'-separated")
    p.add_argument("--anchor-every", type=int, default=100000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = bp.BenchConfig(
        hidden=a.hidden,
        layers=a.layers,
        intermediate=a.intermediate,
        vocab=a.vocab,
        heads=6,
        kv_heads=2,
        head_dim=64,
        lrs=(a.lr,),
    )
    level_sets = [tuple(int(x) for x in s.split(",")) for s in a.levels.split(";") if s]
    behind = [int(x) for x in a.behind.split(",")]
    root = Path(tempfile.mkdtemp(prefix="deltasync-catchup-"))
    configs: dict[str, dict[str, Any]] = {"no spans": dict(span_levels=(), anchor_every=a.anchor_every)}
    for lv in level_sets:
        configs[f"spans {lv}"] = dict(span_levels=lv, anchor_every=a.anchor_every)
    configs[f"spans {level_sets[0]}, default anchors"] = dict(span_levels=level_sets[0])
    configs["no spans, default anchors"] = dict(span_levels=())
    stores = {name: ds.open_store(root / f"c{i}") for i, name in enumerate(configs)}
    uploaders = {
        name: ds.DeltaUploader(
            stores[name],
            on_backlog="block",
            **({"anchor_bytes_fraction": 0.0} if "anchor_every" in opts else {}),
            **opts,
        )
        for name, opts in configs.items()
    }
    model = bp.build_model(cfg)
    params = sum(x.numel() for x in model.parameters())
    opt = bp.make_optimizer(model, cfg, a.lr)
    gen = torch.Generator().manual_seed(1)
    keep = {a.steps - k for k in behind} | {a.steps}
    states: dict[int, dict[str, torch.Tensor]] = {}
    print(f"model: {params / 1e6:.1f}M params; training {a.steps} steps at lr {a.lr}", flush=True)
    t0 = time.perf_counter()
    for step in range(a.steps + 1):
        if step:
            x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = bp.bf16_view(model)
        for up in uploaders.values():
            up.push(state, step)
        if step in keep:
            states[step] = _clone(state)
        if step % 50 == 0:
            print(f"  step {step} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for up in uploaders.values():
        up.close()
    last = a.steps
    want = _bits(states[last])

    lines = [
        "# Catch-up: spans + folding vs patches only vs anchor route\n",
        f"{params / 1e6:.1f}M-param Qwen3-architecture model, bf16 view of fp32 AdamW (lr {a.lr}), "
        f"{a.steps} steps, local store, {os.cpu_count()} CPUs, medians of {a.reps} runs.\n",
        "## Upload\n",
        "| writer | patches (MB) | spans (MB) | spans / patches | anchors (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, store in stores.items():
        objs = store.list("")
        size = {"steps": 0, "spans": 0, "anchor": 0}
        for o in objs:
            if o.key.startswith("spans/") and not o.key.endswith("manifest.json"):
                size["spans"] += o.size
            elif o.key.startswith("steps/") and "/patch-" in o.key:
                size["steps"] += o.size
            elif o.key.startswith("steps/") and "/model-" in o.key:
                size["anchor"] += o.size
        ratio = size["spans"] / size["steps"] if size["steps"] else 0.0
        lines.append(
            f"| {name} | {size['steps'] / 1e6:.1f} | {size['spans'] / 1e6:.1f} | {ratio:.2f} | {size['anchor'] / 1e6:.1f} |"
        )
    print("\n".join(lines), flush=True)

    rows: list[Row] = []
    for name, store in stores.items():
        for k in behind:
            start = last - k
            for route in ("spans+fold", "patches only", "anchor route"):
                sizes, times, elems, nspans = [], [], 0, 0
                for _ in range(a.reps):
                    compact = route != "patches only"
                    f = ds.DeltaFetcher(store, spans=compact, fold=compact)
                    if route == "anchor route":
                        replica = {k2: torch.zeros_like(v) for k2, v in states[last].items()}
                    else:
                        replica = _clone(states[start])
                        f.sync(replica, have_step=start, step=start)  # proven by digests, untimed
                    t = time.perf_counter()
                    assert f.sync(replica, step=last) == last
                    times.append(time.perf_counter() - t)
                    if _bits(replica) != want:
                        raise RuntimeError(f"{name} {route} {k} behind: not bit-exact")
                    st = f.last_stats
                    assert st is not None
                    sizes.append(st.nbytes)
                    elems, nspans = st.steps, st.spans
                rows.append(Row(name, k, route, int(statistics.median(sizes)), statistics.median(times), elems, nspans))
            print(f"  {name}, {k} behind: done", flush=True)

    lines += [
        "\n## Catch-up to the newest step\n",
        "| writer | behind | route | downloaded (MB) | vs patches only | sync (ms) | elements (spans) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = next(x for x in rows if x.config == r.config and x.behind == r.behind and x.route == "patches only")
        lines.append(
            f"| {r.config} | {r.behind} | {r.route} | {r.nbytes / 1e6:.2f} | {r.nbytes / base.nbytes:.2f} | "
            f"{r.seconds * 1e3:.0f} | {r.elements} ({r.spans}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
