"""The acceptance scenario: a tiny Qwen3 trained with AdamW, every step pushed, fetched bit-exactly.

Two runs are trained once per module (fp32 master weights, the bf16 view pushed each step):
``lr1e-3`` changes most bf16 elements every step (big patches, byte-budget anchors),
``lr1e-6`` changes a handful (RL-like sparse patches, pushed through ``cast_dtype``).
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from qwen3 import make_qwen3, qwen3_config, train_steps
from spy_store import SpyStore, step_of_key
from tensors import assert_state_equal, bf16_view, bits_equal, snapshot

import deltasync as ds
from deltasync.errors import InventoryMismatch, StorageError
from deltasync.protocol import Manifest, manifest_key

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

STEPS = 20
WAIT = 60.0


@dataclass
class Run:
    """A trained run: its store and a copy of every pushed (bf16) state."""

    name: str
    root: Path
    pushed: list[dict[str, Any]] = field(default_factory=list)
    infos: list[Any] = field(default_factory=list)

    def store(self) -> ds.LocalStore:
        return ds.LocalStore(self.root, fsync=False)

    def zeros(self) -> dict[str, Any]:
        return {k: torch.zeros_like(v) for k, v in self.pushed[0].items()}


def _train_run(root: Path, name: str, lr: float) -> Run:
    run = Run(name, root)
    model = make_qwen3(seed=0)
    store = run.store()
    if lr >= 1e-4:
        # the trainer hands over its own bf16 view
        with ds.DeltaUploader(store, anchor_every=5, on_backlog="block") as up:
            futs = []
            for step in train_steps(model, STEPS, lr=lr, seed=1):
                state = bf16_view(model)
                run.pushed.append(snapshot(state))
                futs.append(up.push(state, step))
            run.infos = [f.result(WAIT) for f in futs]
    else:
        # the uploader casts the fp32 master weights of the module itself
        with ds.DeltaUploader(store, anchor_every=5, on_backlog="block", cast_dtype=torch.bfloat16) as up:
            futs = []
            for step in train_steps(model, STEPS, lr=lr, seed=2):
                run.pushed.append(bf16_view(model))
                futs.append(up.push(model, step))
            run.infos = [f.result(WAIT) for f in futs]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("e2e")
    return {
        "lr1e-3": _train_run(base / "lr1e-3", "lr1e-3", 1e-3),
        "lr1e-6": _train_run(base / "lr1e-6", "lr1e-6", 1e-6),
    }


@pytest.fixture(params=["lr1e-3", "lr1e-6"])
def run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    return runs[request.param]


def manifests(store: ds.Store) -> dict[int, Manifest]:
    f = ds.DeltaFetcher(store)
    return {s: Manifest.from_json(store.get(manifest_key(s))) for s in f.steps()}


# ------------------------------------------------------------------- (a)


def test_run_is_committed_as_pushed(run: Run) -> None:
    infos = run.infos
    assert [i.step for i in infos] == list(range(STEPS))
    assert [i.committed_step for i in infos] == list(range(STEPS))
    assert infos[0].kind == "anchor"
    assert {i.kind for i in infos} == {"anchor", "patch"}
    # anchor_every=5: never more than 4 patches in a row
    streak = 0
    for i in infos:
        streak = streak + 1 if i.kind == "patch" else 0
        assert streak <= 4
    ms = manifests(run.store())
    assert sorted(ms) == list(range(STEPS))
    for i in infos:
        m = ms[i.step]
        assert (m.kind, m.anchor_step, m.stats.nbytes) == (i.kind, i.anchor_step, i.nbytes)
        changed = (
            sum(
                int((a.view(torch.int16) != b.view(torch.int16)).sum())
                for a, b in zip(run.pushed[i.step - 1].values(), run.pushed[i.step].values(), strict=True)
            )
            if i.kind == "patch"
            else i.total
        )
        assert i.changed == changed
    if run.name == "lr1e-6":
        # RL-like: few elements change, patches are tiny next to the anchors
        patches = [i for i in infos if i.kind == "patch"]
        assert max(i.changed for i in patches) < 0.05 * infos[0].total
        assert max(i.nbytes for i in patches) < 0.1 * infos[0].nbytes


def test_fresh_fetcher_reaches_every_step(run: Run) -> None:
    f = ds.DeltaFetcher(run.store())
    assert f.steps() == list(range(STEPS)) and f.latest_step() == STEPS - 1
    target = run.zeros()
    for step in range(STEPS):
        assert f.sync(target, step=step) == step
        assert f.current_step(target) == step
        assert_state_equal(target, run.pushed[step], f"{run.name} step {step}")
    assert f.sync(target) == STEPS - 1  # latest, already there


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


# ------------------------------------------------------------------- (b)


def expected_downloads(ms: dict[int, Manifest], have: int, target: int) -> set[int]:
    """The steps whose files the cheapest plan from ``have`` to ``target`` must download."""
    chain = [target]
    while ms[chain[-1]].kind != "anchor":
        parent = ms[chain[-1]].parent_step
        assert parent is not None
        chain.append(parent)
    from_anchor = set(chain)
    if have not in chain:
        return from_anchor
    forward = {s for s in chain if s > have}
    nbytes = {s: ms[s].total_bytes for s in chain}
    return forward if sum(nbytes[s] for s in forward) <= sum(nbytes[s] for s in from_anchor) else from_anchor


@pytest.mark.parametrize(("have", "to"), [(7, 18), (6, 9), (11, 13)])
def test_second_sync_downloads_only_what_it_needs(run: Run, have: int, to: int) -> None:
    spy = SpyStore(run.store())
    f = ds.DeltaFetcher(spy)
    target = run.zeros()
    f.sync(target, step=have)
    assert_state_equal(target, run.pushed[have])
    spy.reset()
    f.sync(target, step=to)
    assert_state_equal(target, run.pushed[to], f"{run.name} {have}->{to}")
    ms = manifests(run.store())
    want = expected_downloads(ms, have, to)
    got = spy.data_gets()
    assert len(got) == len(set(got)), "a file was downloaded twice"
    assert {step_of_key(k) for k in got} == want
    want_keys = {f"steps/{s:012d}/{fi.path}" for s in want for fi in ms[s].files}
    assert set(got) == want_keys
    if run.name == "lr1e-6" and (have, to) in ((6, 9), (11, 13)):
        assert all(ms[s].kind == "patch" for s in want), "patching forward is cheaper here"


def test_resume_from_7_to_18_over_a_long_chain(runs: dict[str, Run], tmp_path: Path) -> None:
    """Without an anchor between them, 7 -> 18 is eleven small patches, not anchor + 18 patches."""
    run = runs["lr1e-6"]
    store = ds.LocalStore(tmp_path / "long", fsync=False)
    # no spans: this is about the patch chain (tests/test_spans.py covers catching up through spans)
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0, on_backlog="block", span_levels=()) as up:
        for step, state in enumerate(run.pushed):
            up.push(state, step)
    spy = SpyStore(store)
    f = ds.DeltaFetcher(spy)
    target = run.zeros()
    f.sync(target, step=7)
    spy.reset()
    assert f.sync(target, step=18) == 18
    assert_state_equal(target, run.pushed[18])
    assert {step_of_key(k) for k in spy.data_gets()} == set(range(8, 19))
    # a new fetcher told where the target is (and verifying that claim) does the same
    spy.reset()
    target2 = snapshot(run.pushed[7])
    ds.DeltaFetcher(spy).sync(target2, step=18, have_step=7)
    assert_state_equal(target2, run.pushed[18])
    assert {step_of_key(k) for k in spy.data_gets()} == set(range(8, 19))
    # ... but a false claim is caught: the target is loaded from the anchor instead
    spy.reset()
    target3 = snapshot(run.pushed[6])
    ds.DeltaFetcher(spy).sync(target3, step=18, have_step=7)
    assert_state_equal(target3, run.pushed[18])
    assert 0 in {step_of_key(k) for k in spy.data_gets()}


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


def test_materialize_refuses_foreign_dirs(runs: dict[str, Run], tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(StorageError, match="refusing to replace"):
        ds.DeltaFetcher(runs["lr1e-6"].store()).materialize(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------- (d)


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
