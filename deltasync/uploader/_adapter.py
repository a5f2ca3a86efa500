"""push() of a PEFT model: the active LoRA adapter's tensors, and the run's ``adapter_config.json`` kept.

:class:`AdapterGuard` is the uploader's one owner of what kind of run it writes: the first push of
a PEFT model writes the run's adapter config once (or finds the same one there: a restarted
trainer), every later push is checked against it (rank, alpha, target modules, base model... any
field but ``peft_version``), and a full state pushed after an adapter (or an adapter onto a run that
already holds full weights) is refused. A push of a plain state dict on a run that never saw an
adapter costs one class check and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deltasync.run.adapter import (
    AdapterConfig,
    AdapterMismatch,
    UnsupportedAdapter,
    adapter_config_of,
    adapter_state,
    is_peft_model,
    read_adapter_config,
    write_adapter_config,
)
from deltasync.storage import Store

if TYPE_CHECKING:
    import torch

__all__ = ["AdapterGuard"]


class AdapterGuard:
    """Turns a pushed PEFT model into its adapter's state and keeps the run's adapter config (module doc)."""

    def __init__(self, store: Store, last_step: Callable[[], int | None], *, sharded: bool) -> None:
        self.store = store
        self._last_step = last_step  # the newest step pushed or committed (None: an empty run)
        self._sharded = sharded
        #: the run's adapter config once this uploader pushed an adapter (None: not an adapter run yet)
        self.config: AdapterConfig | None = None

    def state_of(self, state: Any) -> Any:
        """``state`` as push() diffs it: a PEFT model's adapter tensors (checked against the run's
        config, written on the first push), anything else as it is (refused after an adapter)."""
        if not is_peft_model(state):
            if self.config is not None:
                raise AdapterMismatch(
                    f"{self.store.url} is an adapter run (this uploader pushed a PEFT adapter): a full state cannot "
                    "join it; push the PEFT model itself, or the full weights to a new run prefix"
                )
            return state
        if self._sharded:
            raise UnsupportedAdapter(
                "a sharded push of a PEFT adapter is not supported (an adapter is small): gather it and push from "
                "one process, DeltaUploader(..., distributed=False)"
            )
        config = adapter_config_of(state)
        if self.config is None:
            if read_adapter_config(self.store) is None and (last := self._last_step()) is not None:
                raise AdapterMismatch(
                    f"{self.store.url} holds full weights (step {last} was pushed without an adapter config): an "
                    "adapter cannot join a full-weights run; push the adapter to a new run prefix"
                )
            write_adapter_config(self.store, config)  # AdapterMismatch when the run holds another config
            self.config = config
        else:
            config.check_same(self.config, self.store.url)
        tensors: dict[str, torch.Tensor] = adapter_state(state)
        return tensors
