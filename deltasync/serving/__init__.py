"""The receiving side of a run, independent of any engine: what keeps a serving engine's weights at
a deltasync step.

- :mod:`deltasync.serving.node`: the node's one host mirror of the run in checkpoint names (versions
  in shared memory, built once per node and step by the node's leader process);
- :mod:`deltasync.serving.engine`: one engine worker's view of it (:class:`~deltasync.serving.engine.mirror.EngineMirror`:
  prepare, commit, undo), writing only the changed elements (``scatter``), pinned for DMA on GPU engines
  (``pinning``), prepared ahead (``prefetch``);
- :mod:`deltasync.serving.driver`: the HTTP driver of running engine servers (the update sequence
  on each, all-or-nothing rollouts), used by ``deltasync follow --vllm`` and the TRL integration;
- :mod:`deltasync.serving.fleet`: an engine's reports to the signal server's fleet view.

It imports the fetcher, the signal client and torch (lazily where it can), never an engine:
``deltasync.integrations.vllm`` adapts vLLM to it (the weight-transfer backend, the engine-core hook,
the engine check). This package imports nothing itself.
"""
