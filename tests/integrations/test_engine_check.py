"""check_engine: an engine whose parameters are not what it computes with is refused before any load.

The model here is a stand-in written the way vLLM's models load weights (``load_weights`` mapping
``q_proj``/``k_proj``/``v_proj`` into a fused ``qkv_proj`` through each parameter's
``weight_loader``, a CPU layer computing through ``cpu_linear``), because the forms vLLM gives its
parameters in quantized engines do not run on these CPU machines. The real engine case, vLLM's CPU
backend repacking fp32 linear weights, runs in ``test_vllm_backend.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltasync.errors import EngineIncompatible  # noqa: E402
from deltasync.integrations.vllm.engine_check import check_engine, landing_params  # noqa: E402

H = 8


def _copy_loader(param: Any, loaded: Any, shard: str | None = None) -> None:
    if shard is None:
        param.data.copy_(loaded)
        return
    rows = {"q": 0, "k": 1, "v": 2}[shard] * H
    param.data[rows : rows + H].copy_(loaded)


class Linear(torch.nn.Module):
    """A linear layer as vLLM's CPU backend leaves it: ``cpu_linear`` computes, from ``weight`` or from a copy."""

    def __init__(self, rows: int, dtype: Any = torch.bfloat16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, H, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = _copy_loader  # type: ignore[attr-defined]
        self.cpu_linear = torch.nn.functional.linear

    def repack(self, remove_weight: bool) -> None:
        """What ``dispatch_cpu_unquantized_gemm`` does with a packed kernel: compute from a copy."""
        packed = self.weight.detach().clone()
        self.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
        if remove_weight:
            self.weight = torch.nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)


