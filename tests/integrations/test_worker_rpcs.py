"""deltasync's worker RPCs on a worker, without vLLM: every answer read back through the worker API.

The worker here is a stand-in for vLLM's (``model_runner.get_model()``, ``vllm_config``), its model a
tiny torch module whose ``load_weights`` hands each tensor to its parameter's ``weight_loader`` as
vLLM's models do (so the engine check and the scatter map trace it). The RPCs run as the plugin's
engine-core hook runs them (``extension.worker_rpc``) on the real :class:`WorkerSync` over a local
store, and each answer goes through :mod:`deltasync.serving.worker_api`'s ``from_json`` as the asking
side reads it. Real engines: ``test_vllm_backend.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402
from deltasync.errors import (  # noqa: E402
    DeltaSyncError,
    EngineIncompatible,
    MalformedAnswer,
    ProtocolError,
    UpdateRolledBack,
)
from deltasync.integrations.vllm.engine_check import check_engine  # noqa: E402
from deltasync.integrations.vllm.extension import state_of, worker_rpc  # noqa: E402
from deltasync.protocol.audit import AuditReport, fingerprint  # noqa: E402
from deltasync.serving.engine.worker import EngineFacts, InitOptions, WorkerSync  # noqa: E402
from deltasync.serving.worker_api import ParamsChunk, WorkerStatus  # noqa: E402

NAMES = ["a.w", "b.w", "c.w"]


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    out = {n: torch.randn(16, 8, generator=g).to(torch.bfloat16) for n in NAMES}
    for s in range(1, step + 1):
        out[NAMES[s % len(NAMES)]][s, :3] += 0.5
    return out


class Model(torch.nn.Module):
    """One parameter per checkpoint name; ``load_weights`` goes through each parameter's ``weight_loader``."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {n.replace(".", "_"): torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in state.items()}
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        done = set()
        for name, t in weights:
            p = self.p[name.replace(".", "_")]
            getattr(p, "weight_loader", _copy)(p, t)
            done.add(name)
        return done


def _copy(param: Any, loaded: Any) -> None:
    param.data.copy_(loaded)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Steps 0..2 of a small state in a local store; its URL (``file://...``)."""
    root = tmp_path_factory.mktemp("rpc-run")
    with ds.DeltaUploader(ds.open_store(str(root)), anchor_every=100, anchor_bytes_fraction=0) as up:
        for s in range(3):
            up.push(_state(s), s).result()
    return ds.open_store(str(root)).url


class Worker:
    """What deltasync reads of a vLLM worker: its model and its config (no checkpoint dir: no seed)."""

    weight_transfer_engine: Any = None  # vLLM's worker has one where a weight-transfer backend is configured

    def __init__(self, model: torch.nn.Module, quantization: str | None = None) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="tiny-model-id", quantization=quantization),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )


def _rpc(worker: Any) -> Callable[..., Any]:
    """``rpc(name, **kwargs)``: the worker method as the engine-core hook calls it."""
    return lambda name, **kw: worker_rpc(worker, name, (), kw)


def test_every_rpc_answers_through_the_worker_api(run: str) -> None:
    worker = Worker(Model(_state(0)))
    rpc = _rpc(worker)
    try:
        init = WorkerStatus.from_json(rpc("deltasync_init", store=run))
        assert (init.rank, init.step, init.state, init.error, init.store) == (0, None, "serving", None, run)
        # a prepare with wait (strings, as HTTP sends them): its ticket, and the step prepared
        prep = WorkerStatus.from_json(rpc("deltasync_prepare", step="1", wait="true", timeout="60"))
        assert (prep.preparing, prep.prepared) == (1, 1) and prep.prepare_id and prep.prepared_file
        assert Path(prep.prepared_file).is_file()
        up = WorkerStatus.from_json(rpc("deltasync_update", step=2))
        assert up.step == 2 and up.report is not None and (up.report.step, up.report.previous) == (2, None)
        status = WorkerStatus.from_json(rpc("deltasync_status"))
        assert (status.step, status.last_error, status.report) == (2, None, None)
        # the engine holds step 2's bits: the parameter audit finds nothing, in one chunk
        chunk = ParamsChunk.from_json(rpc("deltasync_audit_params", start="0", max_bytes=str(1 << 30)))
        assert (chunk.rank, chunk.step, chunk.checked, chunk.mismatched, chunk.next, chunk.error) == (
            0,
            2,
            3,
            (),
            None,
            None,
        )
        audit = AuditReport(2, fingerprint("0123abcd" * 8, [[-1.0, -2.0, -3.0, -4.0]]))
        noted = WorkerStatus.from_json(rpc("deltasync_audit_report", audit=audit.to_dict(), problems=[]))
        assert noted.step == 2 and noted.error is None
        assert "deltasync_" in rpc("deltasync_metrics")
        with pytest.raises(ValueError, match="not one of deltasync's worker methods"):
            rpc("deltasync_reboot")
    finally:
        state_of(worker).close()


