"""Names as they appear in the signal server's URLs: runs (``/v1/runs/{run}/...``) and fleet replicas
(``/v1/runs/{run}/replicas/{replica}``)."""

from __future__ import annotations

import os
import re
import socket

from deltasync.errors import SignalRejected

__all__ = ["REPLICA_PATTERN", "RUN_PATTERN", "check_replica", "check_run", "default_replica", "replica_name"]

#: A run name as it appears in ``/v1/runs/{run}/...``.
RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_RUN = re.compile(RUN_PATTERN)
#: A replica id as it appears in ``/v1/runs/{run}/replicas/{replica}`` (``host-1234``, ``node3:8000``).
REPLICA_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
_REPLICA = re.compile(REPLICA_PATTERN)
_NOT_REPLICA = re.compile(r"[^A-Za-z0-9._:@-]+")


def check_run(run: str) -> str:
    """Return ``run`` if it is a valid run name, else raise SignalRejected (the server would refuse it)."""
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise SignalRejected(
            f"invalid run name {run!r}: use 1-128 characters [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run


def check_replica(replica: str) -> str:
    """Return ``replica`` if it is a valid replica id, else raise SignalRejected."""
    if not isinstance(replica, str) or not _REPLICA.fullmatch(replica):
        raise SignalRejected(
            f"invalid replica id {replica!r}: use 1-128 characters [A-Za-z0-9._:@-], starting with a letter or digit"
        )
    return replica


def replica_name(text: str) -> str:
    """``text`` made a valid replica id (other characters become ``-``; at most 128 characters)."""
    name = _NOT_REPLICA.sub("-", text).strip("-._:@")[:128] or "replica"
    return name if name[0].isalnum() else f"r{name[:127]}"


def default_replica() -> str:
    """This process's replica id: ``<hostname>-<pid>``."""
    return replica_name(f"{socket.gethostname()}-{os.getpid()}")
