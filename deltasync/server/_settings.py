"""Signal server settings: one frozen dataclass, read from the environment only in :meth:`Settings.from_env`."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from deltasync.signal import MIN_REPLICA_KEY, RUN_PATTERN, check_run, replica_key

__all__ = ["DIGEST_PATTERN", "RUN_PATTERN", "Settings", "check_run", "is_loopback"]

#: ``xxh3-128`` of a manifest, as in the wire format.
DIGEST_PATTERN = r"^[0-9a-f]{32}$"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only exposes the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Settings:
    """Signal server options.

    publish_token: bearer token of the ``publish`` scope (POST commits, webhooks,
        rederive); it also grants ``subscribe``. None leaves publishing open,
        which :func:`deltasync.server.serve` allows on loopback addresses only.
    subscribe_token: bearer token of the ``subscribe`` scope (head, events,
        wait, the fleet view). None leaves reading open.
    report_token: bearer token of the ``report`` scope (receivers reporting what
        they serve to the fleet view). None: reporting takes the ``subscribe``
        scope's tokens (a receiver's token); the publish token always works.
        These shared tokens report *unbound* replicas (docs/fleet.md).
    replica_key: the key of replica tokens (``DELTASYNC_REPLICA_KEY``, at least 16
        characters): a replica token (``deltasync replica-token``) reports only its own
        replica id, *bound*. None: the key is derived from the publish token (so its
        holder mints tokens offline); without either, there are no replica tokens.
    db_path: SQLite file that keeps heads, commit history and webhooks across
        restarts (``":memory:"`` keeps nothing).
    store_url: optional store URL; ``{run}`` in it is replaced by the run name.
        With a store the server checks that a published manifest exists with
        the published digest, and derives a run's head from it when it has none.
    max_body_bytes: requests with a larger body are refused with 413.
    heartbeat_s: an SSE comment line is sent after this many idle seconds.
    max_wait_s: upper bound of ``/wait``'s ``timeout``.
    history: commits kept per run for SSE replay (older ones are pruned).
    webhook_attempts / webhook_backoff_s / webhook_timeout_s: delivery retries
        (exponential backoff starting at ``webhook_backoff_s``).
    fleet_ttl_s: a replica that has not reported for this long leaves the fleet
        view (a report may name its own ``ttl_s``).
    max_replicas: live replicas per run in the fleet view (a new one past it: 429,
        unless it is bound and evicts the unbound replica seen longest ago); 4,096 by
        default, ``deltasync serve --max-replicas`` (docs/fleet.md "Scale").
    max_fleet_runs: runs with a fleet at once (a new one past it: 429).
    """

    publish_token: str | None = None
    subscribe_token: str | None = None
    report_token: str | None = None
    replica_key: str | None = None
    db_path: str = ":memory:"
    store_url: str | None = None
    max_body_bytes: int = 16 * 1024
    heartbeat_s: float = 15.0
    max_wait_s: float = 60.0
    history: int = 10_000
    webhook_attempts: int = 6
    webhook_backoff_s: float = 0.5
    webhook_timeout_s: float = 5.0
    fleet_ttl_s: float = 30.0
    max_replicas: int = 4096
    max_fleet_runs: int = 1024

    def __post_init__(self) -> None:
        for name in ("publish_token", "subscribe_token", "report_token"):
            tok = getattr(self, name)
            if tok is not None and (not isinstance(tok, str) or len(tok) < 8 or not tok.isprintable() or " " in tok):
                raise ValueError(f"{name} must be at least 8 printable characters without spaces")
        if self.replica_key is not None and (
            not isinstance(self.replica_key, str)
            or len(self.replica_key) < MIN_REPLICA_KEY
            or not self.replica_key.isprintable()
        ):
            raise ValueError(
                f"replica_key must be at least {MIN_REPLICA_KEY} printable characters (e.g. `openssl rand -hex 32`)"
            )
        if self.max_body_bytes < 256:
            raise ValueError("max_body_bytes must be >= 256")
        if self.heartbeat_s <= 0 or self.max_wait_s <= 0:
            raise ValueError("heartbeat_s and max_wait_s must be positive")
        if self.history < 1 or self.webhook_attempts < 1:
            raise ValueError("history and webhook_attempts must be >= 1")
        if not 0 < self.fleet_ttl_s <= 86400:
            raise ValueError("fleet_ttl_s must be in (0, 86400]")
        if self.max_replicas < 1 or self.max_fleet_runs < 1:
            raise ValueError("max_replicas and max_fleet_runs must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Settings with tokens from ``DELTASYNC_PUBLISH_TOKEN`` / ``DELTASYNC_SUBSCRIBE_TOKEN`` /
        ``DELTASYNC_REPORT_TOKEN``, and the replica key from ``DELTASYNC_REPLICA_KEY``."""
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "publish_token": env.get("DELTASYNC_PUBLISH_TOKEN") or None,
            "subscribe_token": env.get("DELTASYNC_SUBSCRIBE_TOKEN") or None,
            "report_token": env.get("DELTASYNC_REPORT_TOKEN") or None,
            "replica_key": env.get("DELTASYNC_REPLICA_KEY") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    @property
    def secured(self) -> bool:
        """Whether publishing needs a token."""
        return self.publish_token is not None

    @property
    def replica_token_key(self) -> bytes | None:
        """The key replica tokens are checked with (:func:`deltasync.signal.replica_key`); None: no replica tokens."""
        return replica_key(self.replica_key, self.publish_token)
