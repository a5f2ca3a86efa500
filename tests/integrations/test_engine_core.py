"""What deltasync's engine-core hook decides, without vLLM (``deltasync/integrations/vllm/engine_core.py``).

Which RPCs count as weight updates, and what :func:`reset_caches` asks of the engine core. The
engine core here is a stand-in recording calls: the real one runs in ``test_vllm_backend.py``, where
the same prompts are served before and after real updates and must come out as a fresh engine's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deltasync.errors import DeltaSyncError, MalformedAnswer, PrefixCacheNotReset
from deltasync.integrations.vllm.engine_core import BACKEND, RPCS, changes_weights, reset_caches
from deltasync.serving import worker_api
from deltasync.serving.worker_api import WorkerStatus


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
    with pytest.raises(PrefixCacheNotReset, match=r"reset_prefix_cache\(reset_running_requests=True") as info:
        reset_caches(core)
    assert "restart the engine" in str(info.value)
    if isinstance(outcome, Exception):
        assert "remote KV transfer" in str(info.value)


# ------------------------------------------------------------------ a prepare's wait in the engine core (issue 34)


def _answers(tmp_path: Any, docs: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Two workers' answers to ``deltasync_prepare`` of ``step``, and the files they report in."""
    import json

    out = []
    for rank, doc in enumerate(docs):
        path = tmp_path / f"r{rank}.json"
        path.write_text(json.dumps(doc))
        status = WorkerStatus(rank, 0, None, "serving", None, "file:///run", preparing=step, prepare_id="a")
        out.append(WorkerStatus.from_json(status.to_json() | {"prepared_file": str(path)}).to_json())
    return out


def test_the_wait_ends_when_every_worker_reported_the_step_prepared(tmp_path: Any) -> None:
    import json
    import threading

    from deltasync.serving.engine.prepared import wait_prepared

    answers = _answers(tmp_path, [{"prepared": None, "serving": 0}, {"prepared": None, "serving": 0}], 3)
    reads = threading.Event()

    class Stop(threading.Event):
        """A stop event whose waits make the workers' reports arrive (no sleeping)."""

        def wait(self, timeout: float | None = None) -> bool:
            if not reads.is_set():
                reads.set()
                for a in answers:
                    doc = {"step": 3, "ok": True, "error": None, "prepared": 3, "serving": 0}
                    Path(a["prepared_file"]).write_text(json.dumps(doc))
            return False

    out = wait_prepared(answers, 60.0, stop=Stop())
    assert [(a["rank"], a["prepared"], a["step"]) for a in out] == [(0, 3, 0), (1, 3, 0)]


def test_the_wait_raises_a_worker_s_prepare_error_and_is_bounded(tmp_path: Any) -> None:
    import threading

    from deltasync.serving.engine.prepared import wait_prepared

    failed = {"prepared": None, "serving": 0, "outcomes": {"a": "ChecksumMismatch: bad patch"}}
    answers = _answers(tmp_path, [{"prepared": 3, "serving": 0}, failed], 3)
    with pytest.raises(DeltaSyncError, match="rank 1: step 3 could not be prepared: ChecksumMismatch: bad patch"):
        wait_prepared(answers, 60.0)
    # still preparing on rank 1 (what failed there was another prepare: not this call's): a bounded
    # wait (a clock that runs out, no sleeping)
    other = {"prepared": None, "serving": 0, "outcomes": {"b": "ChecksumMismatch: bad patch"}}
    answers = _answers(tmp_path, [{"prepared": 3, "serving": 0}, other], 3)
    now = iter([0.0, 0.0, 10.0, 100.0])
    with pytest.raises(DeltaSyncError, match=r"step 3 was not prepared within 50 s on rank\(s\) 1"):
        wait_prepared(answers, 50.0, stop=threading.Event(), clock=lambda: next(now))
    # a worker that serves the step already (or a newer one prepared) needs no wait
    answers = _answers(tmp_path, [{"prepared": None, "serving": 3}, {"prepared": 4, "serving": 0}], 3)
    assert [a["prepared"] for a in wait_prepared(answers, 1.0)] == [None, 4]


def test_the_wait_reads_the_answers_through_the_worker_api(tmp_path: Any) -> None:
    from deltasync.serving.engine.prepared import wait_prepared

    answers = _answers(tmp_path, [{"prepared": 3, "serving": 0}], 3)
    out = wait_prepared(answers, 1.0)
    back = WorkerStatus.from_json(out[0])  # the answer stays a worker status, with what the file said
    assert (back.rank, back.prepared, back.step, back.preparing, back.prepare_id) == (0, 3, 0, 3, "a")
    # anything else a worker answered is refused as such, not read as a dict
    for bad in ([{"rank": 0}], ["not an answer"], [dict(answers[0], state="gone")]):
        with pytest.raises(MalformedAnswer, match="deltasync_prepare: answer 0"):
            wait_prepared(bad, 1.0)


def test_the_hook_s_rpc_names_are_the_worker_api_s() -> None:
    assert RPCS is worker_api.RPCS and "deltasync_audit_report" in RPCS


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "waits"),
    [
        ("deltasync_prepare", (), {"step": "3", "wait": "true", "timeout": "30"}, True),  # HTTP sends strings
        ("deltasync_prepare", (), {"step": 3, "wait": True}, True),
        ("deltasync_prepare", (), {"step": 3}, False),  # answers at once: nothing to wait on
        ("deltasync_prepare", (), {"step": "three", "wait": True}, False),  # the workers refuse it themselves
        ("deltasync_prepare", (), {"wait": True, "colour": "red"}, False),
        ("deltasync_prepare", (3,), None, False),  # positional: passed through
        ("deltasync_update", (), {"step": 3, "wait": True}, False),
    ],
)
def test_which_prepares_the_engine_core_waits_on(method: str, args: Any, kwargs: Any, waits: bool) -> None:
    from deltasync.integrations.vllm.engine_core import _waiting_prepare

    request = _waiting_prepare(method, args, kwargs)
    assert (request is not None) is waits
    if request is not None:
        assert request.step == 3 and request.wait


def test_a_deferred_prepare_asks_without_waiting_then_completes_from_the_reports(tmp_path: Any) -> None:
    from deltasync.serving.engine.prepared import deferred_prepare
    from deltasync.serving.worker_api import PrepareRequest

    asked: list[PrepareRequest] = []

    def start(request: PrepareRequest) -> list[object]:
        asked.append(request)
        return list(_answers(tmp_path, [{"prepared": 3, "serving": 0}, {"prepared": None, "serving": 3}], 3))

    future = deferred_prepare(start, PrepareRequest(step=3, wait=True, timeout=60.0))
    out = [WorkerStatus.from_json(a) for a in future.result(timeout=60)]
    assert asked == [PrepareRequest(step=3, wait=False, timeout=60.0)]  # the workers answer at once
    assert [(s.rank, s.prepared, s.step) for s in out] == [(0, 3, 0), (1, None, 3)]
