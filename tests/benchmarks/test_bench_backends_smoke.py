"""Smoke test of benchmarks/bench_backends.py: its measurement runs on a tiny model over local and S3.

Not a benchmark; it only makes CI notice when the script no longer runs against the current API.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from bench_loader import load_bench

import deltasync as ds
from deltasync.testing.seaweedfs import SeaweedFS

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = dict(hidden=64, layers=2, intermediate=128, vocab=512, heads=4, kv_heads=2, head_dim=16, batch=2, seq=16)


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_backends", imports=("bench_payload",))


@pytest.mark.timeout(300)
def test_measure_local_and_s3(bench: Any, s3_server: SeaweedFS, tmp_path: Path) -> None:
    cfg = replace(bench.bp.BenchConfig(), **TINY, steps=2, warmup=1, lrs=(1e-5,))
    states = bench.train_stream(cfg, 1e-5, lambda _: None)
    assert len(states) == 4
    openers = {
        "local": lambda: ds.LocalStore(tmp_path / "local", fsync=False),
        "s3": lambda: s3_server.store("test", f"bench-smoke/{tmp_path.name}"),
    }
    rows = [bench.measure(name, 1e-5, states, op, cfg, tmp_path) for name, op in openers.items()]
    local, s3 = rows
    assert [r["step"] for r in s3.steps] == [0, 1, 2, 3]
    # the same stream gives the same bytes through either backend
    assert [r["up_bytes"] for r in local.steps] == [r["up_bytes"] for r in s3.steps]
    assert local.full_bytes == s3.full_bytes > local.anchor_bytes / 2
    assert 0 < s3.up_bytes < s3.anchor_bytes and s3.upload_s > 0 and s3.download_s > 0
    text = bench.render(rows, cfg, 1, "cmd", 1.0, "test")
    assert text.count("| 1e-05 | s3 |") == 2 and text.count("| 1e-05 | local |") == 2
