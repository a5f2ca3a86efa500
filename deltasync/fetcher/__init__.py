"""Inference side: :class:`DeltaFetcher`, and :class:`Follower` (with :class:`FollowOptions`) behind
:meth:`DeltaFetcher.follow`."""

from deltasync.fetcher._fetcher import MARKER, DeltaFetcher, Verify
from deltasync.fetcher._follow import Follower, FollowOptions, FollowStats
from deltasync.fetcher._journal import SyncJournal
from deltasync.fetcher._stats import SyncStats

__all__ = ["MARKER", "DeltaFetcher", "FollowOptions", "FollowStats", "Follower", "SyncJournal", "SyncStats", "Verify"]
