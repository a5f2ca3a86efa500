"""The demo's toy task: a tiny Qwen3 that learns to answer questions about deltasync.

Everything is built in: a character tokenizer, a handful of question/answer
pairs, and Qwen3 configs small enough to train on two CPU cores. Nothing is
downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MODELS",
    "PROMPT",
    "QA",
    "TARGET",
    "CharTokenizer",
    "ToyModel",
    "build_model",
    "greedy",
    "layer_groups",
    "training_batch",
]

QA: tuple[tuple[str, str], ...] = (
    ("What does deltasync ship?", "sparse bit-exact patches"),
    ("Where do patches go?", "into object storage"),
    ("Who waits for the network?", "nobody, ever"),
    ("How often is there an anchor?", "every few dozen steps"),
    ("What changes per step?", "a few percent of bf16 bits"),
    ("Is the copy exact?", "yes, bit for bit"),
)
"""Question/answer pairs the trainer learns; the UI watches the first one."""

PROMPT = f"Q: {QA[0][0]}\nA:"
"""The fixed prompt the inference copy answers after every applied step."""

TARGET = " " + QA[0][1]
"""What a trained model answers to :data:`PROMPT`."""

MODELS: dict[str, dict[str, Any]] = {
    # ~0.4M parameters: visibly learns in well under a minute on 2 CPU cores
    "small": dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
    ),
    # for tests: a few seconds
    "tiny": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
    ),
}
"""Named Qwen3 shapes (``--model``)."""


class CharTokenizer:
    """Printable ASCII plus newline; id 0 is padding, id 1 end of text."""

    PAD = 0
    EOS = 1

    def __init__(self) -> None:
        self.chars = ["<pad>", "<eos>", "\n", *(chr(c) for c in range(32, 127))]
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; characters outside the vocabulary become ``?``."""
        unk = self._ids["?"]
        return [self._ids.get(c, unk) for c in text]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, stopping at the first end-of-text."""
        out = []
        for i in ids:
            if i == self.EOS:
                break
            if i > self.EOS:
                out.append(self.chars[i])
        return "".join(out)


@dataclass(frozen=True, slots=True)
class ToyModel:
    """A model name, its transformers config and the tokenizer."""

    name: str
    config: Any
    tokenizer: CharTokenizer


def build_model(name: str, *, seed: int = 0, dtype: Any = None) -> tuple[ToyModel, Any]:
    """A randomly initialised ``Qwen3ForCausalLM`` of shape ``MODELS[name]``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if name not in MODELS:
        raise ValueError(f"unknown demo model {name!r}; choose one of {sorted(MODELS)}")
    tok = CharTokenizer()
    config = Qwen3Config(
        vocab_size=tok.vocab_size,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tok.PAD,
        eos_token_id=tok.EOS,
        bos_token_id=tok.EOS,
        **MODELS[name],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.train(False)
    return ToyModel(name, config, tok), model


def training_batch(tok: CharTokenizer) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, labels)`` over all pairs; loss only on the answers."""
    import torch

    rows, labels = [], []
    for q, a in QA:
        prompt = tok.encode(f"Q: {q}\nA:")
        answer = tok.encode(" " + a) + [tok.EOS]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, mask, lab


def greedy(model: Any, tok: CharTokenizer, prompt: str = PROMPT, max_new: int = 32) -> str:
    """Greedy continuation of ``prompt`` (without the prompt), up to end-of-text or a newline."""
    import torch

    # no KV cache: the whole sequence each token (a few ms on the toy model), so no dependence on the
    # cache argument's name, which transformers renamed (past_key_values -> cache in 5.x)
    ids = tok.encode(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new):
            res = model(input_ids=torch.tensor([ids + out]), use_cache=False)
            nxt = int(res.logits[0, -1].float().argmax())
            if nxt in (tok.EOS, tok.PAD) or tok.chars[nxt] == "\n":
                break
            out.append(nxt)
    return tok.decode(out)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_groups(names: list[str]) -> list[tuple[str, list[str]]]:
    """Tensor names grouped for the per-layer heatmap: embed, layer 0..n-1, norm, lm_head."""
    groups: dict[str, list[str]] = {}
    order: list[tuple[int, str]] = []
    for n in names:
        m = _LAYER.search(n)
        if m:
            key, rank = f"layer {int(m.group(1))}", 1 + int(m.group(1))
        elif "embed" in n:
            key, rank = "embed", 0
        elif "lm_head" in n:
            key, rank = "lm_head", 1_000_001
        else:
            key, rank = "norm", 1_000_000
        if key not in groups:
            groups[key] = []
            order.append((rank, key))
        groups[key].append(n)
    return [(k, groups[k]) for _, k in sorted(order)]
