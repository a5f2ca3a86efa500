"""The storage tests: ``deltasync.storage`` (LocalStore, MemoryStore, S3Store, HFBucketStore, open_store).

Every backend runs the conformance suite (``deltasync.testing.store.StoreTests``) plus its own
specifics; also ``hf://`` reachability, the real Hub (marker ``hub``, with ``HF_TOKEN``), store
round trips of the read path, and store-mutation fuzz.

No fixture is shared by more than one module here: each module keeps its own. Root fixtures used:
``s3_server`` (test_storage_s3), ``fake_hub``, ``hf_bucket``, ``hf_env`` (test_hf_store,
test_hf_reach). Helper modules: ``fakehub``, ``server_harness``, ``cli_process``, ``bench_loader``
(test_request_counts loads ``benchmarks/bench_requests.py``).
"""

from __future__ import annotations
