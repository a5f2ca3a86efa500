"""Webhook signatures: how the server signs deliveries and how receivers verify them.

A delivery is a ``POST`` of a JSON body with these headers::

    X-Deltasync-Event: commit
    X-Deltasync-Delivery: 3f0c...            (32 hex; also in the body as "delivery")
    X-Deltasync-Timestamp: 1732240000        (Unix seconds when this attempt was signed)
    X-Deltasync-Signature: v1=<hex>          (HMAC-SHA256(secret, f"{timestamp}." + raw body))

Receivers call :func:`verify_webhook` (stateless: signature and replay window) or keep
one :class:`WebhookVerifier` (also refuses a delivery id it already accepted within the
window). Neither needs FastAPI; this module only uses the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from deltasync.errors import WebhookVerificationError

__all__ = [
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookVerifier",
    "sign_webhook",
    "verify_webhook",
]

EVENT_HEADER = "X-Deltasync-Event"
DELIVERY_HEADER = "X-Deltasync-Delivery"
TIMESTAMP_HEADER = "X-Deltasync-Timestamp"
SIGNATURE_HEADER = "X-Deltasync-Signature"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300.0


def _mac(secret: str | bytes, timestamp: int, body: bytes) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign_webhook(secret: str | bytes, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
    """The timestamp and signature headers for ``body`` (the server calls this for every attempt)."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: f"{SCHEME}={_mac(secret, ts, body)}"}


def _header(headers: Mapping[str, str], name: str) -> str:
    lower = name.lower()
    for k, v in headers.items():
        if k.lower() == lower:
            return v
    raise WebhookVerificationError(f"webhook delivery lacks the {name} header")


def verify_webhook(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> dict[str, Any]:
    """Check a delivery's signature and timestamp; return its JSON event.

    Raises :class:`~deltasync.errors.WebhookVerificationError` when a header is
    missing, the signature is not ours (constant-time comparison), or the
    timestamp is more than ``tolerance_s`` away from ``now`` (a replay).
    """
    raw_ts = _header(headers, TIMESTAMP_HEADER).strip()
    if not raw_ts.isdigit() or len(raw_ts) > 12:
        raise WebhookVerificationError(f"malformed {TIMESTAMP_HEADER} header {raw_ts[:40]!r}")
    ts = int(raw_ts)
    current = time.time() if now is None else now
    if abs(current - ts) > tolerance_s:
        raise WebhookVerificationError(
            f"webhook timestamp {ts} is {current - ts:+.0f} s away from now; outside the {tolerance_s:.0f} s "
            "replay window"
        )
    expected = _mac(secret, ts, bytes(body))
    offered = [
        p.strip()[len(SCHEME) + 1 :]
        for p in _header(headers, SIGNATURE_HEADER).split(",")
        if p.strip().startswith(SCHEME + "=")
    ]
    # compare against every offered v1 value (lets a sender rotate secrets), each in constant time
    if not any(hmac.compare_digest(expected.encode(), o.encode()) for o in offered if o.isascii()):
        raise WebhookVerificationError("webhook signature does not match: wrong secret or a modified body")
    try:
        event = json.loads(body)
    except ValueError as exc:
        raise WebhookVerificationError(f"webhook body is not JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise WebhookVerificationError("webhook body is not a JSON object")
    return event


class WebhookVerifier:
    """Stateful receiver-side check: :func:`verify_webhook` plus no delivery accepted twice.

    Delivery ids are remembered for the replay window (older ones would fail
    the timestamp check anyway), so memory stays bounded by the delivery rate.
    """

    def __init__(
        self,
        secret: str | bytes,
        *,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secret:
            raise ValueError("a webhook secret must not be empty")
        self.secret = secret
        self.tolerance_s = tolerance_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def verify(self, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        """Verify one delivery; a second delivery with the same id raises."""
        now = self._clock()
        event = verify_webhook(self.secret, headers, body, tolerance_s=self.tolerance_s, now=now)
        delivery = event.get("delivery")
        if not isinstance(delivery, str) or not delivery:
            raise WebhookVerificationError("webhook body has no delivery id")
        with self._lock:
            for k in [k for k, t in self._seen.items() if now - t > 2 * self.tolerance_s]:
                del self._seen[k]
            if delivery in self._seen:
                raise WebhookVerificationError(f"webhook delivery {delivery} was already accepted (replay)")
            self._seen[delivery] = now
        return event
