"""VLLMServer alone: one vLLM server's update sequence, failure states, and what it does with hostile
answers, against a scripted HTTP stand-in (:class:`ScriptedVLLM` in tests/scripted_vllm.py).

Moved from tests/serving/test_driver.py (the driver's tests stay there).
"""

from __future__ import annotations

from scripted_vllm import ScriptedVLLM

from deltasync.serving.vllm_server import VLLMServer
from deltasync.serving.worker_api import WorkerStatus


def _server(fake: ScriptedVLLM, url: str = "http://vllm-a") -> VLLMServer:
    return VLLMServer(url, transport=fake.transport())


def test_an_update_pauses_runs_the_four_phases_resets_the_prefix_cache_then_resumes() -> None:
    fake = ScriptedVLLM()
    u = _server(fake).update(3)
    assert u.ok and u.version == "3" and u.state == "serving"
    assert fake.calls == [
        "/pause?mode=wait&clear_cache=true",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
        "/is_paused",
        "/weight_info",
    ]
    assert not fake.paused


def test_a_refused_step_is_not_finished_and_the_server_resumes_on_its_previous_step() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back = {4}
    u = _server(fake).update(4)
    assert (u.state, u.version) == ("rolled_back", "0")
    assert "UpdateRolledBack: step 4: corrupt patch" in (u.error or "")
    assert "/finish_weight_update" not in fake.calls
    assert fake.calls[3:5] == ["/collective_rpc", "/resume"]  # the workers' typed states decide: resume
    assert u.workers == [WorkerStatus(0, 0, None, "serving", None, "s3://bucket/run")]  # its own account, typed


def test_a_refused_step_whose_outcome_cannot_be_read_leaves_the_server_paused() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.status_down = {4}, True
    u = _server(fake).update(4)
    assert u.state == "failed" and "stays paused" in (u.error or "")
    assert fake.paused and "/resume" not in fake.calls
    assert fake.calls.count("/collective_rpc") == 3  # STATUS_TRIES reads, then no guess


def test_the_outcome_of_a_refused_step_comes_from_the_workers_states_not_the_error_text() -> None:
    fake = ScriptedVLLM()
    fake.broken = {4}  # answers "rank 1: reload failed": no class name in the text
    u = _server(fake).update(4)
    assert u.state == "needs_replacement" and fake.paused and "/resume" not in fake.calls


def test_a_prefix_cache_that_will_not_reset_leaves_the_server_paused_rather_than_stale() -> None:
    flaky = ScriptedVLLM()
    flaky.cache_failures = 2  # blocks still held twice: retried, then fine
    assert _server(flaky).update(1).ok
    stuck = ScriptedVLLM()
    stuck.cache_failures = 10**6
    u = VLLMServer("http://stuck", transport=stuck.transport()).update(1, cache_retries=3)
    assert u.state == "failed" and "prefix cache could not be reset" in (u.error or "")
    assert stuck.paused and "/resume" not in stuck.calls
    assert stuck.calls.count("/reset_prefix_cache") == 4


def test_keep_mode_resets_the_kv_of_the_requests_it_froze() -> None:
    fake = ScriptedVLLM()
    assert _server(fake).update(1, pause_mode="keep").ok
    assert "/pause?mode=keep&clear_cache=true" in fake.calls
    assert "/reset_prefix_cache?reset_running_requests=true" in fake.calls


def test_a_refused_update_is_resumed_on_a_new_connection_when_vllm_dropped_the_old_one() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.resume_drops = {2}, 2  # the first two /resume are lost on the dropped connection
    u = _server(fake).update(2)
    assert u.state == "rolled_back" and u.version == "0"
    assert not fake.paused
    assert fake.calls.count("/resume") == 3 and fake.calls[-2:] == ["/is_paused", "/weight_info"]


def test_a_server_that_cannot_be_resumed_is_not_reported_as_serving_its_previous_step() -> None:
    fake = ScriptedVLLM()
    fake.rolled_back, fake.resume_drops = {2}, 10**6
    u = _server(fake).update(2)
    assert u.state == "unreachable" and "resume (5 tries)" in (u.error or "")
    assert fake.paused and fake.calls.count("/resume") == 5
