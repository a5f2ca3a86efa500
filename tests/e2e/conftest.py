"""Fixtures of the end-to-end tests: the whole of deltasync, uploader -> store -> fetcher, on every backend.

The area covers the acceptance scenario (a tiny Qwen3 trained with AdamW, every step pushed and
fetched bit-exactly), what the fetcher does beyond the store on a local dir, what only HF Storage
Buckets show, the Python API page's snippet (docs/python-api.md) and the quickstart's trainer
(docs/quickstart.md, also in the README).

Fixtures defined here: the trainings (once per session) and the backends they are pushed to.

* ``trainings`` (session): the two trainings of the scenario, by name.
* ``backends`` (session): the backends made so far, by name (each is made once).
* ``backend``: parametrised over every store kind (``local``, ``memory``, ``s3``: SeaweedFS on
  loopback, ``hf``: the fake Hub with the real huggingface_hub + hf_xet); a test that is about
  one backend narrows it with ``@pytest.mark.parametrize("backend", ["hf"], indirect=True)``.
  The S3 server and the fake Hub start only when a test asks for that backend.
* ``runs``: both runs of the scenario on ``backend``, pushed once per session.
* ``run``: one of them (parametrised).

Root fixtures used: ``s3_server`` and ``fake_hub`` (through ``backend``), ``hf_bucket``,
``hf_env``. Helper modules: ``e2e_runs`` (the scenario), ``fakehub``, ``qwen3``, ``spy_store``,
``tensors``.
"""

from __future__ import annotations

import uuid

import pytest
from e2e_runs import LRS, Backend, Run, Training, train
from fakehub import hf_store, new_bucket

import deltasync as ds

BACKENDS = ["local", "memory", "s3", "hf"]


@pytest.fixture(scope="session")
def trainings() -> dict[str, Training]:
    """The two trainings of the scenario, by name (``lr1e-3``, ``lr1e-6``)."""
    pytest.importorskip("torch")
    return {name: train(name) for name in LRS}


@pytest.fixture(scope="session")
def backends() -> dict[str, Backend]:
    """Each backend made once per session, so that its runs are pushed once."""
    return {}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backends: dict[str, Backend]) -> Backend:
    """One store kind (see the module docstring)."""
    name: str = request.param
    if name not in backends:
        if name == "local":
            root = request.getfixturevalue("tmp_path_factory").mktemp("e2e-local")
            backends[name] = Backend(name, lambda prefix: ds.LocalStore(root / prefix, fsync=False))
        elif name == "memory":
            stores: dict[str, ds.MemoryStore] = {}
            backends[name] = Backend(name, lambda prefix: stores.setdefault(prefix, ds.MemoryStore(f"e2e/{prefix}")))
        elif name == "s3":
            server = request.getfixturevalue("s3_server")
            top = f"e2e/{uuid.uuid4().hex[:12]}"
            backends[name] = Backend(name, lambda prefix: server.store("test", f"{top}/{prefix}"))
        elif name == "hf":
            hub = request.getfixturevalue("fake_hub")
            bucket = new_bucket(hub)
            backends[name] = Backend(name, lambda prefix: hf_store(hub, bucket, f"runs/{prefix}"))
        else:
            raise AssertionError(f"unknown backend {name!r}")
    return backends[name]


@pytest.fixture
def runs(backend: Backend, trainings: dict[str, Training]) -> dict[str, Run]:
    """Both runs of the scenario on ``backend`` (``anchor_every=5``), pushed once per session."""
    return backend.runs(trainings)


@pytest.fixture(params=list(LRS))
def run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    """One run of the scenario."""
    return runs[request.param]
