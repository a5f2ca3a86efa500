"""Canonical JSON, and the field checks that every protocol record is read back with (SPEC.md, "Manifest").

Manifests, ``HEAD.json``, writer claims and leases are canonical JSON objects carrying
``format_version``; each parses with :func:`load_json` and :func:`check_version`, then checks
its fields with the ``json_*`` functions, which raise ProtocolError naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deltasync.errors import ProtocolError, UnsupportedVersion

__all__ = [
    "FORMAT_VERSION",
    "HEX32",
    "MANIFEST_VERSION",
    "MANIFEST_VERSIONS",
    "canonical_json",
    "check_version",
    "field_error",
    "json_digest",
    "json_int",
    "json_list",
    "json_object",
    "json_str",
    "load_json",
]

FORMAT_VERSION = 1
#: the manifest format versions this deltasync reads (SPEC.md "Versioning"); HEAD, claims and leases stay 1
MANIFEST_VERSIONS = (1, 2)
#: the manifest format version writers write by default (SPEC.md "Manifest, version 2")
MANIFEST_VERSION = 2
#: the characters of a lower-case hex digest
HEX32 = frozenset("0123456789abcdef")


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes that are digested and signed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def load_json(data: bytes | bytearray | memoryview, what: str, limit: int) -> dict[str, Any]:
    """Parse a JSON object of at most ``limit`` bytes that canonical_json can write back."""
    if len(data) > limit:
        raise ProtocolError(f"{what} is {len(data)} bytes, over the {limit} limit")
    try:
        text = bytes(data).decode("utf-8")
        raw = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        # NaN/Infinity (refused above) and lone surrogates (``"\\ud800"``) parse but cannot be written
        # canonically. UTF-8 cannot encode a surrogate, so only an escape can make one: without any
        # escape the text needs no second look
        if "\\u" in text:
            canonical_json(raw)
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} cannot be written as canonical JSON")


def _finite(text: str) -> float:
    x = float(text)
    if x - x != 0:  # inf (a literal too large) or nan
        raise ValueError(f"{text} is not a finite number")
    return x


def check_version(raw: Mapping[str, Any], what: str, versions: Sequence[int] = (FORMAT_VERSION,)) -> int:
    """The record ``what``'s ``format_version``; UnsupportedVersion unless it is one of ``versions``."""
    version = raw.get("format_version")
    if type(version) is not int or version not in versions:
        known = " and ".join(str(v) for v in versions)
        raise UnsupportedVersion(
            f"{what} has format_version {version!r}; this deltasync reads version {known} "
            "only (upgrade deltasync to read newer runs)"
        )
    return version


# ------------------------------------------------------------- field checkers


def field_error(what: str, msg: str) -> ProtocolError:
    """The ProtocolError of a bad field ``what``."""
    return ProtocolError(f"{what}: {msg}")


def json_object(v: Any, what: str, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    """``v`` as an object with exactly ``keys`` (and any of ``optional``)."""
    if not isinstance(v, dict):
        raise field_error(what, "expected a JSON object")
    missing = [k for k in keys if k not in v]
    unknown = sorted(set(v) - set(keys) - set(optional))
    if missing or unknown:
        raise field_error(what, f"missing fields {missing} / unknown fields {unknown}")
    return v


def json_int(v: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """``v`` as an integer in ``[lo, hi]`` (booleans refused)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise field_error(what, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def json_str(v: Any, what: str) -> str:
    """``v`` as a non-empty string of at most 1024 characters."""
    if not isinstance(v, str) or not v or len(v) > 1024:
        raise field_error(what, f"expected a non-empty string, got {v!r}")
    return v


def json_digest(v: Any, what: str) -> str:
    """``v`` as a 32-character lower-case hex xxh3-128 digest."""
    if not isinstance(v, str) or len(v) != 32 or not set(v) <= HEX32:
        raise field_error(what, f"expected a 32-character lower-case hex xxh3-128 digest, got {v!r}")
    return v


def json_list(v: Any, what: str) -> list[Any]:
    """``v`` as a JSON array."""
    if not isinstance(v, list):
        raise field_error(what, "expected a JSON array")
    return v
