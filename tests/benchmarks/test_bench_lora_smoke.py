"""Smoke test of benchmarks/bench_lora_bytes.py: the adapter and merged-weights pushes of the same LoRA
training run end to end at a tiny size and the table prints (CI only notices when the script no
longer runs against the current API; the figures of a run this small are not the point)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bench_loader import load_bench

pytest.importorskip("torch")
pytest.importorskip("peft")

#: peft 0.21.2 reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_lora_bytes")


@pytest.mark.timeout(300)
def test_both_paths_are_measured_and_tabled(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--steps", "2", "--lr", "1e-2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| adapter", "| merged"))]
    assert len(rows) == 3, out
    assert rows[0].endswith("| 1.0x |") and all(r.endswith("x |") for r in rows[1:]), out
