"""What the signal server accepts from a request; anything else is a 4xx, never a 500.

- JSON bodies are parsed here, strictly, before pydantic sees them
  (:func:`strict_json_loads`): UTF-8 only, no duplicate keys, no ``NaN`` /
  ``Infinity`` / ``-Infinity``, no number that overflows to infinity, no integer
  longer than 19 digits, no lone surrogate (``"\\ud800"``) in any string or key.
  A refusal is FastAPI's usual 422 ``json_invalid`` error, raised only after the
  route's auth dependency passed (:class:`StrictRoute`): authentication comes first.
- Numbers in queries and headers are ASCII digits only (:data:`ASCII_INT`,
  :data:`ASCII_FLOAT`, :func:`parse_last_event_id`): ``"²"``, ``"１２"``, ``"1_0"``,
  ``" 1"`` and ``"+1"`` are refused; every one is range-checked by its field.
- Query parameters a route does not declare are refused (:func:`no_unknown_query`, called by
  the auth dependency once the token is accepted).
- 422 replies echo the offending input made JSON-safe (:func:`validation_error_reply`),
  so that a reply can always be encoded whatever the request held.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from deltasync.protocol.keys import MAX_STEP
from deltasync.server._limits import body_cut

__all__ = [
    "ASCII_FLOAT",
    "ASCII_INT",
    "StrictRoute",
    "no_unknown_query",
    "parse_last_event_id",
    "strict_json_loads",
    "validation_error_reply",
]

_SURROGATE = re.compile("[\ud800-\udfff]")
#: the escapes that decode to a surrogate (``\\ud800`` to ``\\udfff``); a text without them or a raw
#: surrogate has no string that holds one
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_MAX_INT_DIGITS = 19  # a signed 64-bit integer; nothing the server takes is larger
# re's [0-9] is ASCII only (\d would also match "１" and "٣")
_INT = re.compile(rf"-?[0-9]{{1,{_MAX_INT_DIGITS}}}")
_FLOAT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?")
_STEP = re.compile(r"[0-9]{1,13}")


class _Refused(ValueError):
    """A JSON body that parses but is not acceptable (turned into a JSONDecodeError)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Refused(f"duplicate key {key!r}")  # repr: ASCII-safe even for a lone surrogate
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _Refused(f"integer with {len(text)} characters is out of range")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is out of range")
    return value


def _check_strings(value: Any) -> None:
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise _Refused(f"string {v[:40]!r} holds a lone surrogate (not Unicode)")
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def strict_json_loads(raw: bytes | str) -> Any:
    """Parse a request body as RFC 8259 JSON, refusing what Python's ``json`` would let through.

    Raises ``json.JSONDecodeError`` (a ValueError) for anything that is not
    UTF-8 JSON of finite numbers, unique keys and valid Unicode strings.
    """
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")  # strict: an encoded surrogate (b"\xed\xa0\x80") is refused too
        except UnicodeDecodeError as exc:
            doc = raw.decode("utf-8", "replace")
            raise json.JSONDecodeError(f"body is not UTF-8: {exc.reason}", doc, exc.start) from exc
    else:
        text = raw
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
            parse_int=_bounded_int,
            parse_float=_finite_float,
        )
        if _SURROGATE.search(text) or _ESCAPED_SURROGATE.search(text):  # else no string can hold one
            _check_strings(value)
    except json.JSONDecodeError:
        raise
    except _Refused as exc:
        raise json.JSONDecodeError(str(exc), _safe_text(text), 0) from exc
    except (ValueError, RecursionError) as exc:
        raise json.JSONDecodeError(f"{type(exc).__name__}: {exc}", _safe_text(text), 0) from exc
    return value


# ----------------------------------------------------------- the route class


class _Unparsed:
    """What :meth:`_StrictJSONRequest.json` hands FastAPI for a body it refused (never validated)."""

    def __init__(self, error: json.JSONDecodeError) -> None:
        self.error = error


class _StrictJSONRequest(Request):
    """A Request whose ``json()`` is :func:`strict_json_loads` (FastAPI parses bodies through it).

    FastAPI reads the body before it solves any dependency, so a refused body is
    not raised here: ``json()`` returns an :class:`_Unparsed` that
    :func:`_body_accepted` raises once the route's auth dependency has passed.
    """

    async def json(self) -> Any:
        # docstring inherited
        if not hasattr(self, "_json"):
            try:
                self._json: Any = strict_json_loads(await self.body())
            except json.JSONDecodeError as exc:
                self._json = _Unparsed(exc)
        return self._json


