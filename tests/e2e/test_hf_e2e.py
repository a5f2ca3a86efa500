"""HF Storage Buckets (fake Hub, real huggingface_hub + hf_xet): what only this backend shows, faults, CLI.

* the scenario of ``test_e2e.py`` (run there on every backend, ``hf`` included) really puts its
  objects in the fake Hub's bucket, under the prefix;
* under injected 5xx / 429 / partial ``/batch`` failures / slow responses no committed
  step is torn or lost; a step whose writes keep failing resolves with CommitFailed and
  the next push is an anchor; no manifest ever lists a missing file;
* ``delta-upload --store hf://...``, ``deltasync inspect hf://...`` and ``deltasync fetch``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from e2e_runs import WAIT, Run, assert_no_torn_manifest
from fakehub import TOKEN, FakeHub, hf_store, new_bucket
from tensors import assert_state_equal

import deltasync as ds
from deltasync.errors import CommitFailed, TransientStorageError
from deltasync.protocol import manifest_key
from deltasync.storage import HFBucketStore

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

#: the tests on the scenario's runs take them from the fake Hub
HF = pytest.mark.parametrize("backend", ["hf"], indirect=True)


@HF
def test_run_is_committed_in_the_bucket(runs: dict[str, Run], fake_hub: FakeHub) -> None:
    run = runs["lr1e-6"]
    store = run.store()
    assert isinstance(store, HFBucketStore) and store.prefix == f"runs/{run.prefix}"
    # the objects really are in the fake Hub's bucket, under the prefix
    entry = fake_hub.file_entry(store.bucket_id, f"runs/{run.prefix}/{manifest_key(7)}")
    assert entry is not None and entry[1] == len(store.get(manifest_key(7)))


# ------------------------------------------------------------------ faults


def _states(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    s = {"w": torch.randn(4096, generator=g).to(torch.bfloat16), "b": torch.randn(128, generator=g)}
    out = [s]
    for _ in range(1, n):
        nxt = {k: v.clone() for k, v in out[-1].items()}
        nxt["w"][torch.randperm(4096, generator=g)[:100]] += 1
        out.append(nxt)
    return out


def _check_fetchable(store: ds.Store, pushed: dict[int, dict[str, Any]]) -> None:
    for step, want in pushed.items():
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        ds.DeltaFetcher(store).sync(target, step=step)
        assert_state_equal(target, want, f"step {step}")


def test_faults_are_retried_and_nothing_is_torn(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    ss = _states(8)
    up = ds.DeltaUploader(store, anchor_every=100, retries=4, retry_backoff=0.01, on_backlog="block")
    # a reader polls the bucket all along: it must never see a manifest whose files are missing
    stop, seen, problems = threading.Event(), set(), []

    def watch() -> None:
        reader = hf_store(fake_hub, hf_bucket)
        for _ in range(10_000):
            if stop.is_set():
                return
            try:
                seen.update(assert_no_torn_manifest(reader))
            except AssertionError as exc:
                problems.append(str(exc))
                return
            except ds.errors.StorageError:
                continue  # an injected fault hit the reader: fine, try again

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert up.push(ss[0], 0).result(WAIT).kind == "anchor"
        fake_hub.fail_batch_paths(r"steps/000000000001/patch-")  # step 1: data batch partly fails
        assert up.push(ss[1], 1).result(WAIT).kind == "patch"
        fake_hub.fail_batch_paths(r"steps/000000000002/manifest\.json$", times=2)  # manifest fails twice
        assert up.push(ss[2], 2).result(WAIT).kind == "patch"
        fake_hub.fail(r"/batch$", method="POST", status=503)  # the Hub client's own backoff
        assert up.push(ss[3], 3).result(WAIT).kind == "patch"
        fake_hub.fail(r"/paths-info$", method="POST", status=429, retry_after=0)
        assert up.push(ss[4], 4).result(WAIT).kind == "patch"
        fake_hub.slow(r"/batch$", 0.3, times=2)
        assert up.push(ss[5], 5).result(WAIT).kind == "patch"
        assert up.failures == 0
    finally:
        up.close()
        stop.set()
        watcher.join(60)
    assert not problems, problems
    assert seen, "the watcher never saw a committed step"
    assert assert_no_torn_manifest(store) == [0, 1, 2, 3, 4, 5]
    _check_fetchable(store, dict(enumerate(ss[:6])))


def test_persistent_failure_gives_commit_failed_then_an_anchor(fake_hub: FakeHub, hf_bucket: str) -> None:
    store = hf_store(fake_hub, hf_bucket)
    ss = _states(6)
    with ds.DeltaUploader(store, anchor_every=100, retries=2, retry_backoff=0.01, on_backlog="block") as up:
        up.push(ss[0], 0).result(WAIT)
        up.push(ss[1], 1).result(WAIT)
        fake_hub.fail_batch_paths(r"steps/000000000002/manifest\.json$", times=3)  # > retries
        with pytest.raises(CommitFailed, match=r"step 2: writing its manifest: gave up after 3 attempts") as info:
            up.push(ss[2], 2).result(WAIT)
        assert isinstance(info.value.__cause__, TransientStorageError)
        assert "injected failure" in str(info.value)
        # the data files of step 2 are orphans without a manifest: fetchers never see the step
        assert store.list("steps/000000000002/") and not store.exists(manifest_key(2))
        i3 = up.push(ss[3], 3).result(WAIT)
        i4 = up.push(ss[4], 4).result(WAIT)
    assert (i3.kind, i3.anchor_step, i4.kind) == ("anchor", 3, "patch")
    assert assert_no_torn_manifest(store) == [0, 1, 3, 4]
    _check_fetchable(store, {0: ss[0], 1: ss[1], 3: ss[3], 4: ss[4]})
    head = json.loads(store.get("HEAD.json"))
    assert head["step"] == 4


@HF
def test_fetcher_reads_through_faults(runs: dict[str, Run], fake_hub: FakeHub) -> None:
    hf_run, hub = runs["lr1e-6"], fake_hub
    hub.fail(r"/paths-info$", method="POST", status=500)
    hub.fail(r"/tree", method="GET", status=429, retry_after=0)
    try:
        target = hf_run.zeros()
        assert ds.DeltaFetcher(hf_run.store()).sync(target, step=12) == 12
        assert_state_equal(target, hf_run.pushed[12])
    finally:
        hub.clear_faults()


# ------------------------------------------------------------------ CLI


def test_cli_upload_inspect_fetch(
    hf_env: FakeHub, hf_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltasync._util.checkpoint_io import load_checkpoint, save_checkpoint
    from deltasync.cli import main, upload_main

    url = f"hf://buckets/{hf_bucket}/cli-run"
    ss = _states(3)
    cache = tmp_path / "cache"
    for step, state in enumerate(ss):
        ckpt = tmp_path / f"ckpt-{step}.safetensors"
        save_checkpoint(state, ckpt)
        assert upload_main([str(ckpt), "--store", url, "--step", str(step), "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "step 0: anchor" in out and "step 2: patch" in out
    assert main(["inspect", url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in table[1:]] == [["0", "anchor"], ["1", "patch"], ["2", "patch"]]
    assert main(["fetch", "--store", url, "--out", str(tmp_path / "out"), "--step", "1"]) == 0
    assert "wrote step 1" in capsys.readouterr().out
    got = load_checkpoint(tmp_path / "out")
    assert_state_equal(got, ss[1], "fetched via CLI")
    # a bad token is one clear error line naming the token to set
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["inspect", url]) == 1
    assert "HF_TOKEN" in capsys.readouterr().err


def test_cli_in_subprocesses(tmp_path: Path) -> None:
    """The installed entry points, one process per command, configured by environment only.

    A separate fake Hub and CAS: hf_xet's local CAS stays locked by the process whose
    Xet session opened it, so this test's processes must not share the session-wide one.
    """
    from deltasync._util.checkpoint_io import load_checkpoint, save_checkpoint

    ss = _states(2)
    for step, state in enumerate(ss):
        save_checkpoint(state, tmp_path / f"ckpt-{step}.safetensors")
    with FakeHub(tmp_path / "hub", token=TOKEN) as hub:
        bucket_id = new_bucket(hub)
        env = {
            **os.environ,
            "DELTASYNC_HF_ENDPOINT": hub.endpoint,
            "HF_TOKEN": TOKEN,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        }
        url = f"hf://buckets/{bucket_id}/sub/run"

        def run(*args: str) -> str:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from deltasync.cli import main, upload_main; sys.exit(main())",
                    *args,
                ]
                if args[0] != "delta-upload"
                else [
                    sys.executable,
                    "-c",
                    "import sys; from deltasync.cli import upload_main; sys.exit(upload_main())",
                    *args[1:],
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
            assert proc.returncode == 0, proc.stderr
            return proc.stdout

        assert "step 0: anchor" in run(
            "delta-upload", str(tmp_path / "ckpt-0.safetensors"), "--store", url, "--step", "0"
        )
        assert "step 1: patch" in run(
            "delta-upload", str(tmp_path / "ckpt-1.safetensors"), "--store", url, "--step", "1"
        )
        rows = [line.split()[:3] for line in run("inspect", url).splitlines()[1:]]
        assert rows == [["0", "anchor", "-"], ["1", "patch", "0"]]
        assert "wrote step 1" in run("fetch", "--store", url, "--out", str(tmp_path / "out"))
    assert_state_equal(load_checkpoint(tmp_path / "out"), ss[1], "fetched by a subprocess")
