"""deltasync inside a vLLM engine.

- :mod:`deltasync.integrations.vllm.backend`: the ``"deltasync"`` weight-transfer backend and the
  worker extension (imports vLLM and torch);
- :mod:`deltasync.integrations.vllm.engine_core`: the hook in vLLM's engine core (imports vLLM only in
  ``install``);
- :mod:`deltasync.integrations.vllm.engine_check`: refuses an engine whose parameters are not what
  it computes with (imports torch);
- :mod:`deltasync.integrations.vllm.mirror`: the host mirror each worker keeps in checkpoint names
  (imports neither at module level);
- :mod:`deltasync.integrations.vllm.prefetch`: prepares each new committed step in the background
  (imports neither).

This package imports nothing itself, so the mirror can be used and tested without vLLM.
"""
