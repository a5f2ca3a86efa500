"""Smoke test of benchmarks/bench_hf.py: one measured step of a tiny Qwen3 over the session's fake Hub.

Not a benchmark; it only makes CI notice when the script no longer runs against the current API.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakehub import FakeHub

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    spec = importlib.util.spec_from_file_location("bench_hf", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
        sys.modules.pop("bench_payload", None)


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
