"""Refuse, before anything is loaded, an engine whose parameters cannot take the run's tensors in place.

deltasync updates an engine by handing checkpoint tensors to the model's own ``load_weights``,
which copies them into the parameters vLLM built when it loaded the model. That makes the engine
compute with the new bits only where those parameters are what it computes with. They are not:

- in a **quantized** engine (``quantization=...``): vLLM converts the checkpoint's weights after
  loading them (``process_weights_after_loading``: quantized values, scales, packed layouts), and an
  in-place load of new weights does not redo that;
- where **vLLM's CPU backend repacked the linear weights** at load time for its own kernels
  (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: oneDNN, SGL or zentorch,
  picked by CPU and dtype): it replaces each linear layer's weight by an empty parameter (the first
  update would fail with ``Attempted to load weight ... into parameter (torch.Size([0]))``), or keeps
  it (``lm_head``) but computes from the packed copy, which no load reaches.

:func:`check_engine` finds both before the first update. It asks the model itself where each of
the run's tensors goes: ``load_weights`` runs on shape-only (``meta``) tensors while every
parameter's ``weight_loader`` is replaced by a recorder, so vLLM's own name mapping (fused
``qkv_proj`` / ``gate_up_proj``, renames, tied and skipped names, this rank's shard) decides, and
nothing is written. Each parameter that a tensor lands in must be a floating-point tensor of at
least 16 bits with elements, and its layer must compute from it (not from a copy captured when
the model was loaded).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from deltasync.errors import EngineIncompatible

__all__ = ["Layout", "check_engine", "landing_params", "tied_names"]

log = logging.getLogger("deltasync.vllm")

#: checkpoint name -> (dtype, shape) of the tensors an engine is to be loaded with
Layout = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
_MISSING = object()
_SHOWN = 3  # examples named in an error


def landing_params(model: torch.nn.Module, layout: Layout) -> list[tuple[str, str, torch.Tensor, tuple[int, ...]]]:
    """``(checkpoint name, parameter name, parameter, loaded shape)`` for every tensor of ``layout`` the
    model's ``load_weights`` hands to a parameter's ``weight_loader``; nothing is written.

    Raises what ``load_weights`` raises (a ``ValueError`` for a name the model does not have).
    """
    names = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    names.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    hits: list[tuple[str, str, torch.Tensor, tuple[int, ...]]] = []
    current = [""]  # the checkpoint name last handed to load_weights (it consumes them one by one)

    def record(param: torch.Tensor, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        hits.append((current[0], names.get(id(param), "?"), param, tuple(loaded.shape)))

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (dtype, shape) in layout.items():
            current[0] = name
            yield name, torch.empty(shape, dtype=dtype, device="meta")

    saved: list[tuple[torch.Tensor, Any]] = []
    try:
        for t in tensors.values():
            try:
                old = t.weight_loader  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - none, or a vLLM parameter whose loader is unset
                old = _MISSING
            t.weight_loader = record  # type: ignore[attr-defined]
            saved.append((t, old))
        with torch.no_grad():
            model.load_weights(weights())  # type: ignore[operator]
    finally:
        for t, old in saved:
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    del t.weight_loader  # type: ignore[attr-defined]
            else:
                t.weight_loader = old  # type: ignore[attr-defined]
    return hits


def tied_names(
    model: torch.nn.Module, layout: Layout, hits: list[tuple[str, str, torch.Tensor, tuple[int, ...]]]
) -> dict[str, str]:
    """Checkpoint names of ``layout`` that the engine ties to another of its names: name -> that name.

    A tied model (``tie_word_embeddings``: Qwen3-0.6B to 4B, Llama-3.2-1B/3B) holds one parameter under
    two names (``lm_head.weight`` is ``model.embed_tokens.weight``); its ``load_weights`` skips the tied
    name when the other one comes along, and refuses it alone. A name is tied here when it lands in no
    parameter (``hits``: :func:`landing_params` of the whole layout), the model has a parameter of that
    very name, and another checkpoint name of the same dtype and shape lands in that parameter. The
    engine is updated through the other name; the two must hold the same bits at every step.
    """
    landed = {ckpt for ckpt, _, _, _ in hits}
    into: dict[int, str] = {}  # parameter -> the first checkpoint name landing in it
    for ckpt, _, hit, _ in hits:
        into.setdefault(id(hit), ckpt)
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, str] = {}
    for name, spec in layout.items():
        param = params.get(name)
        if name in landed or param is None:
            continue
        target = into.get(id(param))
        if target is not None and target != name and layout.get(target) == spec:
            out[name] = target
    return out


def _module_of(model: torch.nn.Module, param_name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(param_name.rpartition(".")[0])
    except AttributeError:
        return None


def _computes_from_a_copy(module: torch.nn.Module | None) -> bool:
    """Whether vLLM's CPU GEMM dispatch gave this layer a kernel bound to a copy of its weight.

    ``dispatch_cpu_unquantized_gemm`` sets ``layer.cpu_linear``. Accepted: ``torch.nn.functional.linear``
    and any function without free variables (vLLM's fallback ``lambda x, weight, bias: F.linear(x, weight,
    bias)`` computes from the weight it is passed). Refused: every closure, whatever it holds (the packed
    kernels, oneDNN, SGL and zentorch, close over the copy they made; what a closure reads cannot be told).
    """
    fn = getattr(module, "cpu_linear", None)
    return fn is not None and fn is not torch.nn.functional.linear and bool(getattr(fn, "__closure__", None))


def check_engine(model: torch.nn.Module, layout: Layout, *, quantization: str | None = None) -> dict[str, str]:
    """Raise :class:`~deltasync.errors.EngineIncompatible` unless every tensor of ``layout`` (by
    checkpoint name) can be loaded into ``model`` in place and computed with (see the module docstring).

    Returns the run's names that the engine ties to another one (:func:`tied_names`): they are never
    loaded themselves, and must equal the name they are tied to. Names the engine's loader skips
    for good (landing in no parameter, tied to none: buffers it computes itself, such as rotary
    tables) are logged once and still handed to the loader, which skips them as at start-up.

    quantization: the engine's ``model_config.quantization``.
    """
    if quantization:
        raise EngineIncompatible(
            f"this engine is quantized (quantization={quantization!r}): vLLM converts the checkpoint's weights "
            "when it loads them, and an in-place update of the run's weights cannot redo that; deltasync updates "
            "unquantized engines only: start the engine without --quantization, from an unquantized checkpoint "
            "of the run (deltasync fetch --out DIR)"
        )
    hits = _traced(model, layout)
    if hits is None:
        return {}
    tied = tied_names(model, layout, hits)
    _log_unloaded(layout, hits, tied)
    found, cpu_repacked = _not_computed_with(model, hits)
    if found:
        raise _refusal(found, cpu_repacked)
    return tied


Hit = tuple[str, str, torch.Tensor, tuple[int, ...]]


def _traced(model: torch.nn.Module, layout: Layout) -> list[Hit] | None:
    """:func:`landing_params`; None where the loader cannot run on shape-only tensors (logged)."""
    try:
        return landing_params(model, layout)
    except (ValueError, KeyError) as exc:
        raise EngineIncompatible(
            f"this engine's load_weights refuses the run's tensors ({type(exc).__name__}: {exc}): the run is not "
            "this model's checkpoint (another architecture or config?); start the engine from a checkpoint of the "
            "run (deltasync fetch --out DIR --config-from BASE_MODEL_DIR)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - a load_weights that needs real data (meta tensors)
        log.warning(
            "cannot check in advance that this engine takes the run's tensors in place (%s: %s); the first "
            "update will tell (an engine that refuses a load is rolled back)",
            type(exc).__name__,
            exc,
        )
        return None


def _log_unloaded(layout: Layout, hits: list[Hit], tied: Mapping[str, str]) -> None:
    """Say which of the run's names the engine ties, and which its loader skips."""
    landed = {ckpt for ckpt, _, _, _ in hits}
    skipped = [n for n in layout if n not in landed and n not in tied]
    if tied:
        log.info("the engine ties %s: updated through the names they are tied to", _pairs(tied))
    if skipped:
        log.info(
            "%d of the run's tensors land in no parameter of this engine (its loader skips them, as when it "
            "started): %s",
            len(skipped),
            ", ".join(skipped[:_SHOWN]) + (f" and {len(skipped) - _SHOWN} more" if len(skipped) > _SHOWN else ""),
        )


