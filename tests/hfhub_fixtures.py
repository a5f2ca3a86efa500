"""Fixtures for tests against the fake Hub (``tests/fakehub.py``).

Test modules load them with ``pytest_plugins = ["hfhub_fixtures"]`` and never import
this module directly (helpers live in ``fakehub``). ``fake_hub`` is one server per
session (one local CAS, locked by this process's Xet session: every transfer against
it must come from this process). ``hf_bucket`` is a fresh bucket per test; ``hf_env`` points
``open_store("hf://...")`` and the CLI at the fake Hub.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakehub import TOKEN, FakeHub, new_bucket


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


@pytest.fixture
def hf_bucket(fake_hub: FakeHub) -> Iterator[str]:
    """A fresh bucket; faults left by the test are cleared afterwards."""
    yield new_bucket(fake_hub)
    fake_hub.clear_faults()


@pytest.fixture
def hf_env(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """``DELTASYNC_HF_ENDPOINT`` and ``HF_TOKEN`` set for the fake Hub."""
    monkeypatch.setenv("DELTASYNC_HF_ENDPOINT", fake_hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return fake_hub
