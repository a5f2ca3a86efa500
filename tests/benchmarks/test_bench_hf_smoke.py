"""Smoke test of benchmarks/bench_hf.py: one measured step of a tiny Qwen3 over the session's fake Hub.

Not a benchmark; it only makes CI notice when the script no longer runs against the current API.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
from bench_loader import load_bench
from fakehub import FakeHub

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_hf", imports=("bench_payload",))


@pytest.mark.timeout(300)
def test_bench_hf_runs(bench: Any, fake_hub: FakeHub) -> None:
    cfg = bench.bp.BenchConfig(**bench.PRESETS["tiny"], batch=2, seq=16, adamw="foreach")
    logs: list[str] = []
    params, rows = bench.run_lr(fake_hub, cfg, 1e-3, 1, 1, logs.append)
    assert params > 0 and len(rows) == 1 and len(logs) == 2
    row = rows[0]
    assert 0 < row.patch_bytes < row.full_bytes
    assert row.patch_cas > 0 and row.full_cas > 0 and row.patch_requests > 0
    args = argparse.Namespace(preset="tiny", steps=1, warmup=1, argv=["--preset", "tiny"])
    text = bench.render({1e-3: params}, rows, cfg, args, 1.0)
    assert "FAKE Hub" in text and "| 0.001 |" in text
