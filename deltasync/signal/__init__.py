"""The signal side of a run: the signal server's client, the uploader's :class:`Notifier`, the one
:class:`StepWatcher` (SSE, falling back to polling the store), the one :class:`FollowLoop` (watch ->
act -> report -> back off) every receiver runs on it, the one staleness definition, and
the fleet: receivers' :class:`FleetReporter` and the trainer's staleness gate :func:`wait_for_fleet`, and
replica tokens (:func:`replica_token`: a report credential bound to one replica id, docs/fleet.md).

Needs only httpx and the standard library, never FastAPI: the uploader and the
fetcher import this package, and nothing of :mod:`deltasync.server` (which
re-exports the client names for compatibility).

:class:`RetryPolicy` (the backoff :class:`StepWatcher` reconnects with and :class:`FollowLoop` backs
a failing step off with) is the package's shared policy, re-exported here because those signatures
take it.
"""

from __future__ import annotations

from deltasync._util.retry import RetryPolicy
from deltasync.signal._client import LEASE_HEADER, CommitEvent, Notifier, SignalClient, new_lease
from deltasync.signal._fleet import REPLICA_STATES, FleetView, ReplicaState, ReplicaStatus
from deltasync.signal._follow import Attempt, FollowLoop
from deltasync.signal._gate import fleet_ready, wait_for_fleet
from deltasync.signal._names import (
    REPLICA_PATTERN,
    RUN_PATTERN,
    check_replica,
    check_run,
    default_replica,
    replica_name,
)
from deltasync.signal._reporter import FleetReporter, Served
from deltasync.signal._staleness import MAX_PENDING, Staleness, StalenessTracker, commit_time
from deltasync.signal._tokens import (
    MIN_REPLICA_KEY,
    REPLICA_TOKEN_PREFIX,
    derive_replica_key,
    parse_replica_token,
    replica_key,
    replica_token,
    token_covers,
    verify_replica_token,
)
from deltasync.signal._watcher import StepSeen, StepWatcher, StorePoller

__all__ = [
    "LEASE_HEADER",
    "MAX_PENDING",
    "MIN_REPLICA_KEY",
    "REPLICA_PATTERN",
    "REPLICA_STATES",
    "REPLICA_TOKEN_PREFIX",
    "RUN_PATTERN",
    "Attempt",
    "CommitEvent",
    "FleetReporter",
    "FleetView",
    "FollowLoop",
    "Notifier",
    "ReplicaState",
    "ReplicaStatus",
    "RetryPolicy",
    "Served",
    "SignalClient",
    "Staleness",
    "StalenessTracker",
    "StepSeen",
    "StepWatcher",
    "StorePoller",
    "check_replica",
    "check_run",
    "commit_time",
    "default_replica",
    "derive_replica_key",
    "fleet_ready",
    "new_lease",
    "parse_replica_token",
    "replica_key",
    "replica_name",
    "replica_token",
    "token_covers",
    "verify_replica_token",
    "wait_for_fleet",
]
