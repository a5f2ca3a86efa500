"""``deltasync demo``: train a tiny character model and sync an inference copy live.

Trainer and inference copy share nothing but the store: every step the trainer
pushes its bf16 weights, the fetcher patches its own model in place, checks it
is bit-identical and prints what the inference copy now generates.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from deltasync._tensors import require_torch
from deltasync.errors import StorageError
from deltasync.fetcher import DeltaFetcher
from deltasync.storage import open_store
from deltasync.uploader import DeltaUploader

__all__ = ["run_demo"]

TEXT = "deltasync ships sparse patches, bit-exact. "


CONTEXT = 4


def _model(torch: Any, vocab: int) -> Any:
    nn = torch.nn
    return nn.Sequential(
        nn.Embedding(vocab, 16), nn.Flatten(), nn.Linear(16 * CONTEXT, 128), nn.GELU(), nn.Linear(128, vocab)
    )


def _windows(torch: Any, data: Any) -> tuple[Any, Any]:
    n = len(data) - CONTEXT
    x = torch.stack([data[i : i + CONTEXT] for i in range(n)])
    return x, data[CONTEXT:]


def _generate(torch: Any, model: Any, chars: list[str], n: int) -> str:
    ctx = [chars.index(c) for c in TEXT[:CONTEXT]]
    with torch.no_grad():
        while len(ctx) < n:
            logits = model(torch.tensor([ctx[-CONTEXT:]]))
            ctx.append(int(logits.float().argmax()))
    return "".join(chars[i] for i in ctx)


def _prepare_store_dir(url: str) -> None:
    if "://" in url:
        return
    path = Path(url)
    if path.exists() and any(path.iterdir()):
        if not ((path / "steps").is_dir() or (path / "HEAD.json").exists()):
            raise StorageError(f"{path} exists and is not a deltasync store; pass --store to pick another dir")
        shutil.rmtree(path)


def run_demo(*, store_url: str = "deltasync-demo", steps: int = 60, lr: float = 3e-3, anchor_every: int = 20) -> int:
    """Run the local demo; returns a process exit status."""
    torch = require_torch()
    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT + TEXT[:CONTEXT]])
    x, y = _windows(torch, data)
    trainer = _model(torch, len(chars))
    infer = _model(torch, len(chars)).to(torch.bfloat16)
    opt = torch.optim.AdamW(trainer.parameters(), lr=lr)
    _prepare_store_dir(store_url)
    store = open_store(store_url)
    fetcher = DeltaFetcher(store)
    full = sum(p.numel() * 2 for p in trainer.parameters())
    print(f"store {store.url}: training a {full // 2:,}-parameter model, inference copy in bf16 ({full:,} bytes)")
    print(f"{'step':>4}  {'kind':<6} {'bytes':>8} {'changed':>8} {'sync ms':>7}  bit-exact  inference copy says")
    ok = True
    with DeltaUploader(store, anchor_every=anchor_every, cast_dtype=torch.bfloat16, on_backlog="block") as up:
        for step in range(steps):
            if step:
                logits = trainer(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            info = up.push(trainer, step).result()
            t0 = time.perf_counter()
            fetcher.sync(infer, step=step)
            ms = 1000 * (time.perf_counter() - t0)
            want = {k: v.detach().to(torch.bfloat16) for k, v in trainer.state_dict().items()}
            got = infer.state_dict()
            exact = all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want)
            ok &= exact
            text = _generate(torch, infer, chars, len(TEXT)).replace("\n", " ")
            print(
                f"{step:>4}  {info.kind:<6} {info.nbytes:>8,} {100 * info.changed / info.total:>7.2f}% {ms:>7.1f}  "
                f"{'yes' if exact else 'NO':<9}  {text!r}"
            )
            sys.stdout.flush()
    print(f"done: {steps} steps; run `deltasync inspect {store_url}` to see the chain")
    return 0 if ok else 1
