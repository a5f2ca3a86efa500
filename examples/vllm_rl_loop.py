"""Keep a running ``vllm serve`` at the trainer's newest step while it keeps generating.

Three processes, anywhere that can reach the store:

1. The trainer pushes every step (``hf://buckets/...``, ``s3://...`` or a shared path)::

       with ds.DeltaUploader(ds.open_store("hf://buckets/me/run-1"),
                             signal_url="https://signal.example", signal_token=PUBLISH) as up:
           for step in range(n):
               train_step()
               up.push(model.state_dict(), step)

2. The engine, started from a checkpoint dir of one of the run's steps, with deltasync installed
   in its environment (the plugin registers the backend)::

       deltasync fetch --store hf://buckets/me/run-1 --out model/ --config-from BASE_MODEL_DIR
       VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model model/ \\
           --weight-transfer-config '{"backend": "deltasync"}'

3. This loop: it asks every worker to prepare new steps in the background (``prefetch``), and at
   each committed step pauses generation (``/pause?mode=wait``: requests in flight finish on the
   weights they started with, new ones wait), runs the four phases and resumes; generation
   requests are sent the whole time::

       python examples/vllm_rl_loop.py --vllm http://127.0.0.1:8000 --store hf://buckets/me/run-1 \\
           [--signal https://signal.example --token SUBSCRIBE] [--until-step N]

So every completion comes from one step, and none after an update from KV of an older one:
deltasync's plugin drops the engine's prefix cache inside ``/update_weights`` (see
``deltasync.integrations.vllm.engine_core``), however long the prompts. A failed update (HTTP 500)
leaves the engine serving its previous step, bit-exact; the loop logs it, resumes and moves on to the
next step. Prints a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import httpx

import deltasync as ds


def generate_forever(base: str, model: str, stop: threading.Event, served: list[int]) -> None:
    """Stand-in for the RL rollout workers: greedy completions, back to back."""
    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            try:
                r = client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": "the quick brown", "max_tokens": 8, "temperature": 0},
                )
                r.raise_for_status()
                served[0] += 1
            except httpx.HTTPError as exc:
                print(f"generation: {exc}")
                stop.wait(0.5)


def committed_steps(args: argparse.Namespace, stop: threading.Event) -> Any:
    """Each newly committed step: from the signal server's stream when given (reconnecting with
    backoff), polling the store meanwhile, or only polling the store (deltasync's StepWatcher)."""
    from deltasync.signal import StepWatcher

    reader = ds.RunReader(ds.open_store(args.store))
    run = (args.run or reader.run_id()) if args.signal else None
    watcher = StepWatcher(
        reader.latest_step,
        signal_url=args.signal,
        token=args.token,
        run=run,
        heartbeat=2.0,
        poll_interval=args.poll,
        stop=stop,
    )
    try:
        for seen in watcher.watch():
            if seen.step is not None:
                yield seen.step
    finally:
        watcher.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="keep a vllm serve engine at the trainer's newest step")
    ap.add_argument("--vllm", default="http://127.0.0.1:8000", help="the engine's base URL (VLLM_SERVER_DEV_MODE=1)")
    ap.add_argument("--store", required=True, help="the run's store URL")
    ap.add_argument("--signal", help="signal server URL (else the store is polled)")
    ap.add_argument("--token", help="signal server subscribe token")
    ap.add_argument("--run", help="run name on the signal server (default: the store's run id)")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between store polls without --signal")
    ap.add_argument("--until-step", type=int, help="stop once the engine serves this step")
    ap.add_argument("--no-generate", action="store_true", help="do not send generation requests")
    args = ap.parse_args()

    engine = httpx.Client(base_url=args.vllm, timeout=600)
    model = engine.get("/v1/models").json()["data"][0]["id"]
    # every worker follows the store and prepares new steps while the engine serves
    engine.post(
        "/init_weight_transfer_engine", json={"init_info": {"store": args.store, "prefetch": True}}
    ).raise_for_status()

    stop = threading.Event()
    served = [0]
    gen = threading.Thread(target=generate_forever, args=(args.vllm, model, stop, served), daemon=True)
    if not args.no_generate:
        gen.start()
    current: int | None = None
    updates: list[dict[str, Any]] = []
    try:
        for step in committed_steps(args, stop):
            if current is not None and step <= current:
                continue
            before = served[0]
            t0 = time.perf_counter()
            # no completion mixes two steps: requests in flight finish first, new ones wait for /resume
            engine.post("/pause", params={"mode": "wait"}).raise_for_status()
            try:
                engine.post("/start_weight_update").raise_for_status()
                r = engine.post("/update_weights", json={"update_info": {"step": step}})
                if r.status_code != 200:
                    # the update failed on every worker together: the engine still serves `current`
                    # (vLLM has already closed the update: no finish_weight_update)
                    print(f"step {step} not applied, still serving step {current}: {r.text[:300]}")
                    updates.append({"step": step, "ok": False})
                    continue
                engine.post("/finish_weight_update", json={"weight_version": str(step)}).raise_for_status()
            finally:
                engine.post("/resume").raise_for_status()
            pause = time.perf_counter() - t0
            current = step
            version = engine.get("/weight_info").json()["weight_version"]
            print(
                f"serving step {version}: pause {pause * 1000:.0f} ms, {served[0] - before} completions since the last update"
            )
            updates.append({"step": step, "ok": True, "pause_s": pause, "version": version})
            if args.until_step is not None and current >= args.until_step:
                break
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
    print(json.dumps({"serving": current, "completions": served[0], "updates": updates}))


if __name__ == "__main__":
    main()
