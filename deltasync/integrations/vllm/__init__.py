"""deltasync inside a vLLM engine: the thin adapter between vLLM and :mod:`deltasync.serving`.

- :mod:`deltasync.integrations.vllm.backend`: the ``"deltasync"`` weight-transfer backend and the
  plugin's entry point (imports vLLM and torch);
- :mod:`deltasync.integrations.vllm.extension`: the worker extension, deltasync's worker API on a vLLM
  worker (imports vLLM only to read the engine's world group);
- :mod:`deltasync.integrations.vllm.compat`: the vLLM internals the adapter patches, the versions they
  are tested with (``TESTED_VLLM``) and their check;
- :mod:`deltasync.integrations.vllm.engine_core`: the hook in vLLM's engine core (imports vLLM only in
  ``install``);
- :mod:`deltasync.integrations.vllm.engine_check`: refuses an engine whose parameters are not what
  it computes with, and finds the names it ties (imports torch);
- :mod:`deltasync.integrations.vllm.driver`: the name the HTTP driver had before it moved to
  :mod:`deltasync.serving.driver` (kept for code that imports it from here).

Everything that does not need vLLM lives in :mod:`deltasync.serving` (the node mirror, the engine
mirror, a worker's deltasync state, scatter, pinning, prefetch, the HTTP driver, fleet reports). This package imports nothing itself.
"""
