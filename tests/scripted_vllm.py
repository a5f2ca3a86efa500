"""A scripted stand-in for a vLLM 0.32 server's weight-transfer routes (test support, not deltasync).

:class:`ScriptedVLLM` is an ``httpx.MockTransport`` handler that answers the routes
:class:`deltasync.serving.vllm_server.VLLMServer` uses the way the real server does (paths,
bodies, status codes) and records the calls, or, per route, a hostile answer (:attr:`ScriptedVLLM.hostile`).
Used by tests/serving/test_driver.py and test_vllm_server.py, and by
tests/integrations/test_vllm_rollout.py as the one server of a fleet that refuses a step next to a
real ``vllm serve``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

#: a hostile answer to one route, in place of the scripted one (see :attr:`ScriptedVLLM.hostile`)
Hostile = Callable[[httpx.Request], httpx.Response]


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
        self.resume_drops = 0  # tries of /resume lost on a dropped connection
        self.initialised = True  # False: a new process whose backend was never pointed at a store
        #: route (``"/weight_info"``, or ``"/collective_rpc deltasync_status"`` for one worker method) ->
        #: what it answers instead (a non-JSON body, a JSON list, a 500, a transport error, ...)
        self.hostile: dict[str, Hostile] = {}
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
        route = f"{path} {body.get('method')}" if path == "/collective_rpc" else path
        for key in (route, path):
            if key in self.hostile:
                return self.hostile[key](request)
        if path == "/init_weight_transfer_engine":
            self.initialised = True
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/pause":
            assert q.get("mode") in ("wait", "abort", "keep")
            self.paused = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            if self.resume_drops:  # vLLM drops the connection of a refused update: a request on it is lost
                self.resume_drops -= 1
                raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/start_weight_update":
            assert self.paused, "updates run paused"
            return httpx.Response(200, json={"message": "Weight update started"})
        if path == "/update_weights":
            step = body["update_info"]["step"]
            if step in self.broken:
                self.lost = True  # its workers now report needs_replacement
                return httpx.Response(500, json={"error": {"message": "rank 1: reload failed"}})
            if not self.initialised:
                return httpx.Response(
                    500, json={"error": {"message": 'name the run: {"store": URL} in init_info or in update_info'}}
                )
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
            assert body["kwargs"]["wait"] is True and body["kwargs"]["timeout"] > 0
            step = int(body["kwargs"]["step"])
            if step in self.unpreparable:
                return httpx.Response(500, json={"error": {"message": f"UpdateRolledBack: step {step}: checksum"}})
            self.prepared.append(step)
            return httpx.Response(200, json={"results": [{"rank": 0, "state": "serving", "prepared": step}]})
        if path == "/collective_rpc" and self.status_down:
            return httpx.Response(503, json={"error": {"message": "engine dead"}})
        if path == "/collective_rpc":
            state = "needs_replacement" if self.lost else "serving"
            store = "s3://bucket/run" if self.initialised else None
            step = int(self.version) if self.version is not None and self.version.isdigit() else None
            return httpx.Response(200, json={"results": [{"rank": 0, "state": state, "step": step, "store": store}]})
        return httpx.Response(404, json={"detail": "Not Found"})
