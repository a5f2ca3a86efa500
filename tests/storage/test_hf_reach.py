"""An ``hf://`` store whose endpoint cannot be reached fails within seconds, naming what to check;
one that answers (whatever the status) keeps huggingface_hub's own retries for real transient errors."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_process import TIMEOUT, _script
from fakehub import TOKEN, FakeHub, new_bucket
from server_harness import free_port

from deltasync.errors import TransientStorageError
from deltasync.storage import HFBucketStore
from deltasync.storage._hf_reach import check_reachable


class Spy:
    """A real HfApi that counts the calls made through it."""

    def __init__(self, api: Any) -> None:
        self.api, self.calls = api, 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.api, name)


def spied_store(endpoint: str, bucket: str, sleeps: list[float]) -> tuple[HFBucketStore, Spy]:
    from huggingface_hub import HfApi

    spy = Spy(HfApi(endpoint=endpoint, token=TOKEN))
    probe = functools.partial(check_reachable, sleep=sleeps.append)
    return HFBucketStore(bucket, "run", endpoint=endpoint, token=TOKEN, hf_api=spy, reach_check=probe), spy


def test_a_closed_port_fails_after_two_quick_attempts_without_hub_retries() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sleeps: list[float] = []
    store, spy = spied_store(endpoint, "ns/b", sleeps)
    for call in (store.list, lambda: store.get("HEAD.json"), lambda: store.put("k", b"v")):
        with pytest.raises(TransientStorageError) as info:
            call()
        msg = str(info.value)
        assert msg.startswith(f"hf://buckets/ns/b/run: cannot reach {endpoint} (ConnectError"), msg
        assert "2 attempts" in msg and "HF_ENDPOINT" in msg and "no network connection" in msg
    assert sleeps == [0.5, 0.5, 0.5]  # two attempts per call, one short pause between them
    assert spy.calls == 0  # huggingface_hub (and its 5 retries with 1-8 s backoff) never ran


def test_a_stopped_hub_fails_fast_and_a_running_one_is_asked_once(tmp_path: Path) -> None:
    sleeps: list[float] = []
    with FakeHub(tmp_path / "hub", token=TOKEN) as hub:
        bucket = new_bucket(hub)
        store, spy = spied_store(hub.endpoint, bucket, sleeps)
        store.put("k", b"v")
        assert store.get("k") == b"v" and sleeps == []  # reached at the first attempt
        probes = hub.count("HEAD", r"^/$")
        assert probes == 1  # one probe for the store's life; every later call goes straight to the client
        assert spy.calls > 0
        endpoint = hub.endpoint
    again, spy = spied_store(endpoint, bucket, sleeps)
    with pytest.raises(TransientStorageError, match="cannot reach"):
        again.list()
    assert sleeps == [0.5] and spy.calls == 0


def test_an_answering_hub_keeps_the_client_retries(fake_hub: FakeHub, hf_bucket: str) -> None:
    sleeps: list[float] = []
    store, _ = spied_store(fake_hub.endpoint, hf_bucket, sleeps)
    store.put("k", b"v")
    fault = fake_hub.fail(r"/paths-info$", status=429, retry_after=0)
    assert store.get("k") == b"v" and fault.hits == 1  # a transient error is still retried
    assert sleeps == []


def test_cli_with_no_hub_fails_at_once_naming_the_endpoint(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "HF_ENDPOINT": endpoint, "DELTASYNC_HF_ENDPOINT": "", "HF_TOKEN": TOKEN}
    r = subprocess.run(
        [*_script("deltasync"), "inspect", "hf://buckets/ns/b/run"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1, r
    assert r.stderr.startswith(
        f"store: hf://buckets/ns/b/run\nerror: hf://buckets/ns/b/run: cannot reach {endpoint}"
    ), r.stderr
    assert "HF_ENDPOINT" in r.stderr and "Retrying in" not in r.stderr, r.stderr  # no huggingface_hub retries
