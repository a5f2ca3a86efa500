"""What deltasync's engine-core hook decides, without vLLM (``deltasync/integrations/vllm/engine_core.py``).

Which RPCs count as weight updates, and what :func:`reset_caches` asks of the engine core. The
engine core here is a stand-in recording calls: the real one runs in ``test_vllm_backend.py``, where
the same prompts are served before and after real updates and must come out as a fresh engine's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from deltasync.errors import DeltaSyncError
from deltasync.integrations.vllm.engine_core import BACKEND, changes_weights, reset_caches


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "backend", "expected"),
    [
        ("update_weights", (), {"update_info": {"store": "s", "step": 3}}, BACKEND, True),
        ("update_weights", ({"step": 3},), None, BACKEND, True),  # update_info passed positionally
        ("update_weights", (), {"update_info": [{"step": 3}, {"step": 3}]}, BACKEND, True),  # one per rank
        ("update_weights", (), {"update_info": {"step": 3, "prepare_only": True}}, BACKEND, False),
        ("update_weights", (), {"update_info": [{"prepare_only": True}, {"step": 3}]}, BACKEND, True),
        ("update_weights", (), {"update_info": {"step": 3}}, "nccl", False),  # another backend's business
        ("update_weights", (), {"update_info": {"step": 3}}, None, False),
        ("deltasync_update", (), {"step": 3}, None, True),  # the worker extension, any backend
        ("deltasync_prepare", (), {"step": 3}, BACKEND, False),
        ("start_weight_update", (), None, BACKEND, False),
        ("finish_weight_update", (), None, BACKEND, False),
        ("init_weight_transfer_engine", (), {"init_info": {}}, BACKEND, False),
        (print, (), None, BACKEND, False),  # a callable sent to the workers
    ],
)
def test_which_rpcs_change_the_weights(method: Any, args: Any, kwargs: Any, backend: Any, expected: bool) -> None:
    assert changes_weights(method, args, kwargs, backend) is expected


class Core:
    """Stand-in for vLLM's ``EngineCore``: the two resets, recorded."""

    def __init__(self, *, ok: bool | Exception = True, multimodal: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.ok = ok
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(is_multimodal_model=multimodal))

    def reset_prefix_cache(self, **kw: Any) -> bool:
        self.calls.append(("reset_prefix_cache", kw))
        if isinstance(self.ok, Exception):
            raise self.ok
        return self.ok

    def reset_encoder_cache(self) -> None:
        self.calls.append(("reset_encoder_cache", {}))


def test_reset_drops_the_prefix_cache_and_recomputes_running_requests() -> None:
    core = Core()
    reset_caches(core)
    assert core.calls == [("reset_prefix_cache", {"reset_running_requests": True, "reset_connector": True})]


def test_reset_drops_the_encoder_cache_of_a_multimodal_model() -> None:
    core = Core(multimodal=True)
    reset_caches(core)
    assert [name for name, _ in core.calls] == ["reset_prefix_cache", "reset_encoder_cache"]


@pytest.mark.parametrize("outcome", [False, RuntimeError("requests waiting for remote KV transfer")])
def test_a_cache_that_cannot_be_dropped_is_an_error_naming_the_call_to_retry(outcome: bool | Exception) -> None:
    core = Core(ok=outcome)
    with pytest.raises(DeltaSyncError, match=r"reset_prefix_cache\(reset_running_requests=True") as info:
        reset_caches(core)
    assert "restart the engine" in str(info.value)
    if isinstance(outcome, Exception):
        assert "remote KV transfer" in str(info.value)
