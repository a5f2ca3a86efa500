"""Integrations with the frameworks around deltasync. Each imports its framework only in its own module:

- :mod:`deltasync.integrations.transformers`: a ``transformers`` ``TrainerCallback`` that pushes each step;
- :mod:`deltasync.integrations.vllm`: the vLLM weight-transfer backend, worker extension and host mirror.
"""
