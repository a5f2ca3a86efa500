"""The signal side of a run: the signal server's client, the uploader's :class:`Notifier`, the one
:class:`StepWatcher` (SSE, falling back to polling the store) and the one staleness definition.

Needs only httpx and the standard library, never FastAPI: the uploader and the
fetcher import this package, and nothing of :mod:`deltasync.server` (which
re-exports the client names for compatibility).
"""

from __future__ import annotations

from deltasync.signal._client import CommitEvent, Notifier, SignalClient
from deltasync.signal._names import RUN_PATTERN, check_run
from deltasync.signal._staleness import Staleness, StalenessTracker
from deltasync.signal._watcher import StepSeen, StepWatcher, StorePoller

__all__ = [
    "RUN_PATTERN",
    "CommitEvent",
    "Notifier",
    "SignalClient",
    "Staleness",
    "StalenessTracker",
    "StepSeen",
    "StepWatcher",
    "StorePoller",
    "check_run",
]
