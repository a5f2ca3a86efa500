"""A hostile HTTP server on 127.0.0.1 (test support, not deltasync): it answers every request one bad way.

What an ``httpx.MockTransport`` cannot show, because it happens on the socket: a server that accepts and
never answers (``hang``), one that sends its status line one byte at a time (``trickle-status``), one
that sends its headers then its body one byte at a time (``trickle-body``), one that declares a 400 MB
body and sends it (``huge-declared``), and one that streams a body of no declared length without end
(``huge-streamed``, chunked). Every loop is bounded (bytes, a stop event); :meth:`HostileServer.close`
stops it and joins its threads. Used by tests/serving/test_vllm_server.py.
"""

from __future__ import annotations

import socket
import threading
from typing import Literal

Mode = Literal["hang", "trickle-status", "trickle-body", "huge-declared", "huge-streamed"]
MODES: tuple[Mode, ...] = ("hang", "trickle-status", "trickle-body", "huge-declared", "huge-streamed")

#: the body size the huge modes send at most (and declare)
HUGE = 400 << 20
#: seconds between two bytes of a trickle (the client's deadline in the tests is several of these)
TICK = 0.02
_CHUNK = 64 << 10


class HostileServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 whose every answer is ``mode``."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.stop = threading.Event()
        #: bytes sent to clients, all connections together
        self.sent = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def close(self) -> None:
        """Stop answering, close every connection and join the threads (bounded)."""
        self.stop.set()
        for t in list(self._threads):
            t.join(10)
        self._listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5.0)
            try:
                _read_request(conn)
                with self._lock:
                    self.requests += 1
                getattr(self, "_" + self.mode.replace("-", "_"))(conn)
            except OSError:
                return  # the client closed the connection: what it should do

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)

    def _hang(self, conn: socket.socket) -> None:
        self.stop.wait(30)

    def _trickle(self, conn: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if self.stop.wait(TICK):
                return
            self._send(conn, data[i : i + 1])

    def _trickle_status(self, conn: socket.socket) -> None:
        self._trickle(conn, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000)  # headers that never end

    def _trickle_body(self, conn: socket.socket) -> None:
        body = b'{"weight_version": "' + b"7" * 4000 + b'"}'
        self._send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        self._trickle(conn, body)

    def _huge(self, conn: socket.socket, head: bytes, chunked: bool) -> None:
        self._send(conn, head)
        block = b" " * _CHUNK
        frame = (b"%x\r\n" % len(block)) + block + b"\r\n" if chunked else block
        for _ in range(HUGE // _CHUNK):
            if self.stop.is_set():
                return
            self._send(conn, frame)

    def _huge_declared(self, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % HUGE
        self._huge(conn, head, chunked=False)

    def _huge_streamed(self, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        self._huge(conn, head, chunked=True)


def _read_request(conn: socket.socket) -> None:
    """Read one request (its headers, and its body by ``Content-Length``), at most 1 MiB."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        if not part or len(data) > 1 << 20:
            raise OSError("no whole request")
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < min(length, 1 << 20):
        part = conn.recv(65536)
        if not part:
            raise OSError("no whole request")
        body += part
