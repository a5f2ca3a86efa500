"""ASGI middleware that bounds request bodies (413), declared or streamed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "BodyLimit", "body_cut", "limit_body"]

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


_SCOPE_KEY = "deltasync.body_limit"


class _BodyState:
    """What :func:`limit_body` keeps in the scope (an object, so that copies of the scope share it)."""

    __slots__ = ("cut", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.cut = False


def body_cut(scope: MutableMapping[str, Any]) -> int | None:
    """The limit in bytes if :func:`limit_body` cut this request's body short, else None."""
    state = scope.get(_SCOPE_KEY)
    return state.max_bytes if isinstance(state, _BodyState) and state.cut else None


# the answers that say nothing about the body: they pass even when the body was cut
_BODY_BLIND = frozenset({401, 403, 404, 405})


def limit_body(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 (declared or streamed).

    The refusal waits for the app, so that it can authenticate first: a body over
    the limit (a declared ``Content-Length`` at once, a streamed one at the chunk
    that crosses it) ends there for the app (an empty last chunk; nothing past
    the limit is read) and :func:`body_cut` says so, which the app must check
    before it uses the body (the signal server's routes answer 401/403 first,
    then 413). Whatever the app answers then, other than 401, 403, 404 or 405,
    is replaced by the 413: a cut body never gets another answer.
    """

    async def too_large(send: Callable[[Any], Awaitable[None]]) -> None:
        body = json.dumps({"detail": f"request body exceeds {max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def middleware(
        scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        # bytes.isdigit() is ASCII-only; the length check keeps int() clear of its digit limit
        declared_too_large = any(
            k == b"content-length" and (not v.isdigit() or len(v) > 20 or int(v) > max_bytes)
            for k, v in scope.get("headers", [])
        )
        state = scope[_SCOPE_KEY] = _BodyState(max_bytes)
        seen = 0
        started = False
        replaced = False

        async def limited_receive() -> Any:
            nonlocal seen
            if state.cut:
                return {"type": "http.disconnect"}  # the body is over: nothing more is read
            msg = await receive() if not declared_too_large else None
            if msg is not None and msg["type"] != "http.request":
                return msg
            seen += len(msg.get("body", b"")) if msg is not None else 0
            if msg is not None and seen <= max_bytes:
                return msg
            state.cut = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def guarded_send(msg: Any) -> None:
            nonlocal started, replaced
            if replaced:
                return
            if msg["type"] == "http.response.start" and not started:
                started = True
                if state.cut and msg["status"] not in _BODY_BLIND:
                    replaced = True
                    await too_large(send)
                    return
            await send(msg)

        await app(scope, limited_receive, guarded_send)

    return middleware


class BodyLimit:
    """Starlette-style middleware class around :func:`limit_body` (``app.add_middleware(BodyLimit, max_bytes=...)``)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._inner = limit_body(app, max_bytes)

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        await self._inner(scope, receive, send)
