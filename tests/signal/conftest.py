"""The signal tests: ``deltasync.signal`` (StepWatcher: store polling, the SSE stream, reconnect backoff).

The fleet tests (test_fleet, test_fleet_audit) share the fixtures below: a real signal server on
127.0.0.1 per module (started with the `server_harness` helper module) with the module's ``PUB`` and
``SUB`` tokens, a run named after the test, and a trainer's client.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import ThreadServer

from deltasync.server import Settings, create_app
from deltasync.signal import SignalClient


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ThreadServer]:
    """A real signal server for the module, with its ``PUB``/``SUB`` tokens."""
    tokens = request.module.PUB, request.module.SUB
    with ThreadServer(create_app(Settings(publish_token=tokens[0], subscribe_token=tokens[1]))) as s:
        yield s


@pytest.fixture
def run(request: pytest.FixtureRequest) -> str:
    """A run id of the test's own."""
    return str(request.node.name.replace("[", "-").replace("]", "")[:100])


@pytest.fixture
def trainer(server: ThreadServer, request: pytest.FixtureRequest) -> Iterator[SignalClient]:
    """The trainer's client, with the module's publish token."""
    with SignalClient(server.url, request.module.PUB) as c:
        yield c
