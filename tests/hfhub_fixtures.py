"""Fixtures for tests against the fake Hub (``tests/fakehub.py``); import them into a test module.

``fake_hub`` is one server per session (one local CAS: hf_xet takes a per-transfer lock,
so all transfers stay in this process). ``hf_bucket`` is a fresh bucket per test;
``hf_env`` points ``open_store("hf://...")`` and the CLI at the fake Hub.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub

from deltasync.storage import HFBucketStore

TOKEN = "hf_fake_token"
_names = itertools.count()


@pytest.fixture(scope="session")
def fake_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """One fake Hub for the whole session, with progress bars off."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    with FakeHub(tmp_path_factory.mktemp("fakehub"), token=TOKEN, page_size=50) as hub:
        yield hub
    if not was_disabled:
        enable_progress_bars()


def new_bucket(hub: FakeHub) -> str:
    """A fresh, empty bucket id on ``hub``."""
    bucket_id = f"ns/bucket-{next(_names)}"
    hub.create_bucket(bucket_id)
    return bucket_id


@pytest.fixture
def hf_bucket(fake_hub: FakeHub) -> Iterator[str]:
    """A fresh bucket; faults left by the test are cleared afterwards."""
    yield new_bucket(fake_hub)
    fake_hub.clear_faults()


def hf_store(hub: FakeHub, bucket_id: str, prefix: str = "run", **kw: object) -> HFBucketStore:
    return HFBucketStore(bucket_id, prefix, endpoint=hub.endpoint, token=TOKEN, **kw)  # type: ignore[arg-type]


@pytest.fixture
def hf_env(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """``DELTASYNC_HF_ENDPOINT`` and ``HF_TOKEN`` set for the fake Hub."""
    monkeypatch.setenv("DELTASYNC_HF_ENDPOINT", fake_hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return fake_hub


def raw_path(store: HFBucketStore, key: str) -> str:
    return f"{store.prefix}/{key}" if store.prefix else key


_ = Path
