"""The acceptance scenario over S3 (SeaweedFS on loopback): train, push every step, fetch bit-exactly.

Same scenario as tests/test_e2e.py, with an S3Store in place of the local dir: 20 AdamW steps of
the tiny Qwen3 (fp32 master, bf16 view pushed), ``anchor_every=5``; a fresh fetcher reaches every
step bit-exactly; a fetcher stopped at step 7 resumes to 18 downloading only what it needs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from qwen3 import make_qwen3, train_steps
from spy_store import SpyStore, step_of_key
from tensors import assert_state_equal, bf16_view, snapshot
from test_e2e import STEPS, WAIT, expected_downloads, manifests

import deltasync as ds
from deltasync.storage import S3Store
from deltasync.testing.seaweedfs import SeaweedFS

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@dataclass
class S3Run:
    """A run pushed to ``s3://test/<prefix>``, with a copy of every pushed (bf16) state."""

    server: SeaweedFS
    prefix: str
    pushed: list[dict[str, Any]] = field(default_factory=list)
    infos: list[Any] = field(default_factory=list)

    def store(self) -> S3Store:
        return self.server.store("test", self.prefix)

    def zeros(self) -> dict[str, Any]:
        return {k: torch.zeros_like(v) for k, v in self.pushed[0].items()}


def push_run(server: SeaweedFS, lr: float, anchor_every: int = 5, **options: Any) -> S3Run:
    """Train the tiny Qwen3 and push every step to a new prefix, as tests/test_e2e.py does.

    lr >= 1e-4: the trainer pushes its own bf16 view; below, the uploader casts the fp32 module.
    """
    run = S3Run(server, f"e2e/{uuid.uuid4().hex[:12]}")
    model = make_qwen3(seed=0)
    cast = None if lr >= 1e-4 else torch.bfloat16
    with (
        run.store() as store,
        ds.DeltaUploader(store, anchor_every=anchor_every, on_backlog="block", cast_dtype=cast, **options) as up,
    ):
        futs = []
        for step in train_steps(model, STEPS, lr=lr, seed=1 if cast is None else 2):
            state = bf16_view(model)
            run.pushed.append(snapshot(state))
            futs.append(up.push(state if cast is None else model, step))
        run.infos = [f.result(WAIT) for f in futs]
    return run


@pytest.fixture(scope="module")
def s3_run(s3_server: SeaweedFS) -> S3Run:
    return push_run(s3_server, lr=1e-3)


def test_run_is_committed_as_pushed(s3_run: S3Run) -> None:
    infos = s3_run.infos
    assert [i.committed_step for i in infos] == list(range(STEPS))
    assert infos[0].kind == "anchor" and {i.kind for i in infos} == {"anchor", "patch"}
    streak = 0
    for i in infos:  # anchor_every=5: never more than 4 patches in a row
        streak = streak + 1 if i.kind == "patch" else 0
        assert streak <= 4
    with s3_run.store() as store:
        ms = manifests(store)
        assert sorted(ms) == list(range(STEPS))
        for i in infos:
            assert (ms[i.step].kind, ms[i.step].stats.nbytes) == (i.kind, i.nbytes)
        # what is in the bucket is exactly the files the manifests list, plus HEAD and the writer claim
        listed = {o.key: o.size for o in store.list()}
        want = {f"steps/{s:012d}/{fi.path}": fi.size for s, m in ms.items() for fi in m.files}
        want.update({f"steps/{s:012d}/manifest.json": len(store.get(f"steps/{s:012d}/manifest.json")) for s in ms})
        assert {k: v for k, v in listed.items() if k != "HEAD.json" and not k.startswith("writers/")} == want
        assert "writers/000000000001.json" in listed
        assert "HEAD.json" in listed


def test_fresh_fetcher_reaches_every_step(s3_run: S3Run) -> None:
    for step in range(STEPS):
        with s3_run.store() as store:  # a new fetcher on a new connection, from zeros, every step
            target = s3_run.zeros()
            f = ds.DeltaFetcher(store)
            assert f.sync(target, step=step) == step
            assert_state_equal(target, s3_run.pushed[step], f"s3 step {step}")
    with s3_run.store() as store:
        target = s3_run.zeros()
        assert ds.DeltaFetcher(store).sync(target) == STEPS - 1
        assert_state_equal(target, s3_run.pushed[-1], "s3 latest")


def test_fetcher_stops_at_7_and_resumes_at_18(s3_run: S3Run) -> None:
    with s3_run.store() as store:
        target = s3_run.zeros()
        ds.DeltaFetcher(store).sync(target, step=7)
        assert_state_equal(target, s3_run.pushed[7])
    # the fetcher process is gone; a new one, told where the target is, resumes from there
    with s3_run.store() as store:
        spy = SpyStore(store)
        assert ds.DeltaFetcher(spy).sync(target, step=18, have_step=7) == 18
        assert_state_equal(target, s3_run.pushed[18], "resumed at 18")
        ms = manifests(store)
        got = spy.data_gets()
        assert len(got) == len(set(got)), "a file was downloaded twice"
        assert {step_of_key(k) for k in got} == expected_downloads(ms, 7, 18)


def test_resume_over_a_long_patch_chain(s3_server: SeaweedFS) -> None:
    """With no anchor in between, 7 -> 18 is eleven small patches, not anchor + 18 patches."""
    # RL-like small patches; no anchor by count or by the patch-bytes budget
    long = push_run(s3_server, lr=1e-6, anchor_every=100, anchor_bytes_fraction=100.0)
    with long.store() as store:
        spy = SpyStore(store)
        f = ds.DeltaFetcher(spy, spans=False)  # the patch chain itself (spans: tests/test_spans.py)
        target = long.zeros()
        f.sync(target, step=7)
        spy.reset()
        assert f.sync(target, step=18) == 18
        assert_state_equal(target, long.pushed[18])
        assert [i.kind for i in long.infos] == ["anchor"] + ["patch"] * (STEPS - 1)
        assert {step_of_key(k) for k in spy.data_gets()} == set(range(8, 19))
