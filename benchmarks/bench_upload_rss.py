#!/usr/bin/env python
"""Peak RSS and cache disk use of ``delta-upload`` (separate processes, as a user runs it).

Run by hand, from the repository root (about 1 GB of disk in a temp dir)::

    .venv/bin/python benchmarks/bench_upload_rss.py                  # this checkout
    .venv/bin/python benchmarks/bench_upload_rss.py --code /other/checkout --code .   # side by side

A bf16 state of ``--mb`` MB (20 tensors) is pushed as four steps to a local store, each in a
fresh ``delta-upload`` process (``PYTHONPATH`` = each ``--code`` dir):

0. the anchor;
1. a patch with a valid baseline cache;
2. a patch after the cache was deleted (the baseline comes from the store);
3. a patch with a stale cache (the cache holds another state under the right step).

Per push: the child's peak resident set (``ru_maxrss`` from ``wait4``, = its VmHWM), the
median of ``--repeat`` runs, and the size of the cache dir afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("anchor", "patch, cache valid", "patch, no cache", "patch, stale cache")


def make_checkpoints(root: Path, mb: int) -> list[Path]:
    import torch

    from deltasync._util.checkpoint_io import save_checkpoint

    g = torch.Generator().manual_seed(0)
    n = max(1, mb * 1_000_000 // 2 // 20 // 4096)
    state = {f"layer{i:02d}.w": torch.randn(n, 4096, generator=g).to(torch.bfloat16) for i in range(20)}
    out = []
    for step in range(4):
        for k in list(state)[::3]:
            state[k].view(-1)[step * 1000 : step * 1000 + 5000] += 1
        out.append(save_checkpoint(state, root / f"c{step}" / "model.safetensors"))
    return out


def peak_rss_mb(code: Path, args: list[str], cwd: Path) -> float:
    """Run delta-upload from ``code`` in a child; its own peak RSS in MB (``wait4``'s rusage)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-c", "import sys; from deltasync.cli import upload_main; sys.exit(upload_main())"]
    proc = subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"delta-upload failed: {err.decode(errors='replace')}")
    return usage.ru_maxrss / 1024


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6 if path.exists() else 0.0


def run_code(code: Path, ckpts: list[Path], work: Path) -> list[tuple[float, float]]:
    """(peak RSS MB, cache MB) per case, for one checkout."""
    store, cache = work / "store", work / "cache"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    out = []
    for step, ckpt in enumerate(ckpts):
        if step == 2:
            for p in cache.glob("state.*"):
                p.unlink()
        if step == 3:
            shutil.copyfile(ckpts[0], cache / "state.safetensors")
        rss = peak_rss_mb(code, [str(ckpt), "--store", str(store), "--step", str(step), "--cache", str(cache)], work)
        out.append((rss, dir_mb(cache)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", type=Path, help="checkout(s) to measure (default: this one)")
    p.add_argument("--mb", type=int, default=430, help="state size in MB (default 430)")
    p.add_argument("--repeat", type=int, default=1, help="runs per checkout (median)")
    args = p.parse_args()
    codes = args.code or [Path(__file__).resolve().parent.parent]
    with tempfile.TemporaryDirectory(prefix="bench-upload-rss-") as tmp:
        root = Path(tmp)
        ckpts = make_checkpoints(root, args.mb)
        size = ckpts[0].stat().st_size / 1e6
        results = {}
        for code in codes:
            runs = [run_code(code, ckpts, root) for _ in range(args.repeat)]
            results[code] = [
                (statistics.median(r[i][0] for r in runs), statistics.median(r[i][1] for r in runs))
                for i in range(len(CASES))
            ]
    print(f"state: {size:.0f} MB bf16; peak RSS (MB) / cache dir after (MB), median of {args.repeat}")
    print("| push | " + " | ".join(str(c) for c in codes) + " |")
    print("|---|" + "---|" * len(codes))
    for i, case in enumerate(CASES):
        cells = [f"{results[c][i][0]:.0f} ({results[c][i][0] / size:.2f}x) / {results[c][i][1]:.0f}" for c in codes]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
