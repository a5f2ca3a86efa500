"""TEST-ONLY: make vLLM's CPU backend keep plain linear weights, as on GPU.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the deltasync vLLM tests put this
directory on ``PYTHONPATH`` of the vLLM subprocesses they start, and spawned vLLM workers inherit
that environment, so every process of a test engine runs this. Nothing outside ``tests/`` uses it,
and production code must never depend on it.

Why: on CPU, vLLM repacks every 2-D linear weight at load time
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: oneDNN / sgl-kernel / zentorch
packed copies) and replaces ``layer.weight`` by an empty parameter (the lm_head keeps its weight but
computes from the packed copy). In-place weight updates through ``model.load_weights`` (what a
weight-transfer backend does, and what works on GPU) then fail or have no effect on outputs. This
patch keeps ``layer.weight`` and computes with ``torch.nn.functional.linear`` on it, so in-place
loading behaves as on GPU. Non-2-D weights (conv / MoE experts) go to vLLM's own dispatch.

The patch is applied lazily, right after ``vllm.model_executor.layers.utils`` is first imported
(an import hook), so processes that never import vLLM pay nothing. Set
``DELTASYNC_TEST_NO_CPU_GEMM_PATCH=1`` to turn it off (to observe vLLM's own CPU behaviour).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

TARGET = "vllm.model_executor.layers.utils"


def _patch(utils: Any) -> None:
    import torch

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # keeps layer.weight; no packed copy

    dispatch_cpu_unquantized_gemm.deltasync_test_patch = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Any = None) -> None:
        self.inner = inner
        self.patch = patch or _patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target: str = TARGET, patch: Any = None) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # once; also keeps the lookup below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.patch)
        return spec


if os.environ.get("DELTASYNC_TEST_NO_CPU_GEMM_PATCH") != "1":
    sys.meta_path.insert(0, _Finder())


def _patch_engine_core(module: Any) -> None:
    """TEST-ONLY fault of the audit tests (tests/vllm_support/audit_faults.py): while the file
    ``$DELTASYNC_TEST_FAULTS/skip_cache_reset`` exists, the engine core's ``reset_prefix_cache`` drops
    nothing and says it succeeded."""
    from pathlib import Path

    switch = Path(os.environ["DELTASYNC_TEST_FAULTS"]) / "skip_cache_reset"
    original = module.EngineCore.reset_prefix_cache

    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if switch.exists():
            return True
        return original(self, *args, **kwargs)

    module.EngineCore.reset_prefix_cache = reset_prefix_cache


if os.environ.get("DELTASYNC_TEST_FAULTS"):  # a dir of switches: see audit_faults.py
    sys.meta_path.insert(0, _Finder("vllm.v1.engine.core", _patch_engine_core))


def _log_shared_memory(log: str) -> None:
    """TEST-ONLY: append the name of every shared-memory block this process creates through
    ``multiprocessing.shared_memory`` (vLLM's message-queue ring buffers, 160-240 MiB each) to the
    file ``log``, one per line. vLLM unlinks them at a clean shutdown; the tests' engines end by
    ``os._exit`` or SIGKILL, so the harness unlinks exactly the names logged once the engine's
    processes are gone (``vllm_harness.unlink_logged_shm``), and no one else's."""
    from multiprocessing import shared_memory

    original = shared_memory.SharedMemory.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if kwargs.get("create", args[1] if len(args) > 1 else False):
            with open(log, "a") as fh:
                fh.write(self.name + "\n")

    shared_memory.SharedMemory.__init__ = __init__  # type: ignore[method-assign]


def _log_cpu_shm(module: Any) -> None:
    """TEST-ONLY: log (as :func:`_log_shared_memory`) the files of vLLM's CPU all-reduce (TP > 1), which
    its C++ side creates as ``/dev/shm/<group name>_<local rank>``, 4 MiB each."""
    cls = getattr(module, "_CPUSHMDistributed", None)
    if cls is None or not hasattr(cls, "make_group_name"):  # another vLLM: nothing logged, nothing broken
        return
    original = cls.make_group_name

    def make_group_name(communicator: Any) -> str:
        name: str = original(communicator)
        with open(os.environ["DELTASYNC_TEST_SHM_LOG"], "a") as fh:
            fh.writelines(f"{name}_{i}\n" for i in range(len(communicator.ranks)))
        return name

    cls.make_group_name = staticmethod(make_group_name)


if os.environ.get("DELTASYNC_TEST_SHM_LOG"):
    _log_shared_memory(os.environ["DELTASYNC_TEST_SHM_LOG"])
    sys.meta_path.insert(0, _Finder("vllm.distributed.device_communicators.cpu_communicator", _log_cpu_shm))
