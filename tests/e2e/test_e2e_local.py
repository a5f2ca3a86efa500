"""The acceptance scenario on a local dir, for what the fetcher does beyond the store: random access,
materialize, module targets, tied weights, coalescing under a slow store, every dtype.

The runs are those of ``tests/e2e_runs.py`` (``lr1e-3``, ``lr1e-6``) pushed to the ``local`` backend;
the scenario itself, on every backend, is ``test_e2e.py``.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from e2e_runs import STEPS, WAIT, Run, expected_downloads, manifests
from qwen3 import make_qwen3, qwen3_config, train_steps
from spy_store import SpyStore, step_of_key
from tensors import assert_state_equal, bf16_view, bits_equal, snapshot

import deltasync as ds
from deltasync.errors import InventoryMismatch, StorageError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

#: the tests on the scenario's runs take them from the local dir
LOCAL = pytest.mark.parametrize("backend", ["local"], indirect=True)


@LOCAL
def test_random_access_steps(run: Run) -> None:
    order = list(range(STEPS))
    random.Random(7).shuffle(order)
    f = ds.DeltaFetcher(run.store())
    target = run.zeros()
    for step in order:  # backwards, forwards, across anchors
        f.sync(target, step=step)
        assert_state_equal(target, run.pushed[step], f"{run.name} step {step}")
    # a fresh fetcher per step, each starting from a fresh target
    for step in order[:5]:
        target = run.zeros()
        ds.DeltaFetcher(run.store()).sync(target, step=step)
        assert_state_equal(target, run.pushed[step], f"{run.name} fresh step {step}")


# ------------------------------------------------------------------- (c)


def load_checkpoint_dir(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    tensors: dict[str, Any] = {}
    for shard in shards:
        part = load_file(out / shard)
        assert {index["weight_map"][k] for k in part} == {shard}
        tensors.update(part)
    assert sorted(tensors) == sorted(index["weight_map"])
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    return tensors


@LOCAL
def test_materialize_loads_with_safetensors_and_transformers(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Qwen3ForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spy = SpyStore(run.store())
    f = ds.DeltaFetcher(spy, shard_bytes=64 * 1024)
    out = tmp_path / "ckpt"
    assert f.materialize(out, step=12) == out.absolute()
    got = load_checkpoint_dir(out)
    assert len({p.name for p in out.glob("model-*.safetensors")}) > 1, "expected several shards"
    assert_state_equal(got, run.pushed[12], "materialized step 12")
    marker = json.loads((out / ".deltasync.json").read_text())
    assert marker["step"] == 12
    # the same dir again, later step: replaced atomically, no temp dirs left behind
    spy.reset()
    f.materialize(out, step=18)
    assert_state_equal(load_checkpoint_dir(out), run.pushed[18], "materialized step 18")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    ms = manifests(run.store())
    assert {step_of_key(k) for k in spy.data_gets()} == expected_downloads(ms, 12, 18)
    # latest, into a fresh dir; then transformers loads it as it is (plus a config)
    latest = f.materialize(tmp_path / "latest")
    qwen3_config().save_pretrained(latest)
    model = Qwen3ForCausalLM.from_pretrained(latest, dtype=torch.bfloat16)
    assert_state_equal(model, run.pushed[STEPS - 1], "from_pretrained")


@LOCAL
def test_materialize_refuses_foreign_dirs(runs: dict[str, Run], tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(StorageError, match="refusing to replace"):
        ds.DeltaFetcher(runs["lr1e-6"].store()).materialize(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------- (d)


@LOCAL
def test_module_target_synced_in_place(run: Run) -> None:
    model = make_qwen3(seed=123, dtype=torch.bfloat16)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    f = ds.DeltaFetcher(run.store())
    for step in (0, 1, 2, 9, 10, 19):
        f.sync(model, step=step)
        assert_state_equal(model, run.pushed[step], f"module step {step}")
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs, "tensors were replaced, not updated"
    # the synced module computes exactly what the pushed weights compute
    ref = make_qwen3(seed=5, dtype=torch.bfloat16)
    ref.load_state_dict(run.pushed[19])
    x = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert bits_equal(model(input_ids=x).logits, ref(input_ids=x).logits)


@LOCAL
def test_tied_weights(tmp_path: Path, runs: dict[str, Run]) -> None:
    store = ds.LocalStore(tmp_path / "tied", fsync=False)
    master = make_qwen3(seed=1, tie=True)
    pushed = []
    with ds.DeltaUploader(store, anchor_every=3, on_backlog="block") as up:
        for step in train_steps(master, 6, lr=1e-3, seed=3):
            state = bf16_view(master)
            assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
            pushed.append(snapshot(state))
            up.push(state, step)
    target = make_qwen3(seed=2, tie=True, dtype=torch.bfloat16)
    f = ds.DeltaFetcher(store)
    for step in range(6):
        f.sync(target, step=step)
        assert target.lm_head.weight is target.model.embed_tokens.weight
        assert_state_equal(target, pushed[step], f"tied step {step}")
    # a tied target cannot hold an untied run whose two matrices differ: refused, untouched
    before = snapshot(target)
    with pytest.raises(InventoryMismatch, match="ties 'lm_head.weight' and 'model.embed_tokens.weight'"):
        ds.DeltaFetcher(runs["lr1e-3"].store()).sync(target, step=3)
    assert_state_equal(target, before, "tied target after a refused sync")


# ------------------------------------------------------------------- (e)


class Turnstile:
    """A SpyStore gate that lets ``permits`` writes (put_many calls) through, then holds the rest
    until :meth:`set`: a store that makes some progress while the trainer pushes, but no more."""

    def __init__(self, permits: int) -> None:
        self._sem = threading.Semaphore(permits)
        self._open = threading.Event()
        self.passed = 0

    def is_set(self) -> bool:
        return self._open.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._sem.acquire(timeout=timeout):
            return False
        self.passed += 1
        return True

    def set(self) -> None:
        if not self._open.is_set():
            self._open.set()
            self._sem.release(1_000_000)


@LOCAL
@pytest.mark.parametrize("slow", ["gated", "metered"])
def test_coalescing_under_a_slow_store(runs: dict[str, Run], tmp_path: Path, slow: str) -> None:
    run = runs["lr1e-3"]
    spy = SpyStore(ds.LocalStore(tmp_path / "coalesce", fsync=False))
    # gated: no write gets through while pushing; metered: 4 do (a committed step takes three),
    # so commits and coalescing run alongside the pushes
    gate: Any = threading.Event() if slow == "gated" else Turnstile(4)
    spy.gate = gate
    up = ds.DeltaUploader(spy, anchor_every=5, on_backlog="coalesce", max_pending=2)
    try:
        futs = [up.push(state, step) for step, state in enumerate(run.pushed)]
        # every push returned while the store could do at most 4 writes: pushing never waits for the store
        assert not futs[-1].done()
        if slow == "gated":
            assert spy.blocked.is_set() and not any(f.done() for f in futs)
        else:
            assert gate.passed <= 4
        gate.set()
        infos = [f.result(WAIT) for f in futs]
    finally:
        gate.set()
        up.close()
    committed = sorted({i.committed_step for i in infos})
    assert committed[-1] == STEPS - 1 and infos[-1].kind in ("anchor", "patch")
    assert infos[0].kind == "anchor"
    for i in infos:
        if i.committed_step == i.step:
            assert i.kind in ("anchor", "patch")
        else:
            assert i.kind == "skipped" and i.committed_step > i.step
    if slow == "gated":
        # step 0 (held by the gate) + at most max_pending waiting jobs; the last push may still be
        # on its way through the hashing thread when the gate opens, so allow one more commit
        assert len(committed) <= 4
        assert sum(i.kind == "skipped" for i in infos) >= STEPS - 4
    f = ds.DeltaFetcher(spy)
    assert f.steps() == committed
    target = run.zeros()
    assert f.sync(target) == STEPS - 1
    assert_state_equal(target, run.pushed[-1], "coalesced final step")
    for step in committed:
        fresh = run.zeros()
        ds.DeltaFetcher(spy).sync(fresh, step=step)
        assert_state_equal(fresh, run.pushed[step], f"coalesced step {step}")


# ------------------------------------------------------------------- (f)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _random_like(t: Any, g: Any) -> Any:
    """Random bits of ``t``'s dtype and shape (NaNs, infs, -0.0 included; 0/1 for bool)."""
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=g).bool()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    info = torch.iinfo(width)
    raw = torch.randint(info.min, info.max, t.shape, generator=g, dtype=width)
    return raw.view(t.dtype)


