"""An environment variable the library reads outside its entry points.

DESIGN.md reads env vars at the edges only, never at import. The CLI (``cli/``), the signal
server (``server/_settings.Settings.from_env``), the vLLM backend's init (``DELTASYNC_NODE_DIR``)
and :class:`~deltasync.storage.S3Store` (``environ=``, the ``AWS_*`` defaults) read theirs where they
start. ``DELTASYNC_KERNELS`` is read by :mod:`deltasync.protocol.kernels` itself at the codec's first use
(protocol imports nothing of ours; see ``kernels.ENV``). The one here is read when called, by the one
edge that decides, and passed on from there:

- :func:`hf_endpoint`: ``DELTASYNC_HF_ENDPOINT``, else ``HF_ENDPOINT``; read by
  :func:`deltasync.open_store` (the CLI opens every store through it) and passed to
  ``HFBucketStore(endpoint=...)``, which reads no environment itself.

Imports nothing of ours.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["hf_endpoint"]

HF_ENDPOINT_VARS = ("DELTASYNC_HF_ENDPOINT", "HF_ENDPOINT")


def hf_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The Hub URL hf:// stores talk to: ``DELTASYNC_HF_ENDPOINT``, else ``HF_ENDPOINT``; None when
    neither is set (non-empty)."""
    env = os.environ if env is None else env
    return next((env[v] for v in HF_ENDPOINT_VARS if env.get(v)), None)
