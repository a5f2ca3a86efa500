#!/usr/bin/env python
"""The cost of one fleet report (``PUT /v1/runs/{run}/replicas/{replica}``) in-process, by route layer.

Run by hand, from the repository root::

    .venv/bin/python benchmarks/profile_report.py                # per-request time, raw ASGI
    .venv/bin/python benchmarks/profile_report.py --profile 25   # and cProfile's top 25 (cumulative)
    .venv/bin/python benchmarks/profile_report.py --live         # server CPU per report, real uvicorn

With ``--live`` it starts the app under uvicorn in a child process, once with ``h11`` + ``asyncio`` and
once with ``httptools`` + ``uvloop`` (where installed), fills the run and sends ``--n`` heartbeats
over 16 keep-alive connections, and prints the server process's CPU time (utime + stime) per
report: what a report costs the event loop, whatever else runs on the machine.

It builds the signal server app (publish and subscribe tokens set, as ``bench_fleet.py``),
fills a run with ``--replicas`` replicas (each with a maximum-length fingerprint audit, as the
heartbeater of ``bench_fleet.py``), then sends ``--n`` heartbeats through the ASGI app with a
raw ASGI call (no HTTP parsing, no socket) and prints the mean time per request; a GET
``/healthz`` is timed the same way as the floor of a request through the app.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fleet import HOST, PUB, RUN, SUB, Conn, _cpu_s, _fingerprint, _free_port, _put, _request, _vectors  # noqa: E402

from deltasync.server import Settings, create_app  # noqa: E402


def _body(fp: str, step: int) -> bytes:
    return json.dumps(
        {
            "step": step,
            "state": "serving",
            "ttl_s": 600,
            "audit": {
                "audited_step": step,
                "fingerprint": fp,
                "divergence": {"mean_abs": 0.001, "max_abs": 0.01, "kl": 1e-05},
            },
        }
    ).encode()


def _caller(app: Any) -> Callable[[str, str, bytes, list[tuple[bytes, bytes]]], Awaitable[int]]:
    async def call(method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), *headers, (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        sent = False
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]

        await app(scope, receive, send)
        return status

    return call


async def _main(replicas: int, n: int, profile: int) -> None:
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, max_replicas=replicas, fleet_ttl_s=600))
    call = _caller(app)
    fps = [_fingerprint(v) for v in _vectors("disagree", replicas)]
    auth = (b"authorization", f"Bearer {SUB}".encode())
    ctype = (b"content-type", b"application/json")
    reqs = [
        (
            f"/v1/runs/{RUN}/replicas/r{i:05d}",
            _body(fps[i], 0),
            [auth, ctype, (b"deltasync-lease", f"bench-lease-{i:08d}-0123456789".encode())],
        )
        for i in range(replicas)
    ]
    for path, body, headers in reqs:
        assert await call("PUT", path, body, headers) == 200
    healthz = [(b"accept", b"*/*")]
    for _ in range(200):
        await call("GET", "/healthz", b"", healthz)

    async def puts() -> None:
        for k in range(n):
            path, body, headers = reqs[k % replicas]
            assert await call("PUT", path, body, headers) == 200

    async def gets() -> None:
        for _ in range(n):
            await call("GET", "/healthz", b"", healthz)

    for name, job in (("PUT report", puts), ("GET /healthz", gets)):
        t0 = time.perf_counter()
        await job()
        dt = time.perf_counter() - t0
        print(f"{name}: {dt / n * 1e6:.0f} us per request ({n} requests, {replicas} replicas)")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        await puts()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)


async def _sse(followers: int, commits: int, profile: int) -> None:
    """``followers`` SSE streams through the ASGI app; per commit, the time until every one got it."""
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB))
    call = _caller(app)
    got: list[int] = [0] * (commits + 2)
    done = asyncio.Event()
    ready = 0

    async def follow() -> None:
        nonlocal ready
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": f"/v1/runs/{RUN}/events",
            "raw_path": f"/v1/runs/{RUN}/events".encode(),
            "query_string": b"heartbeat=30",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {SUB}".encode())],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        forever = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await forever.wait()
            return {"type": "http.disconnect"}

        async def send(msg: MutableMapping[str, Any]) -> None:
            nonlocal ready
            body = msg.get("body", b"")
            if body.startswith(b"retry"):
                ready += 1
            elif body.startswith(b"id: "):
                step = int(body[4 : body.index(b"\n")])
                got[step] += 1
                if got[step] == followers:
                    done.set()

        await app(scope, receive, send)

    tasks = [asyncio.create_task(follow()) for _ in range(followers)]
    while ready < followers:
        await asyncio.sleep(0.01)
    pub = [(b"authorization", f"Bearer {PUB}".encode()), (b"content-type", b"application/json")]
    times = []
    prof = cProfile.Profile()
    for step in range(1, commits + 1):
        done.clear()
        body = json.dumps({"step": step, "manifest_digest": f"{step:032x}"}).encode()
        if profile:
            prof.enable()
        t0 = time.perf_counter()
        assert await call("POST", f"/v1/runs/{RUN}/commits", body, pub) == 201
        await done.wait()
        times.append(time.perf_counter() - t0)
        if profile:
            prof.disable()
    times.sort()
    print(
        f"commit -> all {followers} SSE followers (in-process, no sockets): median {times[len(times) // 2] * 1e3:.1f} ms, "
        f"{times[len(times) // 2] / followers * 1e6:.0f} us per follower ({commits} commits)"
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)


def _serve(port: int, replicas: int, http: str, loop: str) -> None:
    """The child of ``--live``: the app under uvicorn (GC as ``deltasync serve`` sets it)."""
    import gc

    import uvicorn

    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, max_replicas=replicas, fleet_ttl_s=600))
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    uvicorn.run(app, host=HOST, port=port, http=http, loop=loop, log_level="warning")


async def _live_one(replicas: int, n: int, http: str, loop: str) -> float:
    port = _free_port()
    spec = json.dumps({"port": port, "replicas": replicas, "http": http, "loop": loop})
    proc = subprocess.Popen([sys.executable, __file__, "--serve", spec], stdin=subprocess.DEVNULL)
    try:
        while True:
            try:
                probe = Conn(port)
                await probe.call(_request("GET", "/healthz"))
                probe.close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit("the server did not start") from None
                await asyncio.sleep(0.1)
        fps = [_fingerprint(v) for v in _vectors("disagree", replicas)]
        built = [_put(i, fps[i], 0) for i in range(replicas)]
        conns = [Conn(port) for _ in range(16)]

        async def lane(c: Conn, ids: range) -> None:
            for i in ids:
                status, _ = await c.call(built[i % replicas])
                assert status == 200, status

        await asyncio.gather(*(lane(c, range(k, replicas, 16)) for k, c in enumerate(conns)))
        cpu0 = _cpu_s(proc.pid)
        await asyncio.gather(*(lane(c, range(k, n, 16)) for k, c in enumerate(conns)))
        per = (_cpu_s(proc.pid) - cpu0) / n
        for c in conns:
            c.close()
        return per
    finally:
        proc.terminate()
        proc.wait(30)


def _live(replicas: int, n: int) -> None:
    stacks = [("h11", "asyncio")]
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401

        stacks.append(("httptools", "uvloop"))
    except ImportError:
        print("httptools or uvloop is not installed: h11 + asyncio only")
    for http, loop in stacks:
        per = asyncio.run(_live_one(replicas, n, http, loop))
        print(f"{http} + {loop}: {per * 1e6:.0f} us of server CPU per report ({n} reports, {replicas} replicas)")


def main() -> int:
    """Parse the arguments and run."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--replicas", type=int, default=4096)
    p.add_argument("--n", type=int, default=2000, help="requests timed")
    p.add_argument("--profile", type=int, default=0, metavar="TOP", help="print cProfile's top TOP functions")
    p.add_argument("--live", action="store_true", help="server CPU per report under uvicorn (h11 and httptools)")
    p.add_argument("--sse", type=int, metavar="FOLLOWERS", help="time a commit's delivery to FOLLOWERS SSE streams")
    p.add_argument("--serve", metavar="JSON", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        o = json.loads(a.serve)
        _serve(o["port"], o["replicas"], o["http"], o["loop"])
        return 0
    if a.sse:
        asyncio.run(_sse(a.sse, 20, a.profile))
        return 0
    if a.live:
        _live(a.replicas, a.n)
        return 0
    asyncio.run(_main(a.replicas, a.n, a.profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
