#!/usr/bin/env python
"""The fleet view at fleet size: 4,096 replicas heartbeating, 1,000 SSE followers, a commit a second.

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_fleet.py                 # 4,096 replicas, 1,000 followers, 30 s
    .venv/bin/python benchmarks/bench_fleet.py --quick         # 64 replicas, 20 followers, 4 s
    .venv/bin/python benchmarks/bench_fleet.py --variants disagree --seconds 60 --out fleet.md

What it does, per variant (a fresh server each):

1. starts ``deltasync serve`` (uvicorn, one worker, tokens set, ``--max-replicas`` = the replicas)
   in a child process on a free 127.0.0.1 port;
2. starts a *heartbeater* child process (this script, ``--heartbeater``): ``--replicas`` replicas
   report (``PUT /v1/runs/bench/replicas/{id}``, the subscribe token, a lease each) with an audit
   carrying a maximum-length fingerprint (``MAX_FINGERPRINT``: 64 probes x 4 segments) and a
   divergence, first all at once, then each every ``--heartbeat`` seconds, spread evenly over 16
   keep-alive connections (raw HTTP/1.1 over asyncio streams, requests built once).
   Variant ``disagree``: every replica's vector is distinct and far from every other (no two
   agree: the worst case of the old pairwise grouping). ``majority``: two thirds agree (noise
   within the tolerance), the rest are distinct. ``moving``: as ``disagree``, but every heartbeat
   reports a newly audited step, so each read regroups (the audits of a fleet following a run);
3. in this process, on one asyncio loop: ``--followers`` SSE streams (``GET /v1/runs/bench/events``,
   ``asyncio.Protocol`` per stream), a commit a second (``POST /v1/runs/bench/commits``, the
   publish token), ``GET /v1/runs/bench/fleet`` every ``--fleet-every`` s (0.5), ``/healthz`` every
   0.1 s and ``/metrics`` every 2 s, each on its own keep-alive connection (the first GET fleet
   and ``/metrics`` once every replica has reported, which group the whole fleet, are timed apart);
4. measures, over ``--seconds`` once every replica has reported: GET fleet latency (the whole
   body read), commit -> each follower parsed it (from ``time.perf_counter`` just before the POST
   is written; the ``all`` column: the last follower of a commit), ``/healthz`` and ``/metrics``
   latency (p50/p99), and the server's CPU (utime + stime of its process, ``/proc/<pid>/stat``,
   in cores: 1.0 is one core busy all the time).

The load generator shares the machine with the server (two processes, the heartbeater and this
one): on a 2-core box the figures include the contention with it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deltasync.protocol.audit import MAX_FINGERPRINT

PUB = "bench-publish-token"
SUB = "bench-subscribe-token"
RUN = "bench"
HOST = "127.0.0.1"
VALUES = (MAX_FINGERPRINT - len("fp1-01234567-")) // 6  # segment values of a maximum-length fingerprint
VARIANTS = ("disagree", "majority", "moving")


@dataclass
class Config:
    """One run of the benchmark."""

    replicas: int = 4096
    followers: int = 1000
    seconds: float = 30.0
    heartbeat: float = 10.0
    fleet_every: float = 0.5
    variants: tuple[str, ...] = ("disagree", "majority")
    connections: int = 16


@dataclass
class Result:
    """The figures of one variant."""

    variant: str
    replicas: int
    followers: int
    seconds: float
    puts: int = 0
    puts_failed: int = 0
    fleet_bytes: int = 0
    fleet_ms: list[float] = field(default_factory=list)
    commit_ms: list[float] = field(default_factory=list)
    commit_all_ms: list[float] = field(default_factory=list)
    commits: int = 0
    healthz_ms: list[float] = field(default_factory=list)
    metrics_ms: list[float] = field(default_factory=list)
    server_cpu: float = 0.0
    loadgen_cpu: float = 0.0
    #: the first GET fleet and /metrics once every replica reported: they group the whole fleet
    first_fleet_ms: float = 0.0
    first_metrics_ms: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Medians and 99th percentiles (ms) of every series, with the counts."""
        out: dict[str, Any] = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        for name in ("fleet_ms", "commit_ms", "commit_all_ms", "healthz_ms", "metrics_ms"):
            xs: list[float] = getattr(self, name)
            out[f"{name}_n"] = len(xs)
            out[f"{name}_p50"] = statistics.median(xs) if xs else float("nan")
            out[f"{name}_p99"] = _pct(xs, 99) if xs else float("nan")
        return out


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ raw HTTP/1.1


