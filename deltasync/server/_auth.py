"""Bearer-token scopes: ``publish`` (write; also grants subscribe) and ``subscribe`` (read)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from deltasync.server._deps import MetricsDep, SettingsDep
from deltasync.server._input import no_unknown_query
from deltasync.server._models import Problem

__all__ = ["AUTH_RESPONSES", "Publish", "Subscribe", "require"]

_bearer = HTTPBearer(auto_error=False, description="publish or subscribe token")


def _same(given: str, expected: str) -> bool:
    # hash first: compare_digest is constant-time only for equal lengths
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def _auth_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status, detail, headers={"WWW-Authenticate": 'Bearer realm="deltasync"'})


def require(scope: Literal["publish", "subscribe"]) -> Callable[..., Awaitable[None]]:
    """A dependency that refuses requests without a token of ``scope`` (401 none, 403 wrong).

    It authenticates first, and only then refuses query parameters the route does
    not declare (422): a request without a valid token learns nothing about its input.
    """

    async def check(
        request: Request,
        settings: SettingsDep,
        metrics: MetricsDep,
        cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        wanted = [settings.publish_token] if scope == "publish" else [settings.subscribe_token, settings.publish_token]
        if wanted[0] is None:  # the scope is open
            no_unknown_query(request)
            return
        if cred is None:
            metrics.inc("deltasync_auth_failures_total", reason="missing")
            raise _auth_error(401, f"this route needs a bearer token of scope {scope!r}")
        ok = False
        for tok in wanted:
            if tok is not None:
                ok |= _same(cred.credentials, tok)  # no short-circuit: same work for every token
        if not ok:
            metrics.inc("deltasync_auth_failures_total", reason="wrong")
            raise _auth_error(403, f"the bearer token does not grant scope {scope!r}")
        no_unknown_query(request)

    return check


Publish = Depends(require("publish"))
Subscribe = Depends(require("subscribe"))

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is not parseable JSON"},
    401: {"model": Problem, "description": "no bearer token"},
    403: {"model": Problem, "description": "the token lacks this scope"},
    413: {"model": Problem, "description": "request body too large"},
}
