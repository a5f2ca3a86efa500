"""Prepare while serving: how soon a real vLLM engine has each newly committed step prepared, and what
waiting for it by polling the workers costs. Side by side in one run, same machine, same engine.

Run by hand from the repo root with the project's python (it builds or reuses the vLLM venv of the
tests, ``tests/vllm_harness.py``)::

    python benchmarks/bench_vllm_prepare.py [--tp 2] [--steps 5] [--poll-interval 2.0]

The tests' tiny Qwen3 is trained for ``--steps`` real AdamW steps; one engine (``"prefetch": True``)
starts on step 0 and the script commits each later step into a live store while the engine serves,
then waits until every worker reports the step prepared, in one of two ways, one engine each:

- ``files``: reading the files the workers write when a prepare settles (what the engine core's
  bounded wait of ``deltasync_prepare`` does): nothing asks the workers;
- ``rpc``: calling ``deltasync_status`` through ``collective_rpc`` every 0.2 s (what the issue's
  waiting side did): vLLM's CPU workers spin on their message queue for a second after each call.

Printed per step and mode: seconds from the commit to every worker prepared, the workers' own
prepare latency (from the commit first heard of) and whether a prepare was reported as starved, and
the pause of the update that follows (prepared: it only commits).

Measured 2026-11-27 on the 2-core CI machine (AMD EPYC), TP=2, poll interval 2 s: ``files``: step 1
prepared 6.1 s after its commit (the node's leader still compiling at init; the numba cache is
shared with another venv here), steps 2-5 1.9-2.0 s (one poll interval; the workers' prepare 13-42
ms once heard of), pauses 10-13 ms; ``rpc``: step 1 not prepared within 120 s (reported starved:
54 s for 1.75 CPU s of build, 119 s after heard of), its pause did the build (0.75 s), steps 2-5
prepared 0.21-0.40 s after heard of (10x the ``files`` mode's). Again with ``--steps 4``: ``files``
6.82 s, then 1.21, 2.12, 1.82 s, pauses 9.8-14.7 ms; ``rpc``: step 1 not within 120 s (starved), its
pause 1235 ms, then 2.42, 0.40, 2.83 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SCRIPT = """
import glob, json, time
import engine_checks as ec

def reports(node_dir):
    out = []
    for f in sorted(glob.glob(node_dir + "/*/prepared/*.json")):
        try:
            out.append(json.load(open(f)))
        except ValueError:
            pass
    return out

def check(p):
    import sys
    from pathlib import Path
    sys.path.insert(0, p["tests"])
    from vllm_harness import publish_step
    src, live, tp, node_dir = Path(p["src"]), Path(p["live"]), p["tp"], p["node_dir"]
    publish_step(src, live, 0)
    llm = ec.make_llm(p["model"], tp=tp, weight_transfer_config={"backend": "deltasync"})
    init = {"store": live.as_uri(), "prefetch": True, "poll_interval": p["poll"], "node_dir": node_dir}
    llm.init_weight_transfer_engine({"init_info": init})
    steps = []
    for step in range(1, p["steps"] + 1):
        publish_step(src, live, step)
        t0, ready = time.monotonic(), None
        while time.monotonic() - t0 < 120:
            if p["mode"] == "rpc":
                done = all(s["prepared"] == step for s in llm.collective_rpc("deltasync_status"))
                pause = 0.2
            else:
                docs = reports(node_dir)
                done = len(docs) == tp and all(d.get("prepared") == step for d in docs)
                pause = 0.05
            if done:
                ready = time.monotonic() - t0
                break
            time.sleep(pause)
        t1 = time.monotonic()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step}})
        llm.finish_weight_update(weight_version=str(step))
        pause_s = time.monotonic() - t1
        seen = [(d.get("latency_s"), d.get("starved")) for d in reports(node_dir)]
        steps.append({"step": step, "ready_s": ready, "pause_s": pause_s, "workers": seen})
    return {"steps": steps}

if __name__ == "__main__":
    ec.main(check)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--poll-interval", type=float, default=2.0)
    args = ap.parse_args()

    from vllm_harness import (
        build_tiny_model,
        build_vllm_venv,
        checkpoint_dir,
        install_checkout,
        run_vllm,
        train_and_push,
        venv_dir,
    )

    python = build_vllm_venv(venv_dir())
    install_checkout(python)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        run = train_and_push(model, root / "store", root / "expected", steps=args.steps + 1)
        ckpt = checkpoint_dir(run, 0, root / "ckpt-0")
        for mode in ("files", "rpc"):
            params = {
                "src": run.store_dir,
                "live": root / f"live-{mode}",
                "model": ckpt,
                "tp": args.tp,
                "mode": mode,
                "poll": args.poll_interval,
                "steps": args.steps,
                "node_dir": root / f"node-{mode}",
                "tests": ROOT / "tests",
            }
            out = run_vllm(python, SCRIPT, params, root / "scripts", tp=args.tp, multiprocessing=True, timeout=900)
            print(f"TP={args.tp}, waiting by {mode}:")
            for s in out["steps"]:
                ready = "not within 120 s" if s["ready_s"] is None else f"{s['ready_s']:.2f} s"
                print(f"  step {s['step']}: prepared {ready} after its commit, pause {s['pause_s'] * 1e3:.1f} ms,")
                print(f"    workers (latency from heard of, starved): {json.dumps(s['workers'])}")


if __name__ == "__main__":
    main()
