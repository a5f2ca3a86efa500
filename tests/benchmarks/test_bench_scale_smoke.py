"""Smoke test of benchmarks/bench_scale.py: the per-tensor pair and the codec scan run end to end at
a tiny size (the figures of a run this small mean nothing; CI only notices when the script no longer
runs against the current API)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bench_loader import load_bench

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_scale")


@pytest.mark.timeout(300)
def test_per_tensor_pair_runs(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--per-tensor", "2e6", "--steps", "2", "--no-node", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "| 288 tensors | cpu | 288 |" in out
    assert "| 18,432 tensors | cpu | 18,432 |" in out
    assert "per-tensor ratio (18,432 / 288 tensors, same elements): commit" in out


@pytest.mark.timeout(120)
def test_codec_scan_covers_every_stage_and_thread_count(bench: Any) -> None:
    text = bench.codec_scan([1, 2], numel=1 << 16, groups=4, reps=1)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and "GB/s" in line}
    assert set(rows) == {"diff", "encode", "decode+apply", "xxh3-128"}
    for line in rows.values():
        assert line.count("GB/s") == 2 and "(1.00x)" in line
