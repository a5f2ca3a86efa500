"""Inference side: :class:`DeltaFetcher`."""

from deltasync.fetcher._fetcher import DeltaFetcher, SyncJournal, SyncStats

__all__ = ["DeltaFetcher", "SyncJournal", "SyncStats"]
