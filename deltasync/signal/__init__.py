"""The signal server's client side: :class:`SignalClient` and the uploader's :class:`Notifier`.

Needs only httpx and the standard library, never FastAPI: the uploader and the
fetcher import this package, and nothing of :mod:`deltasync.server` (which
re-exports these names for compatibility).
"""

from __future__ import annotations

from deltasync.signal._client import CommitEvent, Notifier, SignalClient
from deltasync.signal._names import RUN_PATTERN, check_run

__all__ = ["RUN_PATTERN", "CommitEvent", "Notifier", "SignalClient", "check_run"]
