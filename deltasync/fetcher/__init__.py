"""Inference side: :class:`DeltaFetcher`."""

from deltasync.fetcher._fetcher import DeltaFetcher

__all__ = ["DeltaFetcher"]
