"""The signal server tests: ``deltasync.server`` (the FastAPI app, SignalClient, webhooks).

The area covers the app through FastAPI's TestClient (auth, publish rules, limits, webhooks,
persistence), hostile input (always a 4xx, and the server keeps serving), the server on a real
uvicorn (SSE resume, restart, webhooks over HTTP) and Schemathesis over the OpenAPI schema.

No fixture is shared here: the ``client`` fixtures of test_server (a fresh app per test) and
test_server_hostile (one app per module, seeded with a commit, other limits) are different apps
and stay in their modules, as do the live servers of test_server_live and test_server_hostile.
No root fixture is used. Helper modules: ``server_harness`` (real servers on loopback), ``tensors``.
"""

from __future__ import annotations
