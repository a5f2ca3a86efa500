"""ASGI middleware that bounds request bodies (413), declared or streamed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "BodyLimit", "limit_body"]

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


def limit_body(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413 (declared or streamed)."""

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
        for k, v in scope.get("headers", []):
            # bytes.isdigit() is ASCII-only; the length check keeps int() clear of its digit limit
            if k == b"content-length" and (not v.isdigit() or len(v) > 20 or int(v) > max_bytes):
                await too_large(send)
                return
        seen = 0
        started = False
        refused = False

        async def limited_receive() -> Any:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > max_bytes:
                    # answer 413 now and tell the app the client went away; whatever it sends is dropped
                    refused = True
                    if not started:
                        await too_large(send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Any) -> None:
            nonlocal started
            if refused:
                return
            started = started or msg["type"] == "http.response.start"
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
