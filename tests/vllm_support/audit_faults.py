"""TEST-ONLY faults for the behavioural audit's tests (tests/integrations/test_vllm_audit.py).

A vLLM worker extension (``--worker-extension-cls audit_faults.FaultWorkerExtension``) that is
deltasync's own plus methods a test calls over ``POST /collective_rpc`` to break one engine on
purpose, each the way the audit must catch:

* the prefix-cache reset skipped: while the file ``skip_cache_reset`` exists in the folder named by
  ``$DELTASYNC_TEST_FAULTS`` (set for one server only), every prefix-cache reset of that engine does
  nothing and says it succeeded (the engine core's ``reset_prefix_cache``: deltasync's engine-core
  hook, the driver's ``/reset_prefix_cache`` and ``/pause?clear_cache=true`` all end there;
  ``sitecustomize._patch_engine_core`` patches it when the engine core's module is imported).
* ``fault_write_after_update(name, scale)``: right after the next update, multiply parameter or buffer
  ``name`` by ``scale`` (default -1: negate it): a second writer behind the sync's back, or derived
  state gone stale (the manifest's digests stay right); ``fault_restore()`` puts it back.
* ``fault_skip_next_update()``: the next update changes nothing but says it served the step (the
  engine stays one step behind while it reports the new version).

Nothing outside tests/ uses this; production code must never depend on it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from deltasync.integrations.vllm.backend import DeltasyncWorkerExtension, _state_of


class FaultWorkerExtension(DeltasyncWorkerExtension):
    """deltasync's worker API plus the test-only faults above."""

    def _wrap_next_update(self, after: Any) -> None:
        sync = _state_of(self)
        original = type(sync).update.__get__(sync)

        def update(store: str | None, step: int | None) -> Any:
            del sync.update  # once
            return after(original, store, step)

        sync.update = update  # type: ignore[method-assign]

    def fault_write_after_update(self, name: str, scale: float | str = -1.0) -> str:
        model = self.model_runner.model  # type: ignore[attr-defined]
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))  # derived state: rotary caches
        p = tensors[name]

        def after(original: Any, store: str | None, step: int | None) -> Any:
            out = original(store, step)
            self._fault_saved = (p, p.detach().clone())  # type: ignore[attr-defined]
            p.data.mul_(float(scale))
            return out

        self._wrap_next_update(after)
        return name

    def fault_restore(self) -> bool:
        saved = getattr(self, "_fault_saved", None)
        if saved is None:
            return False
        p, original = saved
        p.data.copy_(original)
        self._fault_saved = None  # type: ignore[attr-defined]
        return True

    def fault_skip_next_update(self) -> bool:
        sync = _state_of(self)

        def after(original: Any, store: str | None, step: int | None) -> Any:
            mirror = sync.mirror_for(store)
            mirror.serving = step  # claims the step, loads nothing
            return replace(sync.status(), report=None)

        self._wrap_next_update(after)
        return True
