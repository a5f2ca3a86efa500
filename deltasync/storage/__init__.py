"""Stores: the batch-first ABC, backends and :func:`open_store`."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlparse

from deltasync.errors import StorageError
from deltasync.storage._hf import HFBucketStore, open_hf_url
from deltasync.storage._local import LocalStore
from deltasync.storage._memory import MemoryStore
from deltasync.storage._s3 import S3Store
from deltasync.storage.base import Data, ObjectInfo, PutMode, Store, validate_key
from deltasync.storage.wrapper import WrapperStore

__all__ = [
    "Data",
    "HFBucketStore",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "PutMode",
    "S3Store",
    "Store",
    "open_store",
    "WrapperStore",
    "validate_key",
]


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open a store from a URL.

    * a plain path or ``file:///abs/path``: :class:`LocalStore` (its directory is made by the first write)
    * ``memory://name``: a fresh :class:`MemoryStore` (not shared between calls)
    * ``s3://<bucket>[/<prefix>]``: :class:`S3Store`; ``options`` are its keywords
      (endpoint, region, credentials, ...), else the ``AWS_*`` environment applies
    * ``hf://buckets/<ns>/<bucket>[/<prefix>]``: :class:`HFBucketStore`
      (needs the ``hf`` extra; endpoint from ``DELTASYNC_HF_ENDPOINT`` or ``HF_ENDPOINT``)

    ``options`` are accepted by the s3:// backend only.
    """
    if isinstance(url, str) and url.startswith("s3://"):
        return S3Store.from_url(url, **options)
    if options:
        raise StorageError(f"{url}: store options {sorted(options)} are only accepted for s3:// URLs")
    if isinstance(url, os.PathLike):
        return LocalStore(url)
    if not isinstance(url, str) or not url:
        raise StorageError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        return LocalStore(url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"{url}: file:// URLs must name a local path (file:///abs/path)")
        return LocalStore(unquote(parsed.path))
    if parsed.scheme == "memory":
        return MemoryStore(url[len("memory://") :])
    if parsed.scheme == "hf":
        return open_hf_url(url)
    raise StorageError(
        f"{url}: unsupported store scheme {parsed.scheme!r}; this build supports local paths, "
        "file://, memory://, s3:// and hf://buckets/"
    )
