"""Compatibility re-export: the signal client lives in :mod:`deltasync.signal` (httpx only, no FastAPI)."""

from __future__ import annotations

from deltasync.signal import CommitEvent, Notifier, SignalClient

__all__ = ["CommitEvent", "Notifier", "SignalClient"]
