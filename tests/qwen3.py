"""The tiny Qwen3 model of the tests (transformers, random init) and a few AdamW steps on it.

torch and transformers are imported inside each function, so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

QWEN3_KW: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def qwen3_config(tie: bool = False) -> Any:
    """Config of the tiny Qwen3 model."""
    from transformers import Qwen3Config

    return Qwen3Config(**QWEN3_KW, tie_word_embeddings=tie)


def make_qwen3(seed: int = 0, *, tie: bool = False, dtype: Any = None) -> Any:
    """A tiny, randomly initialised Qwen3ForCausalLM (fp32 unless ``dtype``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tie))
    if dtype is not None:
        model = model.to(dtype)
    return model


def train_steps(model: Any, steps: int, lr: float, seed: int = 0) -> Iterator[int]:
    """Run ``steps`` AdamW steps on random token batches, yielding after each optimizer step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        x = torch.randint(0, QWEN3_KW["vocab_size"], (2, 16), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step
