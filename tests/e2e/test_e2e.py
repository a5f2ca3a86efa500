"""The acceptance scenario, on every backend: a tiny Qwen3 trained with AdamW, every step pushed, fetched bit-exactly.

Parametrised over the backends (``local``, ``memory``, ``s3``, ``hf``; see ``tests/e2e/conftest.py``)
and the two runs of ``tests/e2e_runs.py`` (``lr1e-3``: big patches, byte-budget anchors, the
trainer's bf16 view pushed; ``lr1e-6``: RL-like sparse patches, the fp32 module pushed through
``cast_dtype``), both with ``anchor_every=5``. What only one backend can show is beside this file:
``test_e2e_local.py`` (materialize, module targets, tied weights, coalescing, dtypes) and
``test_hf_e2e.py`` (the fake Hub's bucket, injected faults, the CLI).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_runs import STEPS, WAIT, Backend, Run, Training, assert_no_torn_manifest, expected_downloads, manifests
from spy_store import SpyStore, step_of_key
from tensors import assert_state_equal, snapshot

import deltasync as ds
from deltasync.protocol import Manifest, manifest_key, step_prefix

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


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
    with run.store() as store:
        ms = manifests(store)
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
        # what is in the store is exactly the files the manifests list, plus HEAD and the writer claim
        listed = {o.key: o.size for o in store.list()}
        want = {f"steps/{s:012d}/{fi.path}": fi.size for s, m in ms.items() for fi in m.files}
        want.update({f"steps/{s:012d}/manifest.json": len(store.get(f"steps/{s:012d}/manifest.json")) for s in ms})
        assert {k: v for k, v in listed.items() if k != "HEAD.json" and not k.startswith("writers/")} == want
        assert "writers/000000000001.json" in listed
        assert "HEAD.json" in listed
        # every manifest lists only files that are there, with their sizes
        assert assert_no_torn_manifest(store) == list(range(STEPS))
    if run.name == "lr1e-6":
        # RL-like: few elements change, patches are tiny next to the anchors, anchors by count only
        patches = [i for i in infos if i.kind == "patch"]
        assert max(i.changed for i in patches) < 0.05 * infos[0].total
        assert max(i.nbytes for i in patches) < 0.1 * infos[0].nbytes
        assert [i.kind for i in infos] == ["anchor", "patch", "patch", "patch", "patch"] * 4


def test_fresh_fetcher_reaches_every_step(run: Run) -> None:
    # one fetcher, one target, step after step
    with run.store() as store:
        f = ds.DeltaFetcher(store)
        assert f.steps() == list(range(STEPS)) and f.latest_step() == STEPS - 1
        target = run.zeros()
        for step in range(STEPS):
            assert f.sync(target, step=step) == step
            assert f.current_step(target) == step
            assert_state_equal(target, run.pushed[step], f"{run.backend.name} {run.name} step {step}")
        assert f.sync(target) == STEPS - 1  # latest, already there
    # a new fetcher on a new connection, from zeros, every step
    for step in range(STEPS):
        with run.store() as store:
            target = run.zeros()
            assert ds.DeltaFetcher(store).sync(target, step=step) == step
            assert_state_equal(target, run.pushed[step], f"{run.backend.name} {run.name} fresh step {step}")
    with run.store() as store:
        target = run.zeros()
        assert ds.DeltaFetcher(store).sync(target) == STEPS - 1
        assert_state_equal(target, run.pushed[-1], f"{run.backend.name} {run.name} latest")


@pytest.mark.parametrize(("have", "to"), [(7, 18), (6, 9), (11, 13)])
def test_second_sync_downloads_only_what_it_needs(run: Run, have: int, to: int) -> None:
    with run.store() as store:
        spy = SpyStore(store)
        f = ds.DeltaFetcher(spy)
        target = run.zeros()
        f.sync(target, step=have)
        assert_state_equal(target, run.pushed[have])
        spy.reset()
        assert f.sync(target, step=to) == to
        assert_state_equal(target, run.pushed[to], f"{run.backend.name} {run.name} {have}->{to}")
        ms = manifests(store)
        want = expected_downloads(ms, have, to)
        got = spy.data_gets()
        assert len(got) == len(set(got)), "a file was downloaded twice"
        assert {step_of_key(k) for k in got} == want
        want_keys = {f"steps/{s:012d}/{fi.path}" for s in want for fi in ms[s].files}
        assert set(got) == want_keys
        if run.name == "lr1e-6" and (have, to) in ((6, 9), (11, 13)):
            assert all(ms[s].kind == "patch" for s in want), "patching forward is cheaper here"
        if run.name == "lr1e-6" and (have, to) == (7, 18):
            # anchors at 0, 5, 10, 15: the cheapest way to 18 starts from anchor 15
            assert want == {15, 16, 17, 18}
        assert f.sync(target) == STEPS - 1
        assert_state_equal(target, run.pushed[-1], f"{run.backend.name} {run.name} {to}->latest")


def test_a_new_fetcher_resumes_where_the_last_one_stopped(run: Run) -> None:
    with run.store() as store:
        target = run.zeros()
        ds.DeltaFetcher(store).sync(target, step=7)
        assert_state_equal(target, run.pushed[7])
    # the fetcher process is gone; a new one, told where the target is, resumes from there
    with run.store() as store:
        spy = SpyStore(store)
        assert ds.DeltaFetcher(spy).sync(target, step=18, have_step=7) == 18
        assert_state_equal(target, run.pushed[18], "resumed at 18")
        ms = manifests(store)
        got = spy.data_gets()
        assert len(got) == len(set(got)), "a file was downloaded twice"
        assert {step_of_key(k) for k in got} == expected_downloads(ms, 7, 18)


@pytest.mark.parametrize("spans", ["not written", "written, not read"])
def test_resume_from_7_to_18_over_a_long_chain(backend: Backend, trainings: dict[str, Training], spans: str) -> None:
    """Without an anchor between them, 7 -> 18 is eleven small patches, not anchor + 18 patches.

    This is about the patch chain (tests/uploader/test_spans.py covers catching up through spans):
    either the uploader writes no spans, or it writes them and the fetchers do not read them.
    """
    if spans == "not written":
        run = backend.push(trainings["lr1e-6"], "long", anchor_every=100, anchor_bytes_fraction=0, span_levels=())
        options: dict[str, bool] = {}
    else:  # no anchor by count or by the patch-bytes budget
        run = backend.push(trainings["lr1e-6"], "long", anchor_every=100, anchor_bytes_fraction=100.0)
        options = {"spans": False}
    assert [i.kind for i in run.infos] == ["anchor"] + ["patch"] * (STEPS - 1)
    with run.store() as store:
        spy = SpyStore(store)
        f = ds.DeltaFetcher(spy, **options)
        target = run.zeros()
        f.sync(target, step=7)
        spy.reset()
        assert f.sync(target, step=18) == 18
        assert_state_equal(target, run.pushed[18])
        assert {step_of_key(k) for k in spy.data_gets()} == set(range(8, 19))
        # a new fetcher told where the target is (and verifying that claim) does the same
        spy.reset()
        target2 = snapshot(run.pushed[7])
        ds.DeltaFetcher(spy, **options).sync(target2, step=18, have_step=7)
        assert_state_equal(target2, run.pushed[18])
        assert {step_of_key(k) for k in spy.data_gets()} == set(range(8, 19))
        # ... but a false claim is caught: the target is loaded from the anchor instead
        spy.reset()
        target3 = snapshot(run.pushed[6])
        ds.DeltaFetcher(spy, **options).sync(target3, step=18, have_step=7)
        assert_state_equal(target3, run.pushed[18])
        assert 0 in {step_of_key(k) for k in spy.data_gets()}


def test_an_anchor_folder_in_the_store_is_an_hf_checkpoint_dir(
    backend: Backend, trainings: dict[str, Training], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC.md "Anchors": ``steps/<step>/w<writer id>/`` holds the shards and the index that names
    them; downloaded as it is (plus a config.json), transformers' from_pretrained loads it, and
    safetensors loads every shard the index names. Several shards (``shard_bytes=64 KiB``)."""
    from qwen3 import qwen3_config
    from transformers import Qwen3ForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    training = trainings["lr1e-3"]
    states = training.pushed[:3]
    with backend.open(backend.new_prefix("anchor-dir")) as store:
        with ds.DeltaUploader(store, anchor_every=2, shard_bytes=64 << 10, on_backlog="block") as up:
            kinds = [up.push(s, step).result(WAIT).kind for step, s in enumerate(states)]
        assert kinds == ["anchor", "patch", "anchor"]
        for step in (0, 2):
            m = Manifest.from_json(store.get(manifest_key(step)))
            assert m.writer is not None
            own = f"w{m.writer.id}/"
            assert all(f.path.startswith(own) for f in m.files)  # all in the writer's subfolder
            names = sorted(f.path[len(own) :] for f in m.files)
            assert "model.safetensors.index.json" in names and len(names) > 2, names  # index + several shards
            # download the folder as it is
            prefix = step_prefix(step) + own
            objs = store.get_many([o.key for o in store.list(prefix)])
            assert sorted(k[len(prefix) :] for k in objs) == names  # nothing else in it
            folder = tmp_path / f"dl-{step}"
            folder.mkdir()
            for key, data in objs.items():
                (folder / key[len(prefix) :]).write_bytes(data)
            assert_state_equal(safetensors_dir(folder), states[step], f"safetensors step {step}")
            qwen3_config().save_pretrained(folder)
            model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            assert_state_equal(model, states[step], f"from_pretrained step {step}")
            if isinstance(store, ds.LocalStore):  # the store's own folder, in place
                assert_state_equal(safetensors_dir(store.root / prefix), states[step], f"in place, step {step}")


def safetensors_dir(folder: Path) -> dict[str, Any]:
    """Every tensor of an HF sharded checkpoint dir, read with safetensors through its index."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, Any] = {}
    for shard in sorted(set(index["weight_map"].values())):
        assert "/" not in shard, shard  # names relative to the index's folder
        part = load_file(folder / shard)
        assert {index["weight_map"][k] for k in part} == {shard}
        out.update(part)
    assert sorted(out) == sorted(index["weight_map"])
    return out
