"""Inference side: :class:`DeltaFetcher`."""

from deltasync.fetcher._fetcher import DeltaFetcher
from deltasync.fetcher._journal import SyncJournal
from deltasync.fetcher._stats import SyncStats

__all__ = ["DeltaFetcher", "SyncJournal", "SyncStats"]