def _request(method: str, path: str, token: str | None = None, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\n{extra}"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class Conn:
    """One keep-alive HTTP/1.1 connection: a request, then its whole reply (Content-Length bodies)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, raw: bytes) -> tuple[int, bytes]:
        """Send ``raw``; the status and body (reconnects once if the server closed the connection)."""
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=1 << 20)
            assert self.reader is not None
            try:
                self.writer.write(raw)
                head = await self.reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await self.reader.readexactly(int(m.group(1))) if m else b""
                return status, body
            except (ConnectionError, asyncio.IncompleteReadError):
                self.writer.close()
                self.writer = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connection."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# ------------------------------------------------------------------ the heartbeater (a child process)


def _fingerprint(values: np.ndarray) -> str:
    return "fp1-0badc0de-" + "".join(f"{int(v) % (1 << 24):06x}" for v in values)


def _vectors(variant: str, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(45)
    base = rng.integers(-(1 << 16), 1 << 16, size=VALUES)
    out = []
    for i in range(n):
        if variant == "majority" and i % 3:
            out.append(base + rng.integers(0, 40, size=VALUES))  # within the default tolerance (82 quanta)
        else:
            out.append(rng.integers(-(1 << 22), 1 << 22, size=VALUES))  # far from every other
    return out


def _put(i: int, fp: str, step: int) -> bytes:
    body = {
        "step": step,
        "state": "serving",
        "ttl_s": 600,
        "audit": {
            "audited_step": step,
            "fingerprint": fp,
            "divergence": {"mean_abs": 0.001, "max_abs": 0.01, "kl": 1e-05},
        },
    }
    lease = f"bench-lease-{i:08d}-0123456789"
    return _request(
        "PUT", f"/v1/runs/{RUN}/replicas/r{i:05d}", SUB, json.dumps(body).encode(), f"Deltasync-Lease: {lease}\r\n"
    )


async def _heartbeat(
    port: int, variant: str, replicas: int, every: float, seconds: float, conns: int
) -> dict[str, Any]:
    fps = [_fingerprint(v) for v in _vectors(variant, replicas)]
    moving = variant == "moving"
    built = [_put(i, fps[i], 0) for i in range(replicas)]
    stats: dict[str, Any] = {"puts": 0, "failed": 0, "statuses": {}}

    async def one(c: Conn, i: int, step: int) -> None:
        status, _ = await c.call(_put(i, fps[i], step) if moving else built[i])
        stats["puts"] += 1
        if status != 200:
            stats["failed"] += 1
            stats["statuses"][str(status)] = stats["statuses"].get(str(status), 0) + 1

    conns = max(1, min(conns, replicas))
    lanes = [list(range(k, replicas, conns)) for k in range(conns)]
    pool = [Conn(port) for _ in range(conns)]

    async def fill(c: Conn, ids: list[int]) -> None:
        for i in ids:
            await one(c, i, 0)

    await asyncio.gather(*(fill(c, ids) for c, ids in zip(pool, lanes, strict=True)))
    stats["puts"] = stats["failed"] = 0  # the heartbeats only, from here
    print("ready", flush=True)
    start = time.monotonic()

    async def beat(c: Conn, ids: list[int], lane: int) -> None:
        gap = every / max(1, len(ids))
        k = 0
        while True:
            due = start + lane * gap / conns + k * gap
            if due > start + seconds:
                return
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await one(c, ids[k % len(ids)], int(time.monotonic() - start) + 1)
            k += 1

    await asyncio.gather(*(beat(c, ids, n) for n, (c, ids) in enumerate(zip(pool, lanes, strict=True))))
    for c in pool:
        c.close()
    return stats


def heartbeater_main(spec: str) -> int:
    """The heartbeater child: reports, prints ``ready`` once every replica has, then a JSON summary."""
    o = json.loads(spec)
    stats = asyncio.run(
        _heartbeat(o["port"], o["variant"], o["replicas"], o["heartbeat"], o["seconds"], o["connections"])
    )
    stats["cpu_s"] = _cpu_s(os.getpid())
    print(json.dumps(stats), flush=True)
    return 0


# ------------------------------------------------------------------ followers and probes (this process)


class Follower(asyncio.Protocol):
    """One SSE stream: the arrival time of each commit id (parsed from the raw bytes, no HTTP client)."""

    ID = re.compile(rb"\nid: (\d+)\n")

    def __init__(self, port: int, got: dict[int, float]) -> None:
        self.raw = _request("GET", f"/v1/runs/{RUN}/events?heartbeat=30", SUB, extra="Accept: text/event-stream\r\n")
        self.got = got
        self.tail = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.raw)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        chunk = self.tail + data
        for m in self.ID.finditer(chunk):
            self.got.setdefault(int(m.group(1)), now)
        self.tail = chunk[-24:]


async def _measure(cfg: Config, port: int, server_pid: int, variant: str, hb: asyncio.subprocess.Process) -> Result:
    res = Result(variant, cfg.replicas, cfg.followers, cfg.seconds)
    loop = asyncio.get_running_loop()
    got: list[dict[int, float]] = [{} for _ in range(cfg.followers)]
    transports = []
    for k in range(0, cfg.followers, 100):
        batch = [
            loop.create_connection(functools.partial(Follower, port, got[i]), HOST, port)
            for i in range(k, min(cfg.followers, k + 100))
        ]
        transports += [t for t, _ in await asyncio.gather(*batch)]
    probe = Conn(port)
    want = f'deltasync_sse_subscribers{{run="{RUN}"}} {cfg.followers}'.encode()
    deadline = time.monotonic() + 120
    while want not in (await probe.call(_request("GET", "/metrics")))[1]:
        if time.monotonic() > deadline:
            raise SystemExit(f"{cfg.followers} followers did not all connect")
        await asyncio.sleep(0.1)
    assert hb.stdout is not None
    line = await asyncio.wait_for(hb.stdout.readline(), 600)
    if line.strip() != b"ready":
        raise SystemExit(f"the heartbeater failed: {line!r}")
    warm = Conn(port)
    for raw, what in (
        (_request("GET", f"/v1/runs/{RUN}/fleet", SUB), "first_fleet_ms"),
        (_request("GET", "/metrics"), "first_metrics_ms"),
    ):
        t = time.perf_counter()
        await warm.call(raw)
        setattr(res, what, 1000 * (time.perf_counter() - t))
    warm.close()
    cpu0, t0 = _cpu_s(server_pid), time.monotonic()
    own0 = time.process_time()
    end = t0 + cfg.seconds
    sent: dict[int, float] = {}

    async def every(period: float, fn: Callable[[], Any]) -> None:
        nxt = time.monotonic()
        while nxt < end:
            await fn()
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    commits, fleet, health, metrics = Conn(port), Conn(port), Conn(port), Conn(port)
    step = [0]

    async def commit() -> None:
        step[0] += 1
        body = json.dumps({"step": step[0], "manifest_digest": f"{step[0]:032x}"}).encode()
        raw = _request("POST", f"/v1/runs/{RUN}/commits", PUB, body)
        sent[step[0]] = time.perf_counter()
        status, reply = await commits.call(raw)
        if status != 201:
            raise SystemExit(f"commit {step[0]}: {status} {reply[:200]!r}")

    def timed(conn: Conn, raw: bytes, into: list[float], size: list[int] | None = None) -> Callable[[], Any]:
        async def go() -> None:
            t = time.perf_counter()
            status, body = await conn.call(raw)
            into.append(1000 * (time.perf_counter() - t))
            if status != 200:
                raise SystemExit(f"{raw.split(b' ')[1]!r}: {status} {body[:200]!r}")
            if size is not None:
                size[0] = len(body)

        return go

    size = [0]
    await asyncio.gather(
        every(1.0, commit),
        every(cfg.fleet_every, timed(fleet, _request("GET", f"/v1/runs/{RUN}/fleet", SUB), res.fleet_ms, size)),
        every(0.1, timed(health, _request("GET", "/healthz"), res.healthz_ms)),
        every(2.0, timed(metrics, _request("GET", "/metrics"), res.metrics_ms)),
    )
    await asyncio.sleep(1.0)  # the last commit reaches the followers
    res.server_cpu = (_cpu_s(server_pid) - cpu0) / (time.monotonic() - t0)
    own = time.process_time() - own0
    res.fleet_bytes = size[0]
    res.commits = len(sent)
    for s, t in sent.items():
        arrivals = [g[s] for g in got if s in g]
        res.commit_ms += [1000 * (a - t) for a in arrivals]
        if len(arrivals) == cfg.followers:
            res.commit_all_ms.append(1000 * (max(arrivals) - t))
    for tr in transports:
        tr.close()
    for c in (probe, commits, fleet, health, metrics):
        c.close()
    out, _ = await asyncio.wait_for(hb.communicate(), 600)
    stats = json.loads(out.decode().strip().splitlines()[-1])
    res.puts, res.puts_failed = stats["puts"], stats["failed"]
    if stats["failed"]:
        print(f"  {variant}: {stats['failed']} reports refused: {stats['statuses']}", file=sys.stderr)
    res.loadgen_cpu = (own + stats["cpu_s"]) / (time.monotonic() - t0)
    return res


def _start_server(port: int, db: Path, replicas: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DELTASYNC_PUBLISH_TOKEN": PUB, "DELTASYNC_SUBSCRIBE_TOKEN": SUB}
    cmd = [sys.executable, "-m", "deltasync.cli", "serve", "--port", str(port), "--db", str(db)]
    cmd += ["--max-replicas", str(replicas), "--fleet-ttl", "600"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=1) as s:
                s.sendall(_request("GET", "/healthz") + b"")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the server did not start")
        time.sleep(0.05)


async def _variant(cfg: Config, variant: str, tmp: Path) -> Result:
    port = _free_port()
    server = _start_server(port, tmp / f"{variant}.db", cfg.replicas)
    try:
        spec = {
            "port": port,
            "variant": variant,
            "replicas": cfg.replicas,
            "heartbeat": cfg.heartbeat,
            "seconds": cfg.seconds + 2,
            "connections": cfg.connections,
        }
        hb = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--heartbeater", json.dumps(spec), stdout=asyncio.subprocess.PIPE
        )
        try:
            return await _measure(cfg, port, server.pid, variant, hb)
        finally:
            if hb.returncode is None:
                hb.kill()
                await hb.wait()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run(cfg: Config) -> list[Result]:
    """Every variant of ``cfg``, each against a fresh server."""
    with tempfile.TemporaryDirectory() as tmp:
        return [asyncio.run(_variant(cfg, v, Path(tmp))) for v in cfg.variants]


def render(results: list[Result]) -> str:
    """The markdown table of ``results`` (ms; CPU in cores)."""
    rows = [
        "| variant | replicas | reports/s | followers | GET fleet p50 / p99 | reply | commit -> follower p50 / p99 "
        "| commit -> all p50 / p99 | /healthz p50 / p99 | /metrics p50 / p99 | first GET fleet / /metrics "
        "| server CPU | load gen CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r.summary()
        rows.append(
            f"| {r.variant} | {r.replicas} | {r.puts / max(r.seconds, 1e-9):.0f} | {r.followers} "
            f"| {s['fleet_ms_p50']:.1f} / {s['fleet_ms_p99']:.1f} ms | {r.fleet_bytes / 2**20:.1f} MiB "
            f"| {s['commit_ms_p50']:.1f} / {s['commit_ms_p99']:.1f} ms "
            f"| {s['commit_all_ms_p50']:.1f} / {s['commit_all_ms_p99']:.1f} ms "
            f"| {s['healthz_ms_p50']:.1f} / {s['healthz_ms_p99']:.1f} ms "
            f"| {s['metrics_ms_p50']:.1f} / {s['metrics_ms_p99']:.1f} ms "
            f"| {r.first_fleet_ms:.0f} / {r.first_metrics_ms:.0f} ms | {r.server_cpu:.2f} | {r.loadgen_cpu:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--heartbeater", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="64 replicas, 20 followers, 4 s, a heartbeat a second")
    p.add_argument("--replicas", type=int)
    p.add_argument("--followers", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--heartbeat", type=float, help="seconds between a replica's reports (default 10, as FleetReporter)")
    p.add_argument("--fleet-every", type=float, help="seconds between two GET fleet (default 0.5)")
    p.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)} (default disagree,majority)")
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args(argv)
    if args.heartbeater:
        return heartbeater_main(args.heartbeater)
    cfg = Config(replicas=64, followers=20, seconds=4.0, heartbeat=1.0) if args.quick else Config()
    for name in ("replicas", "followers", "seconds", "heartbeat", "fleet_every"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.variants:
        cfg.variants = tuple(v.strip() for v in args.variants.split(","))
        bad = set(cfg.variants) - set(VARIANTS)
        if bad:
            p.error(f"unknown variants {sorted(bad)}: pick from {', '.join(VARIANTS)}")
    results = run(cfg)
    table = render(results)
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {cfg}")
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
