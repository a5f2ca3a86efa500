"""The vLLM version pin and the internals the adapter patches (``integrations/vllm/compat.py``), without vLLM.

A stand-in ``vllm.v1.engine.core`` module (put in ``sys.modules``) plays vLLM's engine core: the
hook is installed on it and routes deltasync's RPCs to a stand-in worker's real
:class:`WorkerSync`; one that lacks ``collective_rpc`` is not hooked and the backend refuses to
start with :class:`EngineIncompatible` naming what is missing. The version check runs with a
monkeypatched version. The real vLLM: ``test_vllm_backend.py``.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

from deltasync.errors import EngineIncompatible
from deltasync.integrations.vllm import compat, engine_core
from deltasync.integrations.vllm.compat import TESTED_VLLM, check_vllm, in_tested_range, require_internals


class Core:
    """Stand-in for vLLM 0.32's ``EngineCore``: ``collective_rpc`` runs ``method`` on one worker."""

    worker: Any = None

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(is_multimodal_model=False))
        self.resets = 0

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        return [method(self.worker, *args, **(kwargs or {}))]  # the hook sends deltasync's RPCs as a function

    def reset_prefix_cache(self, **kw: Any) -> bool:
        self.resets += 1
        return True

    def reset_encoder_cache(self) -> None:
        return None


class CoreProc(Core):
    """Stand-in for ``EngineCoreProc`` (an engine core in its own process)."""


def _fake_core_module(monkeypatch: pytest.MonkeyPatch, core: type) -> types.ModuleType:
    module = types.ModuleType("vllm.v1.engine.core")
    module.EngineCore = core  # type: ignore[attr-defined]
    module.EngineCoreProc = CoreProc  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", module)
    return module


def _resolve(**classes: object) -> compat.Resolve:
    return lambda module, cls: classes.get(cls)


@pytest.mark.parametrize(
    ("version", "tested"),
    [("0.32.0", True), ("0.32.4+cpu", True), ("0.32.1rc1", True), ("0.33.0", False), ("0.31.9", False), ("1.0", False)]
    + [("nightly", False)],
)
def test_the_tested_range(version: str, tested: bool) -> None:
    assert TESTED_VLLM == ">=0.32,<0.33"
    assert in_tested_range(version) is tested


def test_a_vllm_outside_the_range_is_warned_about_naming_the_range_and_what_may_break(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.1")
    full = _resolve(EngineCore=Core, EngineCoreProc=CoreProc)
    with caplog.at_level(logging.WARNING, logger="deltasync.vllm"):
        assert check_vllm(resolve=full) == []
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "vllm 0.40.1" in text and "vllm>=0.32,<0.33" in text and "EngineCore.collective_rpc" in text
    assert "prefix cache" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltasync.vllm"):
        assert check_vllm(version="0.32.0", resolve=full) == []
    assert caplog.records == []  # in range: nothing said
    require_internals(resolve=full)  # nothing missing: no refusal


def test_a_vllm_without_an_internal_is_not_hooked_and_the_backend_refuses_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Bare:  # an EngineCore of another shape: no collective_rpc
        def reset_prefix_cache(self, **kw: Any) -> bool:
            return True

        def reset_encoder_cache(self) -> None:
            return None

    _fake_core_module(monkeypatch, Bare)
    with caplog.at_level(logging.ERROR, logger="deltasync.vllm"):
        missing = check_vllm(version="0.32.0")
        assert [it.name for it in missing] == ["EngineCore.collective_rpc"]
        assert engine_core.install(lambda *a: None) is False
    assert all("EngineCore.collective_rpc" in r.getMessage() for r in caplog.records)
    assert not hasattr(Bare, "collective_rpc")
    with pytest.raises(EngineIncompatible, match=r"lacks .*vllm\.v1\.engine\.core\.EngineCore\.collective_rpc") as info:
        require_internals()
    assert TESTED_VLLM in str(info.value)
    # no engine core module at all (vLLM not installed, or moved): every internal is missing
    missing_all = compat.missing_internals(lambda module, cls: None)
    assert [it.name for it in missing_all] == [it.name for it in compat.INTERNALS]


def test_the_hook_routes_the_worker_api_and_resets_the_cache_after_an_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Hooked(Core):
        pass

    _fake_core_module(monkeypatch, Hooked)
    seen: list[tuple[str, tuple[object, ...], dict[str, object]]] = []

    def worker_call(worker: Any, name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        seen.append((name, args, kwargs))
        return {"name": name}

    assert engine_core.install(worker_call) is True
    assert engine_core.install(worker_call) is True  # idempotent: wrapped once
    core = Hooked()
    assert core.collective_rpc("deltasync_status") == [{"name": "deltasync_status"}]
    assert core.resets == 0
    assert core.collective_rpc("deltasync_update", kwargs={"step": 2}) == [{"name": "deltasync_update"}]
    assert core.resets == 1  # inside the same call, before anything else is scheduled
    assert seen == [("deltasync_status", (), {}), ("deltasync_update", (), {"step": 2})]


def test_an_engine_core_of_its_own_process_answers_a_waiting_prepare_through_a_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from concurrent.futures import Future

    from deltasync.serving.worker_api import WorkerStatus

    class Hooked(Core):
        pass

    class Proc(Hooked):
        pass

    module = _fake_core_module(monkeypatch, Hooked)
    module.EngineCoreProc = Proc  # type: ignore[attr-defined]
    asked: list[dict[str, object]] = []

    def worker_call(worker: Any, name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        asked.append(kwargs)  # a worker that reports nowhere: nothing to wait on
        return WorkerStatus(0, 1, 2, "serving", None, "file:///run", preparing=2, prepare_id="t").to_json()

    assert engine_core.install(worker_call)
    out = Proc().collective_rpc("deltasync_prepare", kwargs={"step": "2", "wait": "true", "timeout": "30"})
    assert isinstance(out, Future)
    (answer,) = out.result(timeout=60)
    assert WorkerStatus.from_json(answer).prepared == 2
    assert asked == [{"step": 2, "wait": False, "timeout": 30.0}]  # the workers were not made to wait
    # in-process (not its own process): the workers wait themselves
    assert Hooked().collective_rpc("deltasync_prepare", kwargs={"step": 2, "wait": True}) == [answer]
    assert asked[-1] == {"step": 2, "wait": True}
