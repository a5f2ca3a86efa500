"""The package's shared private machinery, imported by any layer (no re-exports: import the module).

- :mod:`.worker`: the one background worker, :class:`~deltasync._util.worker.SerialWorker`.
- :mod:`.retry`: the one retry policy (``RetryPolicy``, ``Backoff``, ``retry_call``).
- :mod:`.prometheus`: the one Prometheus text renderer.
- :mod:`.tensors`: torch interop and the one capped inventory allocator.
- :mod:`.checkpoint_io`: reading and writing safetensors checkpoints.
- :mod:`.gcpause`: the garbage collector's full passes paused over a hot path that allocates per tensor.

``worker``, ``retry`` and ``prometheus`` import nothing of ours but :mod:`deltasync.errors`;
``tensors`` and ``checkpoint_io`` also read :mod:`deltasync.protocol`.
"""
