"""A LoRA adapter run's config (SPEC.md "Adapter runs"): ``adapter_config.json`` at the run's root.

A run whose root holds ``adapter_config.json`` is an *adapter run*: its steps hold one PEFT LoRA
adapter's tensors only, under the names PEFT saves them with
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]``), and
the object is that adapter's PEFT config, as ``save_pretrained`` writes it (``inference_mode``
true). It is written once, before the run's first step, and never replaced: readers write it next
to ``adapter_model.safetensors`` and the pair is a PEFT adapter dir that vLLM and PEFT load as it is.
A run without it holds full weights.

This module is pure (JSON and names): what vLLM can serve is checked here
(:meth:`AdapterConfig.check_servable`, :func:`check_adapter_names`); the PEFT model and the store
are :mod:`deltasync.run.adapter`'s.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deltasync.errors import AdapterMismatch, ProtocolError, UnsupportedAdapter

__all__ = [
    "ADAPTER_CONFIG_KEY",
    "ADAPTER_WEIGHTS_NAME",
    "MAX_ADAPTER_CONFIG_BYTES",
    "READER_IGNORES",
    "AdapterConfig",
    "AdapterMismatch",
    "UnsupportedAdapter",
    "check_adapter_names",
]

#: the run-level object that makes a run an adapter run (and the file name in an adapter dir)
ADAPTER_CONFIG_KEY = "adapter_config.json"
#: the one weights file of an adapter dir (as PEFT's ``save_pretrained`` names it)
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
#: the most bytes ``adapter_config.json`` may hold (what is there is read no further)
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: fields not compared between two configs of a run (the PEFT release that wrote them)
_NOT_COMPARED = frozenset({"peft_version"})
#: fields a reader's PEFT model may hold otherwise than the run (where its base was loaded from, its task)
READER_IGNORES = frozenset({"base_model_name_or_path", "revision", "task_type", "auto_mapping", "inference_mode"})
#: the tensor-name endings of a LoRA adapter vLLM serves
_LORA_ENDINGS = (".lora_A.weight", ".lora_B.weight")
_NEW_RUN = "push it to a new run prefix (a run's adapter config is written once and never replaced)"


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: sets as sorted lists, enums as their values, tuples as lists."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """A PEFT adapter config as stored in a run (``fields``: the JSON object, plain values only)."""

    fields: Mapping[str, Any]

    @classmethod
    def from_peft(cls, config: Mapping[str, Any]) -> AdapterConfig:
        """From a PEFT config's ``to_dict()``, as ``save_pretrained`` writes it (``inference_mode`` true)."""
        fields = _plain(config)
        fields["inference_mode"] = True
        return cls(fields)

    @classmethod
    def from_json(cls, body: bytes) -> AdapterConfig:
        """Parse ``adapter_config.json`` (ProtocolError when it is not a JSON object with ``r`` and ``peft_type``)."""
        try:
            fields = json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"{ADAPTER_CONFIG_KEY} is not JSON: {exc}") from None
        if not isinstance(fields, dict) or "peft_type" not in fields or "r" not in fields:
            raise ProtocolError(f"{ADAPTER_CONFIG_KEY} is not a PEFT adapter config (no peft_type or r)")
        return cls(fields)

    def to_json(self) -> bytes:
        """The bytes stored (and written into adapter dirs): sorted keys, indented as PEFT writes it."""
        return json.dumps(dict(self.fields), indent=2, sort_keys=True).encode()

    @property
    def rank(self) -> int:
        """The LoRA rank ``r``."""
        return int(self.fields["r"])

    def differences(self, other: AdapterConfig, ignore: Iterable[str] = ()) -> list[str]:
        """``field: mine -> other's`` for every field that differs (``peft_version`` and ``ignore`` not compared)."""
        keys = sorted((set(self.fields) | set(other.fields)) - _NOT_COMPARED - set(ignore))
        a, b = self.fields, other.fields
        return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]

    def check_servable(self) -> None:
        """Refuse (UnsupportedAdapter, naming the field and the way out) what vLLM cannot serve from an adapter dir."""
        f = self.fields
        if str(f.get("peft_type")) != "LORA":
            raise UnsupportedAdapter(
                f"peft_type={f.get('peft_type')!r}: only LoRA adapters are served by vLLM; use peft.LoraConfig"
            )
        if f.get("modules_to_save"):
            raise UnsupportedAdapter(
                f"modules_to_save={f['modules_to_save']!r}: vLLM loads LoRA tensors only, not fully trained modules; "
                "train without modules_to_save (LoraConfig(modules_to_save=None), or a task_type that adds none)"
            )
        if f.get("use_dora"):
            raise UnsupportedAdapter("use_dora=True: vLLM does not serve DoRA adapters; train with use_dora=False")
        if f.get("bias", "none") != "none":
            raise UnsupportedAdapter(
                f"bias={f['bias']!r}: vLLM does not load trained biases from an adapter; train with bias='none'"
            )
        if f.get("lora_bias"):
            raise UnsupportedAdapter("lora_bias=True: vLLM does not load a lora_B bias; train with lora_bias=False")
        if f.get("trainable_token_indices"):
            raise UnsupportedAdapter(
                "trainable_token_indices is set: vLLM does not serve trainable tokens; train without it"
            )
        targets = f.get("target_modules")
        if isinstance(targets, list) and "lm_head" in targets:
            raise UnsupportedAdapter(
                "target_modules includes 'lm_head': vLLM does not serve LoRA on lm_head; leave it out of target_modules"
            )

    def check_same(self, run: AdapterConfig, where: str, ignore: Iterable[str] = ()) -> None:
        """Raise AdapterMismatch naming each field where this adapter's config differs from ``run``'s
        (``ignore``: fields not compared, e.g. :data:`READER_IGNORES`)."""
        diff = run.differences(self, ignore)
        if diff:
            raise AdapterMismatch(
                f"{where}: this adapter's config differs from the run's {ADAPTER_CONFIG_KEY} "
                f"({'; '.join(diff)}): {_NEW_RUN}, or keep the run's config"
            )


def check_adapter_names(names: Iterable[str]) -> None:
    """Refuse (UnsupportedAdapter) a tensor vLLM cannot load from an adapter dir: any name but
    ``*.lora_A.weight`` / ``*.lora_B.weight``, and LoRA on ``lm_head``."""
    seen = False
    for name in names:
        seen = True
        if not name.endswith(_LORA_ENDINGS):
            raise UnsupportedAdapter(
                f"adapter tensor {name!r} is not a LoRA A/B matrix (a DoRA magnitude, a bias, an embedding or a "
                "module to save?): vLLM loads lora_A/lora_B weights only; train without it"
            )
        if ".lm_head." in f".{name}":
            raise UnsupportedAdapter(
                f"adapter tensor {name!r} is LoRA on lm_head: vLLM does not serve it; leave lm_head out of "
                "target_modules"
            )
    if not seen:
        raise UnsupportedAdapter("the adapter holds no LoRA tensor: nothing to push")
