"""DriverMetrics' count of behavioural audits that could not run (``observe_audit_unavailable``): a
counter per server, rendered with its family even before the first one."""

from __future__ import annotations

from deltasync.serving.driver_metrics import DriverMetrics


def test_audits_that_could_not_run_are_counted_per_server() -> None:
    metrics = DriverMetrics()
    lines = metrics.render().splitlines()
    assert "# TYPE deltasync_vllm_audits_unavailable_total counter" in lines
    assert not any(line.startswith("deltasync_vllm_audits_unavailable_total{") for line in lines)
    metrics.observe_audit_unavailable("http://127.0.0.1:8001")
    metrics.observe_audit_unavailable("http://127.0.0.1:8001")
    metrics.observe_audit_unavailable('http://evil"\n:8002')
    lines = metrics.render().splitlines()
    assert 'deltasync_vllm_audits_unavailable_total{server="http://127.0.0.1:8001"} 2' in lines
    assert 'deltasync_vllm_audits_unavailable_total{server="http://evil\\"\\n:8002"} 1' in lines
