"""Bytes per step of a LoRA run through deltasync: the adapter (docs/lora.md) against the merged weights.

The same training (real AdamW steps on a PEFT LoRA adapter of a randomly initialised Qwen3, a
language-model loss on random tokens) pushed two ways, each into its own local store, each step
after an anchor at step 0:

- ``adapter``: ``DeltaUploader.push(peft_model, step)``: the active adapter's LoRA tensors, in the
  trainer's dtype (fp32), as deltasync pushes a PEFT model;
- ``adapter bf16``: the same with ``cast_dtype=torch.bfloat16`` (half the bytes, no longer bit-exact
  to the fp32 adapter the trainer holds);
- ``merged``: the merged weights ``W + scale * B @ A`` cast to bf16, as TRL 1.16 hands an injected
  weight transfer (every element of every adapted matrix may change each step).

Prints a markdown table of the committed bytes per patch step (median, max) and the ratio. No
timing is measured. Run: ``python benchmarks/bench_lora_bytes.py --hidden 1024 --layers 4 --rank 16``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Setup:
    """The model and adapter measured."""

    hidden: int = 64
    layers: int = 2
    vocab: int = 256
    rank: int = 4
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 5
    lr: float = 1e-4


DEFAULT = Setup()


@dataclass(frozen=True, slots=True)
class Figures:
    """Committed bytes of each patch step (steps 1..n), per path."""

    adapter: tuple[int, ...]
    adapter_bf16: tuple[int, ...]
    merged: tuple[int, ...]


def model_of(s: Setup) -> Any:
    """A random Qwen3 of the setup's shape with a LoRA adapter (B initialised to zero, as PEFT does)."""
    import peft
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(1, s.hidden // 64)
    config = Qwen3Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=3 * s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=s.hidden // heads,
    )
    lora = peft.LoraConfig(r=s.rank, lora_alpha=2 * s.rank, target_modules=list(s.targets))
    return peft.get_peft_model(Qwen3ForCausalLM(config), lora)


def measure(s: Setup, root: Path) -> Figures:
    """Train ``s.steps`` AdamW steps, pushing each state both ways; the bytes of each patch step."""
    import torch

    import deltasync as ds

    model = model_of(s)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    g = torch.Generator().manual_seed(0)
    adapter: list[int] = []
    adapter_bf16: list[int] = []
    merged: list[int] = []
    options: dict[str, Any] = {"anchor_every": 10**6, "anchor_bytes_fraction": 0}
    with (
        ds.DeltaUploader(ds.open_store(root / "adapter"), **options) as a_up,
        ds.DeltaUploader(ds.open_store(root / "adapter-bf16"), cast_dtype=torch.bfloat16, **options) as b_up,
        ds.DeltaUploader(ds.open_store(root / "merged"), cast_dtype=torch.bfloat16, **options) as m_up,
    ):
        for step in range(s.steps + 1):
            if step:
                x = torch.randint(0, s.vocab, (2, 32), generator=g)
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            state = copy.deepcopy(model).merge_and_unload().state_dict()
            a_info = a_up.push(model, step).result(timeout=600)
            b_info = b_up.push(model, step).result(timeout=600)
            m_info = m_up.push(state, step).result(timeout=600)
            del state
            if step:
                adapter.append(a_info.nbytes)
                adapter_bf16.append(b_info.nbytes)
                merged.append(m_info.nbytes)
    return Figures(tuple(adapter), tuple(adapter_bf16), tuple(merged))


def table(s: Setup, f: Figures) -> str:
    """The figures as a markdown table."""
    a_med, b_med, m_med = statistics.median(f.adapter), statistics.median(f.adapter_bf16), statistics.median(f.merged)
    head = (
        f"Qwen3-shaped, hidden {s.hidden}, {s.layers} layers, vocab {s.vocab}; LoRA rank {s.rank} on "
        f"{', '.join(s.targets)}; {s.steps} AdamW steps at lr {s.lr:g} after an anchor\n\n"
        "| path | bytes per step (median) | max | vs adapter |\n|---|---:|---:|---:|\n"
    )
    rows = [
        f"| adapter (fp32, as trained) | {a_med:,.0f} | {max(f.adapter):,} | 1.0x |",
        f"| adapter, cast_dtype=bf16 | {b_med:,.0f} | {max(f.adapter_bf16):,} | {b_med / a_med:.2f}x |",
        f"| merged weights (bf16, TRL's merged sync) | {m_med:,.0f} | {max(f.merged):,} | {m_med / a_med:.1f}x |",
    ]
    return head + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--hidden", type=int, default=DEFAULT.hidden)
    p.add_argument("--layers", type=int, default=DEFAULT.layers)
    p.add_argument("--vocab", type=int, default=DEFAULT.vocab)
    p.add_argument("--rank", type=int, default=DEFAULT.rank)
    p.add_argument("--targets", default=",".join(DEFAULT.targets), help="comma-separated target modules")
    p.add_argument("--steps", type=int, default=DEFAULT.steps)
    p.add_argument("--lr", type=float, default=DEFAULT.lr)
    a = p.parse_args(argv)
    s = Setup(a.hidden, a.layers, a.vocab, a.rank, tuple(a.targets.split(",")), a.steps, a.lr)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        print(table(s, measure(s, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
