#!/usr/bin/env python3
"""Measure the demo figures the README and the docs print, from the code; write or check them.

    python scripts/figures.py            # measure, write docs/demo-figures.md, list stale figures
    python scripts/figures.py --check    # measure and list stale figures only; exit 1 if any

One default ``deltasync demo`` run in lockstep with its store (``spaces_demo.figures.measure``: the
demo's own trainer, uploader and verifying fetcher; about a minute on 2 CPU cores). A printed figure
more than 10% off the measured one is listed as 'FILE: prints KEY = X, the code gives Y': edit that
sentence (``spaces_demo.figures.PRINTED`` lists every sentence that quotes a figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare the printed figures; write nothing")
    ap.add_argument("--steps", type=int, default=400, help="training steps (the demo's default: 400)")
    args = ap.parse_args()
    import torch

    from spaces_demo.figures import GENERATED, check_printed, figures_markdown, measure

    torch.set_num_threads(1)  # as the demo's trainer
    t0 = time.perf_counter()
    figures = measure(steps=args.steps)
    print(f"measured a {args.steps}-step demo run in {time.perf_counter() - t0:.0f} s")
    for key, value in figures.values().items():
        print(f"  {key} = {value:.4g}")
    if not args.check:
        (ROOT / GENERATED).write_text(figures_markdown(figures))
        print(f"wrote {GENERATED}")
    problems = check_printed(figures, ROOT)
    for line in problems:
        print(line)
    if not figures.bit_exact:
        print("the inference copy is NOT bit-exact with the trainer's")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
