"""Fixtures of the uploader tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from spy_store import SpyStore

from deltasync import LocalStore


@pytest.fixture
def spy_store(tmp_path: Path) -> SpyStore:
    """A SpyStore over a LocalStore in ``tmp_path / 'store'``."""
    return SpyStore(LocalStore(tmp_path / "store", fsync=False))
