"""The environment variables the library reads outside its entry points, one function each.

DESIGN.md reads env vars at the edges only, never at import. The CLI (``cli/``), the signal
server (``server/_settings.Settings.from_env``), the vLLM backend's init (``DELTASYNC_NODE_DIR``)
and :class:`~deltasync.storage.S3Store` (``environ=``, the ``AWS_*`` defaults) read theirs where they
start. The two here are read when called, by the one edge that decides, and passed on from there:

- :func:`hf_endpoint`: ``DELTASYNC_HF_ENDPOINT``, else ``HF_ENDPOINT``; read by
  :func:`deltasync.open_store` (the CLI opens every store through it) and passed to
  ``HFBucketStore(endpoint=...)``, which reads no environment itself.
- :func:`kernels_choice`: ``DELTASYNC_KERNELS``; read once per process by
  :mod:`deltasync.protocol.kernels` when the codec is first used. It is a process-wide switch
  between two implementations that write the same bytes (like ``NUMBA_DISABLE_JIT``), and the codec
  runs in processes no deltasync entry point starts (a trainer's script, vLLM's workers), so that
  first use is its edge; code switches with ``kernels.set_backend``/``kernels.using`` instead.

Imports nothing of ours.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["KERNELS_VAR", "hf_endpoint", "kernels_choice"]

KERNELS_VAR = "DELTASYNC_KERNELS"
HF_ENDPOINT_VARS = ("DELTASYNC_HF_ENDPOINT", "HF_ENDPOINT")


def hf_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The Hub URL hf:// stores talk to: ``DELTASYNC_HF_ENDPOINT``, else ``HF_ENDPOINT``; None when
    neither is set (non-empty)."""
    env = os.environ if env is None else env
    return next((env[v] for v in HF_ENDPOINT_VARS if env.get(v)), None)


def kernels_choice(env: Mapping[str, str] | None = None) -> str:
    """``DELTASYNC_KERNELS``, lower-cased (``"auto"`` when unset or empty); not validated here."""
    env = os.environ if env is None else env
    return env.get(KERNELS_VAR, "auto").strip().lower() or "auto"
