"""Stores: the batch-first ABC, backends and :func:`open_store`."""

from __future__ import annotations

from deltasync.storage._hf import HFBucketStore
from deltasync.storage._local import LocalStore
from deltasync.storage._memory import MemoryStore
from deltasync.storage._open import open_store
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