class Model(torch.nn.Module):
    STACKED = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = Linear(3 * H)
        self.o_proj = Linear(H)
        self.lm_head = Linear(16)
        self.norm = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16), requires_grad=False)  # no weight_loader
        self.direct = False  # load like a model that writes params itself (needs real data)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            module = name.split(".")[0]
            if module in self.STACKED:
                target, shard = "qkv_proj.weight", self.STACKED[module]
            elif name in params:
                target, shard = name, None
            else:
                raise ValueError(f"There is no module or parameter named {name!r} in Model")
            param = params[target]
            if self.direct:
                param.data.copy_(tensor)
                continue
            loader = getattr(param, "weight_loader", _copy_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
        return loaded


def _layout(**extra: Any) -> dict[str, tuple[Any, tuple[int, ...]]]:
    out = {f"{n}.weight": (torch.bfloat16, (H, H)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out["lm_head.weight"] = (torch.bfloat16, (16, H))
    out["norm"] = (torch.bfloat16, (H,))
    out.update(extra)
    return out


def _loaders(model: Model) -> dict[str, Any]:
    return {n: getattr(p, "weight_loader", None) for n, p in model.named_parameters()}


def test_a_model_that_computes_with_its_parameters_passes_and_nothing_is_written() -> None:
    model = Model()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    loaders = _loaders(model)
    check_engine(model, _layout())
    assert _loaders(model) == loaders  # every weight_loader put back, none added (norm has none)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_the_model_s_own_mapping_decides_where_each_tensor_lands() -> None:
    hits = {(ckpt, param, shape) for ckpt, param, _, shape in landing_params(Model(), _layout())}
    assert hits == {
        ("q_proj.weight", "qkv_proj.weight", (H, H)),
        ("k_proj.weight", "qkv_proj.weight", (H, H)),
        ("v_proj.weight", "qkv_proj.weight", (H, H)),
        ("o_proj.weight", "o_proj.weight", (H, H)),
        ("lm_head.weight", "lm_head.weight", (16, H)),
        ("norm", "norm", (H,)),
    }


def test_a_quantized_engine_is_refused_by_its_setting() -> None:
    with pytest.raises(EngineIncompatible, match=r"quantized \(quantization='fp8'\).*without --quantization"):
        check_engine(Model(), _layout(), quantization="fp8")


def test_linear_weights_repacked_by_the_cpu_backend_are_refused_naming_them_and_the_cause() -> None:
    model = Model()
    model.qkv_proj.repack(remove_weight=True)
    model.o_proj.repack(remove_weight=True)
    model.lm_head.repack(remove_weight=False)  # kept, but computed from the copy
    with pytest.raises(EngineIncompatible) as info:
        check_engine(model, _layout())
    msg = str(info.value)
    assert "qkv_proj.weight (0,) bfloat16 <- q_proj.weight [8, 8] and 2 more" in msg  # k_proj, v_proj
    assert "o_proj.weight (0,) bfloat16 <- o_proj.weight [8, 8]" in msg
    assert "lm_head.weight (16, 8) bfloat16 <- lm_head.weight [16, 8]" in msg
    assert "3 of the parameters" in msg
    assert "dispatch_cpu_unquantized_gemm" in msg and "Nothing was loaded" in msg
    assert not hasattr(model.qkv_proj.weight, "weight_loader")  # the recorder was taken off again


def test_a_layer_computing_from_a_copy_is_refused_even_with_its_weight_in_place() -> None:
    model = Model()
    model.lm_head.repack(remove_weight=False)
    with pytest.raises(EngineIncompatible, match=r"1 of the parameters.*lm_head\.weight \(16, 8\)"):
        check_engine(model, _layout())


def test_vllm_s_fallback_lambda_is_accepted_and_any_closure_refused_as_docs_vllm_md_says() -> None:
    """docs/vllm.md: a function without free variables is accepted (vLLM's fallback computes from the weight
    it is passed); every closure is refused, even one that reads the layer's own weight."""
    model = Model()
    model.lm_head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    check_engine(model, _layout())
    layer = model.lm_head
    model.lm_head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, layer.weight, bias)
    with pytest.raises(EngineIncompatible, match=r"lm_head\.weight"):
        check_engine(model, _layout())


def test_parameters_in_another_form_than_the_checkpoint_are_refused() -> None:
    model = Model()
    model.o_proj.weight = torch.nn.Parameter(torch.zeros(H, H, dtype=torch.int8), requires_grad=False)
    with pytest.raises(EngineIncompatible, match=r"o_proj\.weight \(8, 8\) int8 .*quantized or packed"):
        check_engine(model, _layout())


def test_tensors_the_model_does_not_have_are_refused() -> None:
    with pytest.raises(EngineIncompatible, match="refuses the run's tensors.*extra.weight"):
        check_engine(Model(), _layout(**{"extra.weight": (torch.bfloat16, (H, H))}))


def test_a_model_whose_loading_needs_real_data_is_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    model = Model()
    model.direct = True
    loaders = _loaders(model)
    check_engine(model, _layout())  # cannot tell in advance: the first update will (and is rolled back)
    assert "cannot check in advance" in caplog.text
    assert _loaders(model) == loaders


class TiedModel(Model):
    """``lm_head`` is ``embed`` (one parameter, two names) and the loader skips ``lm_head.weight``, as
    vLLM's models do with ``tie_word_embeddings``; a ``rotary.inv_freq`` the loader skips for good."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = self.lm_head  # tied: named_parameters(remove_duplicate=False) names it twice

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        kept = ((n, t) for n, t in weights if n != "lm_head.weight" and not n.endswith("inv_freq"))
        return super().load_weights((n.replace("embed.", "lm_head."), t) for n, t in kept)


def test_a_tied_name_is_found_and_returned_with_the_name_it_is_tied_to(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="deltasync.vllm")
    layout = _layout(**{"embed.weight": (torch.bfloat16, (16, H)), "rotary.inv_freq": (torch.float32, (4,))})
    assert check_engine(TiedModel(), layout) == {"lm_head.weight": "embed.weight"}
    assert "ties lm_head.weight to embed.weight" in caplog.text
    assert "1 of the run's tensors land in no parameter" in caplog.text and "rotary.inv_freq" in caplog.text


def test_an_untied_model_has_no_tied_names() -> None:
    assert check_engine(Model(), _layout()) == {}
