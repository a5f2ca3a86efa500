"""Bearer-token scopes: ``publish`` (write; grants every scope), ``subscribe`` (read) and ``report``
(a receiver reporting to the fleet view).

``report`` takes the ``report_token`` when the server has one, else the ``subscribe`` scope's
tokens: a receiver holds a subscribe token already, and a report changes nothing but the fleet
view. Set a report token where readers must not be able to speak for replicas.
"""

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
from deltasync.server._settings import Settings

__all__ = ["AUTH_RESPONSES", "Publish", "Report", "Subscribe", "require"]

_bearer = HTTPBearer(auto_error=False, description="publish, subscribe or report token")


def _same(given: str, expected: str) -> bool:
    # hash first: compare_digest is constant-time only for equal lengths
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def _auth_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status, detail, headers={"WWW-Authenticate": 'Bearer realm="deltasync"'})


def _wanted(settings: Settings, scope: str) -> list[str | None]:
    """The tokens that grant ``scope``; the first one None means the scope is open."""
    if scope == "publish":
        return [settings.publish_token]
    if scope == "report" and settings.report_token is not None:
        return [settings.report_token, settings.publish_token]
    return [settings.subscribe_token, settings.publish_token]


def require(scope: Literal["publish", "subscribe", "report"]) -> Callable[..., Awaitable[None]]:
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
        wanted = _wanted(settings, scope)
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
Report = Depends(require("report"))

AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is not parseable JSON"},
    401: {"model": Problem, "description": "no bearer token"},
    403: {"model": Problem, "description": "the token lacks this scope"},
    413: {"model": Problem, "description": "request body too large"},
}