def _not_computed_with(model: torch.nn.Module, hits: list[Hit]) -> tuple[list[tuple[int, str]], bool]:
    """The parameters tensors land in that are not what the engine computes with: ``(kind, what)``
    (kind 0 empty, 1 another form, 2 computed from a copy), and whether vLLM's CPU backend repacked any."""
    sources: dict[str, list[str]] = {}  # parameter -> the checkpoint tensors that land in it
    params: dict[str, torch.Tensor] = {}
    for ckpt, pname, param, shape in hits:
        sources.setdefault(pname, []).append(f"{ckpt} {list(shape)}")
        params[pname] = param
    found: list[tuple[int, str]] = []
    cpu_repacked = False
    for pname, param in params.items():
        module = _module_of(model, pname)
        if param.numel() == 0:
            kind, cpu_repacked = 0, cpu_repacked or hasattr(module, "cpu_linear")
        elif not param.is_floating_point() or param.element_size() < 2:
            kind = 1
        elif _computes_from_a_copy(module):
            kind, cpu_repacked = 2, True
        else:
            continue
        into = sources[pname]
        more = f" and {len(into) - 1} more" if len(into) > 1 else ""
        found.append(
            (kind, f"{pname} {tuple(param.shape)} {str(param.dtype).removeprefix('torch.')} <- {into[0]}{more}")
        )
    return found, cpu_repacked


def _refusal(found: list[tuple[int, str]], cpu_repacked: bool) -> EngineIncompatible:
    bad = [what for _, what in sorted(found, key=lambda f: f[0])]
    examples = "; ".join(bad[:_SHOWN]) + (f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")
    if cpu_repacked:
        cause = (
            "vLLM's CPU backend repacked these linear weights for its own kernels when it loaded the model "
            "(vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm: oneDNN, SGL or zentorch, picked by "
            "CPU and dtype: fp32 is packed for oneDNN) and computes from the packed copies, which load_weights "
            "cannot reach; vLLM has no option to keep plain weights: update this model on a GPU engine"
        )
    else:
        cause = (
            "its parameters hold weights in another form than the checkpoint (quantized or packed); deltasync "
            "updates engines whose parameters are the checkpoint's tensors (bf16, fp16 or fp32)"
        )
    return EngineIncompatible(
        f"deltasync cannot update this engine in place: {len(bad)} of the parameters the run's tensors load into "
        f"are not what it computes with ({examples}). Cause: {cause}. Nothing was loaded"
    )


def _pairs(tied: Mapping[str, str]) -> str:
    return ", ".join(f"{a} to {b}" for a, b in list(tied.items())[:_SHOWN]) + (
        f" and {len(tied) - _SHOWN} more" if len(tied) > _SHOWN else ""
    )
