"""Smoke test of benchmarks/bench_fleet.py: a tiny fleet (a real signal server on 127.0.0.1, a
heartbeater process, SSE followers, commits, GET fleet, /healthz, /metrics) runs end to end and
every series gets samples. The figures of a run this small mean nothing and are not asserted; CI
only notices when the script no longer runs against the current server."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from bench_loader import load_bench


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_fleet")


@pytest.mark.timeout(300)
def test_a_tiny_fleet_runs_end_to_end(bench: Any) -> None:
    cfg = bench.Config(replicas=12, followers=4, seconds=3.0, heartbeat=1.0, variants=("majority", "moving"))
    results = bench.run(cfg)
    assert [r.variant for r in results] == ["majority", "moving"]
    for r in results:
        s = r.summary()
        assert r.puts > 0 and r.puts_failed == 0, s
        assert r.commits >= 2 and s["commit_ms_n"] >= 4, s  # every follower got the commits
        assert s["fleet_ms_n"] >= 2 and s["healthz_ms_n"] >= 10 and s["metrics_ms_n"] >= 1, s
        assert r.fleet_bytes > 12 * 1000  # 12 replicas, each with a maximum-length fingerprint
        for key in ("fleet_ms_p99", "commit_ms_p99", "healthz_ms_p99", "metrics_ms_p99"):
            assert math.isfinite(s[key]) and s[key] > 0, key
        assert r.server_cpu > 0
    table = bench.render(results)
    assert table.count("\n| majority |") == 1 and table.count("\n| moving |") == 1


def test_the_quick_mode_and_variants_parse(bench: Any) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--variants", "nonsense"])
    assert len(bench._fingerprint(bench._vectors("disagree", 1)[0])) == bench.MAX_FINGERPRINT
