"""The runs of the end-to-end scenario: a tiny Qwen3 trained with AdamW, every step pushed to a backend.

Two trainings, each done once per session (fp32 master weights, the bf16 view pushed each step):
``lr1e-3`` changes most bf16 elements every step (big patches, byte-budget anchors), pushed as the
trainer's own bf16 view; ``lr1e-6`` changes a handful (RL-like sparse patches), pushed as the fp32
module through ``cast_dtype``. A :class:`Backend` opens stores of one kind (local dir, memory, S3,
HF bucket) by prefix and pushes each training once into it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qwen3 import make_qwen3, train_steps
from tensors import bf16_view, snapshot

import deltasync as ds
from deltasync.protocol import Manifest, manifest_key

STEPS = 20
WAIT = 120.0
LRS = {"lr1e-3": 1e-3, "lr1e-6": 1e-6}


@dataclass(frozen=True)
class Training:
    """What a trainer pushed at each step: the bf16 states, and for the ``cast_dtype`` path the fp32 masters."""

    name: str
    pushed: list[dict[str, Any]]
    masters: list[dict[str, Any]] | None  # None: the trainer pushes its bf16 view itself

    @property
    def cast(self) -> bool:
        return self.masters is not None


def train(name: str) -> Training:
    """Train the tiny Qwen3 ``STEPS`` AdamW steps at ``LRS[name]``, recording each step."""
    import torch

    lr = LRS[name]
    model = make_qwen3(seed=0)
    pushed: list[dict[str, Any]] = []
    if lr >= 1e-4:
        for _ in train_steps(model, STEPS, lr=lr, seed=1):
            pushed.append(snapshot(bf16_view(model)))
        return Training(name, pushed, None)
    masters: list[dict[str, Any]] = []
    for _ in train_steps(model, STEPS, lr=lr, seed=2):
        pushed.append(bf16_view(model))
        masters.append(snapshot(model))
    assert all(t.dtype == torch.float32 for t in masters[0].values())
    return Training(name, pushed, masters)


def push_training(up: ds.DeltaUploader, training: Training) -> list[Any]:
    """Push every step of ``training`` (the fp32 module through ``cast_dtype``, or the bf16 states); the infos."""
    if training.masters is None:
        futs = [up.push(state, step) for step, state in enumerate(training.pushed)]
    else:
        model = make_qwen3(seed=0)
        futs = []
        for step, master in enumerate(training.masters):
            model.load_state_dict(master)
            futs.append(up.push(model, step))  # returns once the module is snapshotted
    return [f.result(WAIT) for f in futs]


@dataclass
class Run:
    """A training pushed to ``prefix`` of a backend, with the infos of its pushes."""

    name: str
    backend: Backend
    prefix: str
    training: Training
    infos: list[Any] = field(default_factory=list)

    @property
    def pushed(self) -> list[dict[str, Any]]:
        return self.training.pushed

    def store(self) -> ds.Store:
        """A new store object (a new connection) on the run."""
        return self.backend.open(self.prefix)

    def zeros(self) -> dict[str, Any]:
        import torch

        return {k: torch.zeros_like(v) for k, v in self.pushed[0].items()}


@dataclass
class Backend:
    """Stores of one kind, opened by prefix; the scenario's runs are pushed into it once."""

    name: str
    open: Callable[[str], ds.Store]
    _runs: dict[str, Run] = field(default_factory=dict)
    _prefixes: itertools.count[int] = field(default_factory=itertools.count)

    def new_prefix(self, what: str) -> str:
        return f"{what}-{next(self._prefixes)}"

    def push(self, training: Training, what: str, anchor_every: int = 5, **options: Any) -> Run:
        """Push ``training`` to a new prefix, as a trainer does (``on_backlog="block"``)."""
        import torch

        run = Run(training.name, self, self.new_prefix(what), training)
        cast = torch.bfloat16 if training.cast else None
        with (
            run.store() as store,
            ds.DeltaUploader(store, anchor_every=anchor_every, on_backlog="block", cast_dtype=cast, **options) as up,
        ):
            run.infos = push_training(up, training)
        return run

    def runs(self, trainings: dict[str, Training]) -> dict[str, Run]:
        """The scenario's runs (``anchor_every=5``, one per training), pushed on first use."""
        for name, training in trainings.items():
            if name not in self._runs:
                self._runs[name] = self.push(training, name)
        return self._runs


def manifests(store: ds.Store) -> dict[int, Manifest]:
    """Every committed step's manifest."""
    f = ds.DeltaFetcher(store)
    return {s: Manifest.from_json(store.get(manifest_key(s))) for s in f.steps()}


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


def assert_no_torn_manifest(store: ds.Store) -> list[int]:
    """Every committed step lists only files that exist with the listed sizes; returns the steps.

    Steps first, then the listing: a manifest seen earlier had all its files before it, so a
    later listing must show them even while an uploader is writing.
    """
    steps = ds.DeltaFetcher(store).steps()
    listing = {o.key: o.size for o in store.list("steps/")}
    for s in steps:
        m = Manifest.from_json(store.get(manifest_key(s)))
        for fi in m.files:
            key = f"steps/{s:012d}/{fi.path}"
            assert listing.get(key) == fi.size, (
                f"step {s}: manifest lists {key} ({fi.size} B), store has {listing.get(key)}"
            )
    return steps
