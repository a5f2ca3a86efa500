#!/usr/bin/env python
"""Signal latency: N concurrent SSE subscribers, publish -> received, on loopback.

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_signal.py                       # 200 subscribers, 100 commits
    .venv/bin/python benchmarks/bench_signal.py --subscribers 50 --commits 20 --out signal.md

What it does:

1. starts ``deltasync serve`` (uvicorn, one worker, a temp SQLite file, tokens set) in a child
   process on a free 127.0.0.1 port;
2. in this process, opens ``--subscribers`` SSE streams (``GET /v1/runs/bench/events``) with one
   ``httpx.AsyncClient`` on one asyncio loop, and waits until the server's
   ``deltasync_sse_subscribers`` gauge counts them all;
3. publishes ``--commits`` commits one after another (``POST /v1/runs/bench/commits``); each
   latency sample is (time a subscriber parsed the event) - (time just before the POST was sent),
   both from ``time.perf_counter`` of this process. The next commit is published once every
   subscriber has the previous one (plus a short pause), so samples do not queue behind each other.

The subscribers and the publisher share one Python process and loop, so the numbers include the
client-side cost of parsing 200 streams in turn (the last subscriber of a fan-out waits for the
others): they are an upper bound of what one replica sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PUB = "bench-publish-token"
SUB = "bench-subscribe-token"
RUN = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def _run(url: str, subscribers: int, commits: int, pause: float) -> dict[str, object]:
    received: list[dict[int, float]] = [{} for _ in range(subscribers)]
    limits = httpx.Limits(max_connections=subscribers + 10, max_keepalive_connections=subscribers + 10)
    timeout = httpx.Timeout(10.0, read=60.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def subscriber(i: int) -> None:
            headers = {"Authorization": f"Bearer {SUB}"}
            async with client.stream(
                "GET", f"/v1/runs/{RUN}/events", headers=headers, params={"heartbeat": 5, "after": -1}
            ) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        step = json.loads(line[6:])["step"]
                        received[i][step] = time.perf_counter()

        tasks = [asyncio.create_task(subscriber(i)) for i in range(subscribers)]

        async def all_connected() -> bool:
            text = (await client.get("/metrics")).text
            want = f'deltasync_sse_subscribers{{run="{RUN}"}} {subscribers}'
            return want in text

        await _wait_for(all_connected, 120, f"{subscribers} subscribers to connect")
        sent: dict[int, float] = {}
        rtt: list[float] = []
        auth = {"Authorization": f"Bearer {PUB}"}
        for step in range(commits):
            body = {"step": step, "manifest_digest": f"{step:032x}"}
            t0 = time.perf_counter()
            sent[step] = t0
            r = await client.post(f"/v1/runs/{RUN}/commits", json=body, headers=auth)
            rtt.append(time.perf_counter() - t0)
            r.raise_for_status()

            async def everyone_has(step: int = step) -> bool:
                return all(step in got for got in received)

            await _wait_for(everyone_has, 60, f"step {step} to reach every subscriber")
            await asyncio.sleep(pause)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lat = [got[s] - sent[s] for got in received for s in sent]
    last = [max(got[s] for got in received) - sent[s] for s in sent]  # whole fan-out done
    return {
        "subscribers": subscribers,
        "commits": commits,
        "samples": len(lat),
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * _pct(lat, 99),
        "max_ms": 1000 * max(lat),
        "fanout_p50_ms": 1000 * statistics.median(last),
        "publish_rtt_p50_ms": 1000 * statistics.median(rtt),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--subscribers", type=int, default=200)
    p.add_argument("--commits", type=int, default=100)
    p.add_argument("--pause", type=float, default=0.02, help="seconds between commits once all have the last one")
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DELTASYNC_PUBLISH_TOKEN": PUB, "DELTASYNC_SUBSCRIBE_TOKEN": SUB}
        cmd = [sys.executable, "-m", "deltasync.cli", "serve", "--port", str(port), "--db", str(Path(tmp) / "b.db")]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.05)
            res = asyncio.run(_run(url, args.subscribers, args.commits, args.pause))
        finally:
            proc.terminate()
            proc.wait(30)
    rows = [
        "| subscribers | commits | samples | p50 | p99 | max | all subscribers have it (p50) | publish RTT (p50) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| {subscribers} | {commits} | {samples} | {p50_ms:.2f} ms | {p99_ms:.2f} ms | {max_ms:.2f} ms | "
        "{fanout_p50_ms:.2f} ms | {publish_rtt_p50_ms:.2f} ms |".format(**res),
    ]
    table = "\n".join(rows)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
