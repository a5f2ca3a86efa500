"""One host copy and one download per node: a real vLLM engine at TP=1 and TP=2, side by side.

Run by hand from the repo root with the project's python (it builds or reuses the vLLM venv of the
tests, ``tests/vllm_harness.py``, and runs each engine there)::

    python benchmarks/bench_vllm_node.py [--shape wide|qwen3-0.6b] [--updates 8] [--density 0.17]

A Qwen3-shaped model (random init, the tests' 1024-token vocabulary) gets ``--updates`` updates that
each change ``--density`` of every tensor's elements (17% is what AdamW at lr 1e-5 does to bf16
weights), pushed to a local store. One engine per TP degree follows it through the ``"deltasync"``
weight-transfer backend, each update prepared in the background first (``deltasync_prepare``) so
that the update's time is the engine's pause. Printed per TP degree, with TP=2 / TP=1 ratios:

- host memory deltasync adds at init and in steady state (median of the last 4 updates): the engine
  processes' PSS outside the node mirror's files (the node's leader counted), plus those files once;
- the engine processes' RSS and PSS, and the node mirror's files;
- bytes read from the store per update (the workers' download counters, summed over ranks);
- the pause per update (median) and vLLM's own ``reload_weights`` of the last step's checkpoint dir
  (median of 3, page cache warm), and their ratio.

On CPU, in-place loading needs the TEST-ONLY patch in ``tests/vllm_support/sitecustomize.py``, which
the harness applies as in the tests.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _shape(name: str) -> dict[str, Any]:
    """The layers of ``bench_vllm_pause``'s shape ``name`` (the vocabulary stays the tests' tokenizer's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_vllm_pause import SHAPES

    return {k: v for k, v in SHAPES[name].items() if k != "vocab_size"}


def _push(model: Path, store: Path, updates: int, density: float) -> list[int]:
    from vllm_harness import perturbed_steps

    import deltasync as ds

    sizes = []
    with ds.DeltaUploader(store, anchor_every=1000, anchor_bytes_fraction=0) as up:
        for s, state in enumerate(perturbed_steps(model, updates, density)):
            sizes.append(up.push(state, s).result().nbytes)
            print(f"  pushed step {s}: {sizes[-1] / 2**20:.1f} MiB", flush=True)
    return sizes


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    from vllm_harness import (
        NODE_SCRIPT,
        WIDE_MODEL_KW,
        build_tiny_model,
        build_vllm_venv,
        install_checkout,
        run_vllm,
        venv_dir,
    )

    import deltasync as ds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["wide", "small", "qwen3-0.6b"], default="wide")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.17)
    args = ap.parse_args()
    python = build_vllm_venv(venv_dir())
    install_checkout(python)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-node-"))
    print(f"building {args.shape}, {args.updates} updates at density {args.density} in {work}", flush=True)
    model = build_tiny_model(work / "model", **(WIDE_MODEL_KW if args.shape == "wide" else _shape(args.shape)))
    sizes = _push(model, work / "store", args.updates, args.density)
    last = work / "last"
    ds.DeltaFetcher(work / "store").materialize(last, args.updates, config_from=model)
    rows: dict[int, dict[str, float]] = {}
    for tp in (1, 2):
        params = {
            "model": str(model),
            "store": (work / "store").as_uri(),
            "tp": tp,
            "node_dir": str(work / f"node-tp{tp}"),
            "updates": args.updates,
            "reload_dir": str(last),
        }
        rep = run_vllm(python, NODE_SCRIPT, params, work / "scripts", tp=tp, timeout=3600)
        before = rep["before"]

        def added(m: dict[str, int], before: dict[str, int] = before, leader: bool = True) -> float:
            # anonymous memory plus the node's files once (not PSS, which moves as other processes map
            # the same libraries; not USS, whose clean file pages the kernel drops under memory pressure);
            # at init without the leader, measured somewhere in its start-up
            key = "pss_anon" if m["pss_anon"] >= 0 and before["pss_anon"] >= 0 else "anon"
            return m[key] - before[key] + m["node"] - (0 if leader else m[f"leader_{key}"])

        tail = rep["steps"][-4:]
        read = sum(
            int(x) for t in rep["metrics"] for x in re.findall(r"^deltasync_downloaded_bytes_total\S* (\d+)", t, re.M)
        )
        rows[tp] = {
            "added at init": added(rep["after_init"], leader=False),
            "added, steady": statistics.median(added(m) for m in tail),
            "engine RSS, steady": statistics.median(m["rss"] for m in tail),
            "engine PSS, steady": statistics.median(m["pss"] for m in tail),
            "node mirror files": statistics.median(m["node"] for m in tail),
            "store bytes per update": read / args.updates,
            "pause per update (s)": statistics.median(rep["pause"]),
            "reload_weights (s)": rep["reload"],
        }
        rows[tp]["pause / reload"] = rows[tp]["pause per update (s)"] / rows[tp]["reload_weights (s)"]
    print(
        f"\n{args.shape}: {args.updates} updates at {args.density:.0%} density; patch median {_mib(statistics.median(sizes[1:]))}"
    )
    print(f"{'':32} {'TP=1':>12} {'TP=2':>12} {'TP=2/TP=1':>10}")
    for key in rows[1]:
        a, b = rows[1][key], rows[2][key]
        fmt = (lambda v: f"{v:.3f}") if "(s)" in key or "/" in key else _mib
        print(f"{key:32} {fmt(a):>12} {fmt(b):>12} {b / a if a else float('nan'):>9.2f}x")


if __name__ == "__main__":
    main()
