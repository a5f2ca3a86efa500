"""deltasync inside a vLLM engine.

- :mod:`deltasync.integrations.vllm.backend`: the ``"deltasync"`` weight-transfer backend and the
  worker extension (imports vLLM and torch);
- :mod:`deltasync.integrations.vllm.engine_core`: the hook in vLLM's engine core (imports vLLM only in
  ``install``);
- :mod:`deltasync.integrations.vllm.engine_check`: refuses an engine whose parameters are not what
  it computes with (imports torch);
- :mod:`deltasync.integrations.vllm.node` (with :mod:`~deltasync.integrations.vllm.versions` and
  :mod:`~deltasync.integrations.vllm.leader`): the node's one host mirror in checkpoint names, built
  once per node and step by the node's leader process (imports neither at module level);
- :mod:`deltasync.integrations.vllm.mirror`: one worker's view of the node mirror: prepare, commit,
  undo (imports neither at module level);
- :mod:`deltasync.integrations.vllm.fleet`: rank 0's reports to the signal server's fleet view;
- :mod:`deltasync.integrations.vllm.prefetch`: prepares each new committed step in the background
  (imports neither).

This package imports nothing itself, so the mirror can be used and tested without vLLM.
"""