async def _body_accepted(request: Request) -> None:
    """413 for a body :func:`~deltasync.server._limits.limit_body` cut short; 422 ``json_invalid``
    (FastAPI's own shape) for one :func:`strict_json_loads` refused."""
    limit = body_cut(request.scope)
    if limit is not None:
        raise HTTPException(413, f"request body exceeds {limit} bytes")
    parsed = getattr(request, "_json", None)
    if isinstance(parsed, _Unparsed):
        e = parsed.error
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": e.msg},
                }
            ],
            body=e.doc,
        )


class StrictRoute(APIRoute):
    """An APIRoute whose JSON bodies are parsed by :func:`strict_json_loads` (use as ``route_class``).

    Authentication comes first: a refused body, like every other invalid input,
    is reported (422, or 413 for one over the size limit) only after the route's own dependencies (its auth
    requirement) have passed, so a request without a valid token always gets
    401/403 whatever its body holds.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # docstring inherited
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        # after the route's dependencies (auth), before its parameters and body are validated
        kwargs["dependencies"] = [*(kwargs.get("dependencies") or []), Depends(_body_accepted)]
        super().__init__(path, endpoint, **kwargs)
        names: set[str] = set()
        todo = [self.dependant]
        while todo:
            dep = todo.pop()
            names.update(p.alias for p in dep.query_params)
            todo.extend(dep.dependencies)
        #: The query parameters this route declares, its dependencies' included.
        self.query_names = frozenset(names)


def no_unknown_query(request: Request) -> None:
    """422 for query parameters the route does not declare (a typo like ``?afer=`` must not pass silently)."""
    route = request.scope.get("route")
    if not request.query_params or not isinstance(route, StrictRoute):
        return
    allowed = route.query_names
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("query", name),
                    "msg": f"unknown query parameter; this route takes {sorted(allowed)}",
                    "input": request.query_params[name],
                }
                for name in unknown
            ]
        )


# ------------------------------------------------------ numbers in URLs and headers


def _ascii_int(v: Any) -> Any:
    if isinstance(v, str):
        if not _INT.fullmatch(v):
            raise PydanticCustomError("int_parsing", "Input should be an integer written in ASCII digits")
        return int(v)
    return v


def _ascii_float(v: Any) -> Any:
    if isinstance(v, str):
        if len(v) > 40 or not _FLOAT.fullmatch(v):
            raise PydanticCustomError("float_parsing", "Input should be a finite decimal number in ASCII")
        return float(v)
    return v


#: Validator of an integer query parameter: ASCII digits with an optional ``-``. Put it after
#: ``Query(ge=, le=)`` in the ``Annotated`` (before it, FastAPI documents the range wrongly).
ASCII_INT = BeforeValidator(_ascii_int)
#: Validator of a float query parameter: ASCII decimal notation, never ``nan`` / ``inf``.
ASCII_FLOAT = BeforeValidator(_ascii_float)


def parse_last_event_id(value: str | None) -> int | None:
    """The step in an SSE ``Last-Event-ID`` header; None when absent or empty (the SSE "no id").

    Event ids are steps: 1-13 ASCII digits up to ``MAX_STEP``; anything else is a 422.
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not _STEP.fullmatch(text) or int(text) > MAX_STEP:
        raise RequestValidationError(
            [
                {
                    "type": "int_parsing",
                    "loc": ("header", "last-event-id"),
                    "msg": f"Last-Event-ID must be a step number: 0 to {MAX_STEP} in ASCII digits",
                    "input": value,
                }
            ]
        )
    return int(text)


# ---------------------------------------------------------------- error replies


def _safe_text(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8") if _SURROGATE.search(s) else s


def _json_safe(v: Any) -> Any:
    """``v`` with what JSON cannot carry made printable: bytes, lone surrogates, NaN / infinities."""
    if isinstance(v, str):
        return _safe_text(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return _safe_text(bytes(v).decode("utf-8", "backslashreplace"))
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, dict):
        return {str(_json_safe(k)): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, BaseException):
        return _safe_text(str(v))
    if v is None or isinstance(v, (bool, int, float)):
        return v
    try:
        return _json_safe(jsonable_encoder(v))
    except Exception:  # an object FastAPI cannot encode: its repr is still worth showing
        return _safe_text(repr(v))


async def validation_error_reply(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 reply (``{"detail": [errors]}``) with every error made JSON-safe."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse({"detail": _json_safe(list(errors))}, status_code=422)
