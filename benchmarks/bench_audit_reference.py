"""What the trainer-side reference of the behavioural audit costs, side by side with a training step.

    python benchmarks/bench_audit_reference.py [--hidden 512] [--layers 4] [--vocab 32000] [--repeats 5]

A Qwen3-architecture model (random init, fp32 on CPU) trains with AdamW on batches of 4 x 256
tokens; the same run times, as medians over ``--repeats``:

- one training step (forward, backward, optimizer step): the baseline;
- ``probe_logprobs``: the reference forward of the default probes (8 x 32 tokens, no grad);
- ``DeltaUploader.attach_reference``: what the caller waits for (the forward, the object built;
  the write happens on the uploader's background worker), on a local store;
- the reference object's size.

Prints a markdown table; the ratio column is the reference's cost in training steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import deltasync as ds
from deltasync.protocol.probes import Reference
from deltasync.run.probes import default_probes
from deltasync.uploader._reference import probe_logprobs


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 3,
        num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64),
        num_key_value_heads=max(1, a.hidden // 128),
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = Qwen3ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, a.vocab, (4, 256))

    def train_step() -> None:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    probes = default_probes(a.vocab, "bench-audit")
    train_step()  # warm-up
    probe_logprobs(model, probes)
    train = statistics.median(_time(train_step) for _ in range(a.repeats))
    forward = statistics.median(_time(lambda: probe_logprobs(model, probes)) for _ in range(a.repeats))
    with tempfile.TemporaryDirectory() as tmp, ds.DeltaUploader(ds.open_store(tmp)) as up:
        up.push(model.state_dict(), 0).result()
        up.probes(probes)
        attach = statistics.median(
            _time(lambda s=s: up.attach_reference(s, model))
            for s in range(1, a.repeats + 1)  # type: ignore[misc]
        )
        up.flush()
    size = len(Reference(0, probes.digest, probe_logprobs(model, probes), "float32").to_json())
    tokens = sum(len(t) for t in probes.tokens)
    print(f"Qwen3 shape: {params / 1e6:.1f}M params, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; fp32, CPU")
    print()
    print("| what | median | / training step |")
    print("|---|---:|---:|")
    print(f"| training step (4 x 256 tokens, fwd+bwd+AdamW) | {train * 1000:.0f} ms | 1 |")
    print(
        f"| reference forward ({len(probes.tokens)} x {tokens // len(probes.tokens)} tokens) | {forward * 1000:.1f} ms | {forward / train:.3f} |"
    )
    print(f"| attach_reference, caller's wait | {attach * 1000:.1f} ms | {attach / train:.3f} |")
    print(f"| reference object | {size} bytes | |")


if __name__ == "__main__":
    main()
