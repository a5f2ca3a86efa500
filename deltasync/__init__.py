"""deltasync: ship RL weight updates as bit-exact sparse patches through object storage.

import deltasync as ds
store = ds.open_store("file:///data/run-1")
with ds.DeltaUploader(store, anchor_every=50) as up:
    info = up.push(model.state_dict(), step=7).result()
ds.DeltaFetcher(store).sync(inference_model)
"""

from deltasync import errors
from deltasync.fetcher import DeltaFetcher
from deltasync.run import RunReader
from deltasync.storage import HFBucketStore, LocalStore, MemoryStore, ObjectInfo, Store, open_store
from deltasync.uploader import CommitInfo, DeltaUploader, UploaderConfig

__version__ = "0.1.0"

__all__ = [
    "CommitInfo",
    "DeltaFetcher",
    "DeltaUploader",
    "HFBucketStore",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "RunReader",
    "Store",
    "UploaderConfig",
    "__version__",
    "errors",
    "open_store",
]
