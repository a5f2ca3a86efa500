"""Build the codec's compiled kernels before the demo needs them.

deltasync's hot loops are numba kernels, compiled at their first use in a process and cached on disk
afterwards (``__pycache__`` next to the package, or ``$NUMBA_CACHE_DIR``). On a cold cache that first
use costs tens of seconds on 2 CPU cores, and in the demo it used to land on the follower's first sync, while the
trainer ran ahead: the first applied step lagged dozens of steps and the store fell behind. The demo
now runs :func:`warm_kernels` before its clock starts and says so in one line; on a warm cache it
takes a fraction of a second.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from deltasync.fetcher import DeltaFetcher
from deltasync.storage import open_store
from spaces_demo.trainer import ToyTrainer, demo_uploader, wait_for_commit

__all__ = ["compiled_signatures", "warm_kernels"]

#: learning rates of the warm-up's steps: the first ones move every weight (dense patches), the
#: last ones few (sparse patches), so the kernels of both codings are built
WARM_LRS = (1e-3, 1e-3, 1e-6, 1e-7, 1e-7)


def warm_kernels() -> float:
    """Push a few steps of the tiny toy model (an anchor, dense and sparse patches) through the
    demo's uploader into a scratch store and apply them to a bf16 copy with a verifying fetcher,
    so every kernel a demo run uses is compiled (or loaded from the disk cache); seconds taken."""
    import torch

    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="deltasync-warmup-")
    try:
        store = open_store(tmp)
        trainer = ToyTrainer("tiny", seed=0, lr=WARM_LRS[0])
        copy: dict[str, Any] = {}
        fetcher = DeltaFetcher(store, verify=True)
        with demo_uploader(store, anchor_every=len(WARM_LRS)) as up:
            for step in range(len(WARM_LRS) + 1):
                if step:
                    trainer.set_lr(WARM_LRS[step - 1])
                    trainer.step()
                wait_for_commit(up.push(trainer.model, step))
                fetcher.sync(copy, step=step)
        want = {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()}
        if sorted(copy) != sorted(want) or not all(torch.equal(copy[k], want[k]) for k in want):
            raise RuntimeError("the kernel warm-up's copy is not bit-exact with its trainer")
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - t0


def compiled_signatures() -> dict[str, int]:
    """How many type signatures each compiled kernel holds in this process (empty on the numpy
    fallback): a kernel that gains one was compiled (or loaded from the disk cache) just then."""
    from deltasync.protocol import kernels

    mod = kernels.impl()
    if mod is None:
        return {}
    out: dict[str, int] = {}
    for name in dir(mod):
        sigs = getattr(getattr(mod, name), "signatures", None)
        if isinstance(sigs, list):
            out[name] = len(sigs)
    return out
