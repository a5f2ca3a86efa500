"""The demo's trainer, step by step: the toy model, its optimizer and the uploader it pushes through.

One place for what a demo run computes: :class:`spaces_demo.live.DemoRun` trains with it behind the
page, and :mod:`spaces_demo.figures` trains with it to measure the figures the README and the docs
print (``scripts/figures.py``), so the two cannot drift apart.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any

from deltasync.storage import Store
from deltasync.uploader import CommitInfo, DeltaUploader
from spaces_demo.toy import ToyModel, build_model, training_batch

__all__ = ["ANCHOR_BYTES_FRACTION", "ToyTrainer", "demo_uploader", "wait_for_commit"]

ANCHOR_BYTES_FRACTION = 1.0
"""The demo's uploader writes an anchor once the patch bytes since the last anchor exceed this
fraction of that anchor's size (besides every ``--anchor-every`` pushes); shown on the page."""


class ToyTrainer:
    """The toy Qwen3 (fp32 master weights), AdamW and the fixed batch; :meth:`step` trains once."""

    def __init__(self, model: str, *, seed: int, lr: float) -> None:
        import torch

        toy, self.model = build_model(model, seed=seed)
        self.toy: ToyModel = toy
        self.model.train()
        self._batch = training_batch(self.toy.tokenizer)
        self._opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps."""
        for group in self._opt.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """One optimizer step on the batch; its loss."""
        ids, mask, labels = self._batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        self._opt.step()
        return float(loss.detach())


def demo_uploader(
    store: Store,
    anchor_every: int,
    *,
    signal_url: str | None = None,
    signal_token: str | None = None,
    signal_run: str | None = None,
) -> DeltaUploader:
    """The uploader the demo pushes the bf16 view of every step through: anchors every
    ``anchor_every`` pushes, and whenever the patches since the last anchor add up to a full
    checkpoint (which happens early on, when Adam still moves most weights)."""
    import torch

    return DeltaUploader(
        store,
        anchor_every=anchor_every,
        anchor_bytes_fraction=ANCHOR_BYTES_FRACTION,
        cast_dtype=torch.bfloat16,
        signal_url=signal_url,
        signal_token=signal_token,
        signal_run=signal_run,
    )


def wait_for_commit(fut: Future[CommitInfo], stopped: Any = None, poll: float = 0.5) -> None:
    """Wait until the pushed step's commit resolved (or ``stopped()`` is true).

    The demo trains in lockstep with its store: step N+1 is pushed once step N is committed, so
    the uploader's anchor rule sees every patch before it decides the next step's kind and no step
    is ever folded into a later one. A run is then the same on every machine, however loaded, and
    ``scripts/figures.py`` measures exactly what a default run ships."""
    while not wait([fut], poll).done:
        if stopped is not None and stopped():
            return
