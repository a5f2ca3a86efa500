"""Schemathesis fuzzes every route of the OpenAPI schema (except the endless SSE stream).

Checks: no 5xx, status codes / content types / bodies as documented, invalid input
rejected, valid input accepted, and authentication really enforced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from deltasync.server import Settings, create_app

PUB = "publish-token-schema"

# a large body limit: an oversized fuzzed body would get 413, which Schemathesis does not expect
# for invalid input (the limit has its own test in test_server.py)
SETTINGS = Settings(
    publish_token=PUB, subscribe_token="subscribe-token-schema", max_wait_s=0.05, max_body_bytes=1 << 20
)
app = create_app(SETTINGS)
schema = schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path="/v1/runs/{run}/events")


@schema.parametrize()
@settings(
    max_examples=int(os.environ.get("SCHEMA_EXAMPLES", "40")),
    deadline=None,
    derandomize=not os.environ.get("SCHEMA_EXAMPLES"),
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case: schemathesis.Case) -> None:
    # negative_data_rejection is left out: the valid token passed here turns schemathesis'
    # "missing Authorization" cases into valid requests, and unknown query parameters are
    # ignored by design (FastAPI). Auth failures are tested in test_server.py; malformed
    # bodies and parameters still have to be rejected (status code conformance below).
    case.call_and_validate(
        headers={"Authorization": f"Bearer {PUB}"},
        excluded_checks=[schemathesis.checks.negative_data_rejection],
    )


def test_schema_documents_every_route() -> None:
    paths = set(app.openapi()["paths"])
    assert {
        "/healthz",
        "/metrics",
        "/v1/runs/{run}/commits",
        "/v1/runs/{run}/head",
        "/v1/runs/{run}/events",
        "/v1/runs/{run}/wait",
        "/v1/runs/{run}/webhooks",
        "/v1/runs/{run}/webhooks/{hook_id}",
        "/v1/runs/{run}/rederive",
        "/v1/runs/{run}/fleet",
        "/v1/runs/{run}/replicas/{replica}",
    } <= paths
    assert app.openapi()["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


@pytest.fixture(autouse=True)
def _chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
