"""A scripted stand-in for a vLLM 0.32 server's weight-transfer routes (test support, not deltasync).

:class:`ScriptedVLLM` is an ``httpx.MockTransport`` handler that answers the routes
:class:`deltasync.serving.driver.VLLMServer` uses the way the real server does (paths,
bodies, status codes) and records the calls. Used by tests/serving/test_driver.py, and by
tests/integrations/test_vllm_rollout.py as the one server of a fleet that refuses a step next to a
real ``vllm serve``.
"""

from __future__ import annotations

import json

import httpx


class ScriptedVLLM:
    """A vLLM server's weight-transfer routes: refuses ``rolled_back`` steps (HTTP 500, engine kept at its
    step), breaks on ``broken`` steps (needs replacement), fails ``cache_failures`` prefix-cache resets."""

    def __init__(self, version: str | None = "0", journal: list[str] | None = None) -> None:
        self.version = version
        self.journal = journal  # shared by several fakes: the order of calls across servers
        self.unpreparable: set[int] = set()  # steps deltasync_prepare fails on (the last rank raises)
        self.prepared: list[int] = []
        self.paused = False
        self.calls: list[str] = []
        self.rolled_back: set[int] = set()
        self.broken: set[int] = set()
        self.lost = False  # a broken step was tried: the workers hold neither step
        self.status_down = False  # deltasync_status answers 503 (its workers cannot say)
        self.cache_failures = 0
        self.down = False
        self._pending: int | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        q = dict(request.url.params)
        self.calls.append(path + (f"?{request.url.query.decode()}" if request.url.query else ""))
        if self.journal is not None:
            self.journal.append(f"{request.url.host} {path}")
        if path == "/init_weight_transfer_engine":
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/pause":
            assert q.get("mode") in ("wait", "abort", "keep")
            self.paused = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/start_weight_update":
            assert self.paused, "updates run paused"
            return httpx.Response(200, json={"message": "Weight update started"})
        if path == "/update_weights":
            step = body["update_info"]["step"]
            if step in self.broken:
                self.lost = True  # its workers now report needs_replacement
                return httpx.Response(500, json={"error": {"message": "rank 1: reload failed"}})
            if step in self.rolled_back:
                return httpx.Response(500, json={"error": {"message": f"UpdateRolledBack: step {step}: corrupt patch"}})
            self._pending = step
            return httpx.Response(200, json={"message": "Weights updated"})
        if path == "/finish_weight_update":
            assert self._pending is not None
            self.version, self._pending = body["weight_version"], None
            return httpx.Response(200, json={"message": "Weight update finished"})
        if path == "/reset_prefix_cache":
            if self.cache_failures:
                self.cache_failures -= 1
                return httpx.Response(200, json={"success": False})
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc" and body["method"] == "deltasync_prepare":
            assert body["kwargs"]["wait"] is True
            step = int(body["kwargs"]["step"])
            if step in self.unpreparable:
                return httpx.Response(500, json={"error": {"message": f"UpdateRolledBack: step {step}: checksum"}})
            self.prepared.append(step)
            return httpx.Response(200, json={"results": [{"rank": 0, "state": "serving", "prepared": step}]})
        if path == "/collective_rpc" and self.status_down:
            return httpx.Response(503, json={"error": {"message": "engine dead"}})
        if path == "/collective_rpc":
            state = "needs_replacement" if self.lost else "serving"
            return httpx.Response(200, json={"results": [{"rank": 0, "state": state, "step": self.version}]})
        return httpx.Response(404, json={"detail": "Not Found"})
