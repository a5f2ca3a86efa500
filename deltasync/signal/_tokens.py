"""Replica tokens: a report credential bound to one replica identity of one run (docs/fleet.md).

A replica token is ``dsr1~<run>~<identity>~<mac>``, where ``mac`` is the unpadded base64url of
``HMAC-SHA256(key, "deltasync-replica\\0" + run + "\\0" + identity)`` and ``key`` is the signal
server's replica key. ``~`` is in neither a run name nor a replica id, so the token names the
(run, identity) it binds and the server checks it against the URL without a lookup. It grants the
``report`` scope for the replica id ``identity`` of ``run``, and for every id ``identity-<suffix>``
(a node whose driver runs several replicas, ``node3-0``, ``node3-1``, ...): the operator chooses
the namespace, so an identity must not be a prefix (followed by ``-``) of another holder's ids.

The key: the server's ``replica_key`` (``DELTASYNC_REPLICA_KEY``), else one derived from its
publish token (:func:`derive_replica_key`), so that whoever holds the publish token (the trainer, an
operator) can mint tokens offline with :func:`replica_token` or ``deltasync replica-token``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from deltasync.errors import SignalRejected
from deltasync.signal._names import check_replica, check_run

__all__ = [
    "MIN_REPLICA_KEY",
    "REPLICA_TOKEN_PREFIX",
    "derive_replica_key",
    "parse_replica_token",
    "replica_key",
    "replica_token",
    "token_covers",
    "verify_replica_token",
]

#: how every replica token starts (format 1)
REPLICA_TOKEN_PREFIX = "dsr1~"
#: the shortest replica key the server accepts (characters)
MIN_REPLICA_KEY = 16
_MAC = re.compile(r"[A-Za-z0-9_-]{43}")


def derive_replica_key(publish_token: str) -> bytes:
    """The replica key of a server with ``publish_token`` and no ``replica_key`` of its own."""
    return hmac.new(publish_token.encode(), b"deltasync-replica-key", hashlib.sha256).digest()


def replica_key(key: str | None = None, publish_token: str | None = None) -> bytes | None:
    """The key replica tokens are made with: ``key`` (a replica key of at least :data:`MIN_REPLICA_KEY`
    characters, else a SignalRejected), else one derived from ``publish_token``; None with neither."""
    if key:
        if len(key) < MIN_REPLICA_KEY or not key.isprintable():
            raise SignalRejected(
                f"the replica key must be at least {MIN_REPLICA_KEY} printable characters "
                "(set DELTASYNC_REPLICA_KEY to a long random string, e.g. `openssl rand -hex 32`)"
            )
        return key.encode()
    if publish_token:
        return derive_replica_key(publish_token)
    return None


def _mac(key: bytes, run: str, identity: str) -> str:
    msg = b"deltasync-replica\0" + run.encode() + b"\0" + identity.encode()
    return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).rstrip(b"=").decode()


def _key_bytes(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def replica_token(key: str | bytes, run: str, replica: str) -> str:
    """The replica token of identity ``replica`` of ``run`` under ``key`` (see the module doc: it
    covers ``replica`` and every ``replica-<suffix>``). ``key``: the server's replica key, as
    :func:`replica_key` gives it (a str is taken as the raw ``DELTASYNC_REPLICA_KEY``)."""
    check_run(run)
    check_replica(replica)
    return f"{REPLICA_TOKEN_PREFIX}{run}~{replica}~{_mac(_key_bytes(key), run, replica)}"


def parse_replica_token(token: str) -> tuple[str, str] | None:
    """The (run, identity) a replica token names (not verified), or None when ``token`` is not one."""
    if not token.startswith(REPLICA_TOKEN_PREFIX):
        return None
    parts = token[len(REPLICA_TOKEN_PREFIX) :].split("~")
    if len(parts) != 3 or not _MAC.fullmatch(parts[2]):
        return None
    try:
        return check_run(parts[0]), check_replica(parts[1])
    except SignalRejected:
        return None


def token_covers(identity: str, replica: str) -> bool:
    """Whether a token of ``identity`` speaks for replica id ``replica`` (itself, or ``identity-<suffix>``)."""
    return replica == identity or (replica.startswith(identity + "-") and len(replica) > len(identity) + 1)


def verify_replica_token(key: bytes, token: str, run: str, replica: str) -> str:
    """The identity of a valid replica token for replica ``replica`` of ``run``, else a SignalRejected
    saying why (another run, another identity, or not made with this server's key)."""
    named = parse_replica_token(token)
    if named is None:
        raise SignalRejected("not a replica token (expected dsr1~<run>~<identity>~<43 base64url characters>)")
    t_run, identity = named
    expected = _mac(key, t_run, identity)
    if not hmac.compare_digest(expected, token.rsplit("~", 1)[1]):
        raise SignalRejected(
            "the replica token was not made with this server's replica key (mint it again with "
            "`deltasync replica-token` against this server's DELTASYNC_REPLICA_KEY or publish token)"
        )
    if t_run != run:
        raise SignalRejected(f"the replica token is for run {t_run!r}, not {run!r}")
    if not token_covers(identity, replica):
        raise SignalRejected(
            f"the replica token is for replica {identity!r} (and {identity}-<suffix>), not {replica!r}"
        )
    return identity
