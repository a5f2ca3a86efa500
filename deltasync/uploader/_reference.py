"""The trainer's side of the behavioural audit: reference logprobs of the run's probes (docs/audit.md).

:func:`probe_logprobs` runs one small batched no-grad forward of an HF-style causal LM (anything
whose call with ``input_ids`` returns ``.logits`` or a tuple starting with them) in the model's own
numerics, and takes ``log_softmax`` of the logits in float32, as inference engines compute their
logprobs. :class:`ReferenceWriter` writes the resulting :class:`~deltasync.protocol.probes.Reference`
objects in the background (one serial worker, retried like the commit's writes), so that the
training loop pays only for the forward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from deltasync._util.retry import RetryPolicy
from deltasync._util.worker import SerialWorker
from deltasync.protocol.probes import ProbeSet, Reference
from deltasync.run.probes import write_reference
from deltasync.storage import Store
from deltasync.uploader._commit_step import with_retries

__all__ = ["ReferenceWriter", "model_dtype", "probe_logprobs"]

log = logging.getLogger("deltasync.uploader")

#: attention implementations of transformers that run a plain batch of equal-length sequences
_PLAIN_ATTENTION = frozenset({"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"})


def model_dtype(model: Any) -> str:
    """The name of the model's floating-point parameter dtype (``bfloat16``, ``float32``, ...)."""
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return str(torch.get_default_dtype()).removeprefix("torch.")


def probe_logprobs(model: Any, probes: ProbeSet) -> tuple[tuple[float, ...], ...]:
    """Per-token logprobs of ``probes`` under ``model``: one row per probe, ``log p(t[i] | t[:i])`` for
    ``i >= 1``. One no-grad forward per distinct probe length (one in all for equal-length probes), on
    the model's device and in its dtype; the model's training mode is left as it was (eval during the
    forward, so dropout does not move the reference). A model whose attention is a trainer's own
    packed kernel (TRL's AsyncGRPO registers one that needs its packing metadata) runs the probes with
    ``sdpa`` for the forward, then gets its own back."""
    import torch

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    by_len: dict[int, list[int]] = {}
    for i, row in enumerate(probes.tokens):
        by_len.setdefault(len(row), []).append(i)
    out: dict[int, tuple[float, ...]] = {}
    was_training = bool(getattr(model, "training", False))
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    swap = isinstance(attn, str) and attn not in _PLAIN_ATTENTION
    try:
        if swap:
            config._attn_implementation = "sdpa"  # type: ignore[union-attr]
        if was_training:
            model.eval()
        with torch.no_grad():
            for idx in by_len.values():
                ids = torch.tensor([probes.tokens[i] for i in idx], dtype=torch.long, device=device)
                res = model(input_ids=ids)
                logits = res.logits if hasattr(res, "logits") else res[0]
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
                for row, i in zip(picked.tolist(), idx, strict=True):
                    out[i] = tuple(float(v) for v in row)
    finally:
        if was_training:
            model.train()
        if swap:
            config._attn_implementation = attn  # type: ignore[union-attr]
    return tuple(out[i] for i in range(len(probes.tokens)))


class ReferenceWriter:
    """Writes references in the background (one serial worker); :meth:`submit` returns a Future."""

    def __init__(self, store: Store, retry: RetryPolicy, stop: threading.Event) -> None:
        self.store = store
        self.retry = retry
        self._stop = stop
        self._worker = SerialWorker("deltasync-references", stop=stop)

    def submit(self, reference: Reference, probes: ProbeSet) -> Future[Reference]:
        """Write ``reference`` (of ``probes``) once; the Future resolves to it, or raises the write's error."""

        def write() -> Reference:
            what = f"reference of step {reference.step}"
            with_retries(lambda: write_reference(self.store, reference, probes), self.retry, what, stop=self._stop)
            return reference

        return self._worker.submit(write)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted reference is written (or failed)."""
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what was submitted, then stop."""
        self._worker.close(timeout=timeout)


def rows_of(logprobs: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Logprobs given as nested sequences (lists, tuples, 1-D tensors' ``tolist()``) as tuples of floats."""
    return tuple(tuple(float(v) for v in row) for row in logprobs)
