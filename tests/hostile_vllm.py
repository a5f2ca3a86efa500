"""A fake vLLM 0.32 server on a real 127.0.0.1 socket that answers like a good one, or per route like a
hostile one (test support, not deltasync).

:class:`HostileVLLM` answers the routes :class:`deltasync.serving.vllm_server.VLLMServer` and the
receiver's audit use (tests/scripted_vllm.py's paths, bodies and status codes, plus ``/v1/models``,
``/v1/completions`` with prompt logprobs and deltasync's worker methods over ``/collective_rpc``) from
a threaded HTTP/1.1 server. Per route (``"/weight_info"``, or ``"/collective_rpc deltasync_status"``
for one worker method) :attr:`HostileVLLM.hostile` makes it answer instead with one of
:data:`MODES`:

- ``non_json``: 200 and an HTML page; ``json_list``: 200 and ``[1, 2, 3]``; ``http_500``: vLLM's
  error body with HTTP 500;
- ``hang``: reads the request and never answers (until the fake is closed);
- ``trickle``: the whole answer (status line, headers, body) one byte every :attr:`trickle_s` seconds;
- ``huge``: a 400 MB body with its ``Content-Length``; ``huge_chunked``: a 400 MB body streamed
  chunked, without a length. Both are written lazily from one 64 KiB block: never built in memory;
- ``slow``: the right answer, after :attr:`slow_s` seconds.

And as a whole: :attr:`stuck_paused` (``/resume`` answers but ``/is_paused`` stays true),
:attr:`params_next` (every ``deltasync_audit_params`` chunk answers this ``next``: ``0`` is an audit
that never makes progress), :attr:`wrong_version` (an update is taken but the weight version stays
the old one), :attr:`ranks` (how many workers its ``/collective_rpc`` answers speak for).

Bounded: at most :data:`MAX_CONNECTIONS` connections at once (more are closed at once), a request
body over 8 MiB is refused (413), every socket has a timeout, and every hostile wait ends when the
fake is closed (:meth:`HostileVLLM.close`, or leaving its ``with``).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter
from typing import Any, Literal

#: what a route may answer instead of the right answer (see the module doc)
Mode = Literal["non_json", "json_list", "http_500", "hang", "trickle", "huge", "huge_chunked", "slow"]
MODES: tuple[Mode, ...] = ("non_json", "json_list", "http_500", "hang", "trickle", "huge", "huge_chunked", "slow")
#: the size of a ``huge`` body
HUGE = 400 << 20
MAX_CONNECTIONS = 64
_MAX_REQUEST = 8 << 20
_BLOCK = 64 << 10
#: the longest any hostile answer holds a connection (the fake's close ends it sooner)
HOLD_S = 120.0


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, fake: HostileVLLM) -> None:
        self.fake = fake
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # bounded: a connection past the limit is closed at once
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # every socket operation of a connection (the client's side is the test's)
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the test reads :attr:`HostileVLLM.calls`

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.fake.serve(self, b"")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        n = int(self.headers.get("Content-Length") or 0)
        if n > _MAX_REQUEST:
            self.send_error(413)
            return
        self.server.fake.serve(self, self.rfile.read(n) if n else b"")


class HostileVLLM:
    """A fake vLLM server at :attr:`url` (see the module doc); use it in a ``with``."""

    def __init__(self, *, version: str | None = "0", model: str = "tiny") -> None:
        self.version = version
        self.model = model
        #: route -> what it answers instead (see :data:`MODES`)
        self.hostile: dict[str, Mode] = {}
        self.stuck_paused = False
        self.params_next: int | None = None
        self.wrong_version = False
        #: how many workers its ``/collective_rpc`` answers speak for (one answer each)
        self.ranks = 1
        #: the body a ``non_json`` route answers
        self.junk = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
        self.trickle_s = 1.0
        self.slow_s = 3.0
        self.paused = False
        self.initialised = False
        self._pending: int | None = None
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        #: set by :meth:`close`: every hostile wait ends
        self.released = threading.Event()
        self._server = _Server(self)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"hostile-vllm-{port}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> HostileVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: every hanging or trickling answer ends, the listening socket closes."""
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def calls(self, route: str) -> int:
        """How many requests ``route`` received (``"/resume"``, ``"/collective_rpc deltasync_audit_params"``)."""
        with self._lock:
            return self._calls[route]

    # ------------------------------------------------------------------ answering

    def serve(self, h: _Handler, raw: bytes) -> None:
        path = h.path.split("?", 1)[0]
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        method = body.get("method") if isinstance(body, dict) else None
        route = f"{path} {method}" if path == "/collective_rpc" else path
        with self._lock:
            self._calls[route] += 1
        mode = self.hostile.get(route) or self.hostile.get(path)
        if mode == "slow":
            self.released.wait(self.slow_s)
        elif mode is not None:
            self._hostile(h, mode)
            return
        status, answer = self._answer(path, route, h.path, body if isinstance(body, dict) else {})
        _send(h, status, json.dumps(answer).encode())

    def _hostile(self, h: _Handler, mode: Mode) -> None:
        if mode == "non_json":
            _send(h, 200, self.junk, "text/html")
        elif mode == "json_list":
            _send(h, 200, b"[1, 2, 3]")
        elif mode == "http_500":
            err = {"error": {"message": "Internal Server Error", "type": "InternalServerError", "code": 500}}
            _send(h, 500, json.dumps(err).encode())
        elif mode == "hang":
            self.released.wait(HOLD_S)
            h.close_connection = True
        elif mode == "trickle":
            self._trickle(h)
        else:
            self._huge(h, chunked=mode == "huge_chunked")

    def _trickle(self, h: _Handler) -> None:
        body = json.dumps({"weight_version": self.version, "pad": "x" * 4096}).encode()
        whole = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        h.close_connection = True
        for i in range(len(whole)):
            if self.released.wait(self.trickle_s):
                return
            if not _write(h, whole[i : i + 1]):
                return

    def _huge(self, h: _Handler, *, chunked: bool) -> None:
        h.close_connection = True
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {HUGE}\r\n\r\n".encode()
        block = b'{"weight_version": "' + b"9" * (_BLOCK - 20)
        tail = b"9" * _BLOCK
        if not _write(h, head):
            return
        sent = 0
        while sent < HUGE and not self.released.is_set():
            part = (block if sent == 0 else tail)[: HUGE - sent]
            if not _write(h, b"%x\r\n%s\r\n" % (len(part), part) if chunked else part):
                return  # the client hung up: what a bounded reader does at its cap
            sent += len(part)
        if chunked:
            _write(h, b"0\r\n\r\n")

    def _answer(self, path: str, route: str, target: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            return self._route(path, route, target, body)

    def _route(self, path: str, route: str, target: str, body: dict[str, Any]) -> tuple[int, Any]:
        kwargs = body.get("kwargs") or {}
        if path == "/init_weight_transfer_engine":
            self.initialised = True
            return 200, {"message": "Weight transfer initialized"}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/pause":
            self.paused = True
            return 200, {"status": "paused"}
        if path == "/resume":
            self.paused = self.stuck_paused
            return 200, {"status": "resumed"}
        if path == "/is_paused":
            return 200, {"is_paused": self.paused}
        if path == "/start_weight_update":
            return 200, {"message": "Weight update started"}
        if path == "/update_weights":
            self._pending = int(body["update_info"]["step"])
            return 200, {"message": "Weights updated"}
        if path == "/finish_weight_update":
            if self._pending is None:
                return 400, {"error": {"message": "no weight update in progress", "code": 400}}
            if not self.wrong_version:
                self.version = str(body["weight_version"])
            self._pending = None
            return 200, {"message": "Weight update finished"}
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if path == "/v1/completions":
            return 200, _completions(body, self._step() or 0)
        if route == "/collective_rpc deltasync_audit_params":
            start = int(kwargs.get("start", 0))
            nxt = self.params_next if self.params_next is not None else (None if start >= 1 else 1)
            chunk: dict[str, Any] = {
                "rank": 0,
                "step": self._step(),
                "checked": 1,
                "nbytes": 64,
                "mismatched": [],
                "unchecked": [],
                "next": nxt,
                "seconds": 0.001,
            }
            return 200, {"results": [chunk]}
        if route == "/collective_rpc deltasync_audit_report":
            return 200, {"results": [None]}
        if route == "/collective_rpc deltasync_prepare":
            step = int(kwargs["step"])
            return 200, {"results": [self._status(rank, prepared=step) for rank in range(self.ranks)]}
        if path == "/collective_rpc":
            return 200, {"results": [self._status(rank) for rank in range(self.ranks)]}
        return 404, {"detail": "Not Found"}

    def _step(self) -> int | None:
        v = self.version
        return int(v) if v is not None and v.isdigit() else None

    def _status(self, rank: int, prepared: int | None = None) -> dict[str, Any]:
        return {
            "rank": rank,
            "step": self._step(),
            "prepared": prepared,
            "state": "serving",
            "last_error": None,
            "store": "file:///run" if self.initialised else None,
        }


def _completions(body: dict[str, Any], step: int) -> dict[str, Any]:
    """vLLM's answer to the audit's requests: logprobs that move a little with the step served (as a
    model's do when its weights change)."""
    prompt = body.get("prompt") or []
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    top = [{"token_id:5": -1.0, "token_id:6": -2.5}]
    choices = []
    for i, p in enumerate(prompts):
        choice: dict[str, Any] = {"index": i, "text": "", "logprobs": {"top_logprobs": top}, "finish_reason": "length"}
        if "prompt_logprobs" in body:
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -2.0 - 0.01 * (j % 7) - 0.001 * step, "rank": 1}} for j, t in enumerate(p[1:])
            ]
        choices.append(choice)
    return {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model"), "choices": choices}


def _send(h: _Handler, status: int, payload: bytes, ctype: str = "application/json") -> None:
    try:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)
        h.wfile.flush()
    except OSError:
        h.close_connection = True


def _write(h: _Handler, data: bytes) -> bool:
    """Write ``data`` (False once the client is gone)."""
    try:
        h.wfile.write(data)
        h.wfile.flush()
        return True
    except (TimeoutError, OSError):
        h.close_connection = True
        return False
