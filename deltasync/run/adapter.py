"""A run's LoRA adapter: its ``adapter_config.json`` over a store, and a PEFT model's adapter as tensors.

The store side: :func:`write_adapter_config` creates the run's config once (as
:func:`deltasync.run.probes.write_probes` does ``probes.json``), :func:`read_adapter_config` reads it
(None: a full-weights run). The model side, without importing ``peft`` until a PEFT model is met:
:func:`is_peft_model`, :func:`adapter_config_of` (the active adapter's config, checked servable),
:func:`adapter_state` (its LoRA tensors under PEFT's saved names, as ``get_peft_model_state_dict``
gives them) and :func:`adapter_parameters` (the live Parameters under those names, for an in-place
sync). See :mod:`deltasync.protocol.adapter` for the run layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltasync.errors import AlreadyExists, ObjectNotFound, ProtocolError
from deltasync.protocol.adapter import (
    ADAPTER_CONFIG_KEY,
    MAX_ADAPTER_CONFIG_BYTES,
    AdapterConfig,
    AdapterMismatch,
    UnsupportedAdapter,
    check_adapter_names,
)
from deltasync.storage.base import Store

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdapterConfig",
    "AdapterMismatch",
    "UnsupportedAdapter",
    "active_adapter",
    "adapter_config_of",
    "adapter_parameters",
    "adapter_state",
    "is_peft_model",
    "read_adapter_config",
    "write_adapter_config",
]


# ------------------------------------------------------------------ the store


def read_adapter_config(store: Store) -> AdapterConfig | None:
    """The run's adapter config, or None for a full-weights run (ProtocolError when it is damaged)."""
    try:
        body = store.get_bounded(ADAPTER_CONFIG_KEY, MAX_ADAPTER_CONFIG_BYTES)
    except ObjectNotFound:
        return None
    try:
        return AdapterConfig.from_json(body)
    except ProtocolError as exc:
        raise ProtocolError(f"{store.url}: {exc}") from None


def write_adapter_config(store: Store, config: AdapterConfig) -> bool:
    """Store the run's adapter config once; True when written, False when an equal one was there.

    Raises AdapterMismatch naming the fields when the run holds another config (an equal one but
    for ``peft_version`` is the same: the stored one stays).
    """
    body = config.to_json()
    stored = read_adapter_config(store)
    if stored is None:
        try:
            store.put(ADAPTER_CONFIG_KEY, body, mode="create")
        except AlreadyExists:
            pass  # a racing writer created it first: compared below
        else:
            if store.supports_conditional_put:
                return True
        stored = read_adapter_config(store)
        if stored is None:
            raise ObjectNotFound(f"{store.url}: {ADAPTER_CONFIG_KEY} was written but cannot be read back")
        if stored.to_json() == body:
            return True
    config.check_same(stored, store.url)
    return False


# ------------------------------------------------------------------ the model


def is_peft_model(obj: Any) -> bool:
    """True for a ``peft.PeftModel`` (any subclass), told by its class, without importing peft."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft") for c in type(obj).__mro__)


def active_adapter(model: Any) -> str:
    """The name of ``model``'s one active adapter (UnsupportedAdapter when several are active, or none)."""
    active = list(getattr(model, "active_adapters", None) or [])
    if len(active) != 1:
        raise UnsupportedAdapter(
            f"the PEFT model has {len(active)} active adapters ({active}): vLLM serves one adapter per request; "
            "set one active (model.set_adapter(name)) before pushing"
        )
    return str(active[0])


def adapter_config_of(model: Any) -> AdapterConfig:
    """The active adapter's config as PEFT saves it, refused (UnsupportedAdapter) where vLLM cannot serve it."""
    name = active_adapter(model)
    config = AdapterConfig.from_peft(model.peft_config[name].to_dict())
    config.check_servable()
    return config


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under PEFT's saved names (``get_peft_model_state_dict``), refused
    (UnsupportedAdapter) when one is not a LoRA A/B matrix vLLM serves."""
    from peft import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = dict(get_peft_model_state_dict(model, adapter_name=active_adapter(model)))
    check_adapter_names(state)
    return state


def adapter_parameters(model: Any) -> dict[str, Any]:
    """The live Parameters of the active adapter, by PEFT's saved names (``...lora_A.<adapter>.weight``
    -> ``...lora_A.weight``): what an in-place sync writes into. UnsupportedAdapter as :func:`adapter_state`."""
    name = active_adapter(model)
    params: dict[str, Any] = {}
    for key, p in model.named_parameters():
        for part in ("lora_A", "lora_B"):
            infix = f".{part}.{name}."
            if infix in key:
                params[key.replace(infix, f".{part}.", 1)] = p
    check_adapter_names(params)
    return dict(sorted(params.items()))
