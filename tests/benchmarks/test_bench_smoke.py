"""Smoke test of benchmarks/bench_payload.py: its core runs end to end on a tiny Qwen3 for 2 steps.

Not a benchmark (the numbers of a model this small mean nothing); it only makes CI notice when the
script no longer runs against the current API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench_loader import load_bench

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    yield from load_bench("bench_payload")


TINY = dict(hidden=64, layers=2, intermediate=128, vocab=512, heads=4, kv_heads=2, head_dim=16, batch=2, seq=16)


@pytest.mark.timeout(120)
def test_core_runs_on_a_tiny_model(bench: Any, tmp_path: Path) -> None:
    cfg = bench.BenchConfig(**TINY, steps=2, warmup=0, lrs=(1e-5,), tmpdir=str(tmp_path))
    import deltasync.fetcher._execute as fexecute
    import deltasync.uploader._snapshot as uupl

    originals = (uupl.diff_tensor, fexecute.apply_changes)
    res = bench.run(cfg, quiet=True)
    assert (uupl.diff_tensor, fexecute.apply_changes) == originals  # the timing wrappers are removed again
    recs = res.records
    assert [r.step for r in recs] == [1, 2]
    for r in recs:
        assert 0 < r.changed <= r.total
        assert r.nbytes > 0 and r.pos_bytes > 0 and r.val_bytes > 0
        for x in (
            r.ds_bpc,
            r.bound_bpc,
            r.t_push,
            r.t_cmp,
            r.t_memcpy,
            r.t_fetch,
            r.t_e2e,
            r.t_encode_1,
            r.t_encode_pool,
        ):
            assert math.isfinite(x) and x > 0
        assert r.t_e2e >= r.t_push
        # every phase the breakdown reports was found and called (a rename shows up here)
        assert {"push.stage", "bg.diff", "bg.build_patch", "fetch.decode", "fetch.apply_patch"} <= set(r.phases)
    text = bench.render(res)
    for title in (
        "Payload per step",
        "Payload, medians per lr",
        "Payload breakdown",
        "Timing, medians per lr",
        "Timing breakdown",
    ):
        assert title in text
    assert "| 1e-05 | 1 |" in text and "| 1e-05 | 2 |" in text
    assert list(tmp_path.iterdir()) == []  # the store's temp dir is removed


def test_cli_writes_the_report(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, raw, store_dir = tmp_path / "results.md", tmp_path / "records.json", tmp_path / "stores"
    store_dir.mkdir()
    size = "--hidden 32 --layers 1 --intermediate 64 --vocab 256 --heads 2 --kv-heads 1 --head-dim 16 --seq 8"
    args = [*size.split(), "--steps", "1", "--warmup", "0", "--lrs", "1e-6", "--quiet"]
    args += ["--tmpdir", str(store_dir), "--out", str(out), "--json", str(raw)]
    assert bench.main(args) == 0
    text = out.read_text()
    assert "Payload, medians per lr" in text and "| 1e-06 |" in text
    assert text.strip() in capsys.readouterr().out
    records = json.loads(raw.read_text())["records"]
    assert [r["step"] for r in records] == [1] and records[0]["nbytes"] > 0
    assert list(store_dir.iterdir()) == []


def test_preset_sets_the_qwen3_06b_shape(bench: Any) -> None:
    cfg, _ = bench.parse_args(["--preset", "qwen3-0.6b", "--layers", "2"])
    assert (cfg.hidden, cfg.vocab, cfg.head_dim, cfg.tie_embeddings, cfg.layers) == (1024, 151936, 128, True, 2)


def test_entropy_helpers(bench: Any) -> None:
    import numpy as np

    assert bench._h2(0.5) == pytest.approx(1.0)
    assert bench._h2(0.0) == 0.0 and bench._h2(1.0) == 0.0
    vals = np.array([1, 1, 2, 2], dtype=np.int16)
    assert bench._entropy_bits(vals) == pytest.approx(4.0)  # 4 elements x 1 bit
    numel = {"a": 8}
    idx = np.array([0, 4], dtype=np.int64)
    old = np.array([0, 0], dtype=np.int16)
    new = np.array([1, 3], dtype=np.int16)
    pos_bits, val_bits, per_tensor = bench.entropy_bound(numel, {"a": (idx, old, new)})
    assert pos_bits == pytest.approx(8 * bench._h2(2 / 8))
    assert val_bits == pytest.approx(2.0) and per_tensor == pytest.approx(2.0)
