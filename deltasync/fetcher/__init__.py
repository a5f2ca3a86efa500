"""Inference side: :class:`DeltaFetcher`."""

from deltasync.fetcher._fetcher import MARKER, DeltaFetcher, Verify
from deltasync.fetcher._journal import SyncJournal
from deltasync.fetcher._stats import SyncStats

__all__ = ["MARKER", "DeltaFetcher", "SyncJournal", "SyncStats", "Verify"]