def dtype_states(steps: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(11)
    first: dict[str, Any] = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        first[f"{name}.matrix"] = _random_like(torch.empty(33, 17, dtype=dt), g)
    first["scalar.f32"] = _random_like(torch.empty((), dtype=torch.float32), g)
    first["scalar.i64"] = torch.tensor(5, dtype=torch.int64)
    first["empty.bf16"] = torch.empty(0, 4, dtype=torch.bfloat16)
    first["empty.i8"] = torch.empty(0, dtype=torch.int8)
    out = [first]
    for step in range(1, steps):
        cur = snapshot(out[-1])
        for t in cur.values():
            flat = t.view(-1)
            if step == 2 or flat.numel() == 0:  # step 2 changes nothing at all
                continue
            frac = 1.0 if step == 4 else float(torch.rand((), generator=g)) * 0.3  # step 4 changes everything
            n = max(1, int(flat.numel() * frac))
            idx = torch.randperm(flat.numel(), generator=g)[:n]
            flat[idx] = _random_like(flat[idx], g)
        out.append(cur)
    return out


def test_every_dtype_syncs_bit_exactly(tmp_path: Path) -> None:
    ss = dtype_states(7)
    store = ds.LocalStore(tmp_path / "dtypes", fsync=False)
    with ds.DeltaUploader(store, anchor_every=4, anchor_bytes_fraction=0, on_backlog="block") as up:
        infos = [up.push(s, i).result(WAIT) for i, s in enumerate(ss)]
    assert [i.kind for i in infos] == ["anchor", "patch", "patch", "patch", "anchor", "patch", "patch"]
    assert infos[2].changed == 0
    f = ds.DeltaFetcher(store)
    target = {k: torch.zeros_like(v) for k, v in ss[0].items()}
    for step, want in enumerate(ss):
        f.sync(target, step=step)
        assert_state_equal(target, want, f"dtypes step {step}")
    for step in (6, 1, 3, 0):  # jumps, also backwards
        fresh = {k: torch.zeros_like(v) for k, v in ss[0].items()}
        ds.DeltaFetcher(store).sync(fresh, step=step)
        assert_state_equal(fresh, ss[step], f"dtypes fresh step {step}")
    out = f.materialize(tmp_path / "dtypes-ckpt", step=5)
    assert_state_equal(load_checkpoint_dir(out), ss[5], "dtypes materialized")