def test_a_bad_option_or_argument_is_refused_with_what_to_do(run: str) -> None:
    worker = Worker(Model(_state(0)))
    rpc = _rpc(worker)
    try:
        with pytest.raises(ValueError, match=r"unknown deltasync option\(s\) colour; the options are .*store"):
            rpc("deltasync_init", store=run, colour="red")
        with pytest.raises(ValueError, match="verify must be"):
            rpc("deltasync_init", store=run, verify="sometimes")
        with pytest.raises(ValueError, match="step must be"):
            rpc("deltasync_prepare", store=run, step=-1)
        with pytest.raises(ValueError, match=r"name the run"):
            rpc("deltasync_update", step=1)  # no store anywhere
    finally:
        state_of(worker).close()


def test_a_malformed_audit_report_is_refused_with_a_typed_error(run: str) -> None:
    worker = Worker(Model(_state(0)))
    rpc = _rpc(worker)
    good = AuditReport(0, fingerprint("0123abcd" * 8, [[-1.0, -2.0, -3.0, -4.0]])).to_dict()
    try:
        for audit, problems in (
            ("garbage", None),
            ({"audited_step": 0}, None),  # no fingerprint
            (dict(good, audited_step=-1), None),
            (None, None),  # none at all
            (good, "diverged"),  # problems not a list
            (good, [1, 2]),
            (good, ["x" * 20000]),
        ):
            with pytest.raises(ProtocolError):
                rpc("deltasync_audit_report", audit=audit, problems=problems)
        with pytest.raises(MalformedAnswer, match="problems"):
            rpc("deltasync_audit_report", audit=good, problems=[1])
        # a well-formed one is taken
        assert (
            WorkerStatus.from_json(rpc("deltasync_audit_report", audit=good, problems=["probe 0: far"])).error is None
        )
    finally:
        state_of(worker).close()


def _rank(
    model: torch.nn.Module, rank: int, node_dir: Path, *, others: object, quantization: str | None = None
) -> WorkerSync:
    """Rank ``rank`` of a 2-rank engine whose other rank votes ``others`` at every exchange."""
    facts = EngineFacts(check=functools.partial(check_engine, quantization=quantization), node_dir=node_dir)
    return WorkerSync(model, facts, rank, 2, agree=lambda mine: [mine, others])


def test_a_non_last_rank_answers_the_agreed_error_and_the_asking_side_raises_its_class(
    run: str, node_dir: Path
) -> None:
    model = Model(_state(0))
    first = _rank(model, 0, node_dir, others=(None, 9))
    worker = Worker(model)
    worker.weight_transfer_engine = SimpleNamespace(sync=first)  # the backend's state is the extension's
    rpc = _rpc(worker)
    try:
        assert state_of(worker) is first
        WorkerStatus.from_json(rpc("deltasync_init", store=run))
        # step 9 is not in the run: every rank rolls back; rank 0 of 2 answers instead of raising
        answer = WorkerStatus.from_json(rpc("deltasync_update", step=9))
        assert answer.error_code == "update_rolled_back" and answer.step is None
        with pytest.raises(UpdateRolledBack, match="step 9 was not applied") as raised:
            answer.raise_error()
        assert type(raised.value) is UpdateRolledBack
        # the same call on the last rank raises it
        last = _rank(model, 1, node_dir, others=(None, 9))
        try:
            last.configure(InitOptions(store=run))
            with pytest.raises(UpdateRolledBack):
                last.call(last.update, None, 9)
        finally:
            last.close()
        # an argument error of a parameter audit comes back in the chunk, as its class's code
        chunk = ParamsChunk.from_json(rpc("deltasync_audit_params", start=-1))
        assert chunk.error is not None and chunk.checked == 0
        with pytest.raises(DeltaSyncError, match="start must be >= 0"):
            chunk.raise_error()
    finally:
        first.close()


def test_a_refused_engine_s_error_crosses_as_its_own_class(run: str, node_dir: Path) -> None:
    sync = _rank(Model(_state(0)), 0, node_dir, others=("EngineIncompatible: quantized", 1), quantization="fp8")
    try:
        assert WorkerStatus.from_json(sync.call(sync.configure, InitOptions(store=run)).to_json()).error is None
        # no seed: the engine is checked with the first version it is to load, and refused
        for _ in range(2):  # then refused at once, for good
            answer = WorkerStatus.from_json(sync.call(sync.update, None, 1).to_json())
            assert answer.error_code == "engine_incompatible" and answer.step is None
            with pytest.raises(EngineIncompatible, match="quantized"):
                answer.raise_error()
        assert "EngineIncompatible" in (WorkerStatus.from_json(sync.status().to_json()).last_error or "")
    finally:
        sync.close()
