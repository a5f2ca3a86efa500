"""The demo web app (FastAPI) and ``deltasync demo``'s entry point.

Routes: ``/`` the page, ``/static/*`` its script and style (nothing from a CDN),
``/api/state`` a JSON snapshot, ``/api/events`` the live Server-Sent Events
stream (a ``snapshot`` event first, then one event per change), ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import queue
import socket
import sys
import threading
import webbrowser
from collections.abc import AsyncIterator, Callable
from concurrent.futures import wait
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from deltasync._util.worker import run_in_background
from deltasync.errors import DemoError, StorageError
from deltasync.storage import Store, open_store
from spaces_demo.live import DemoOptions, DemoRun, Episode, prepare_demo_store
from spaces_demo.summary import end_of_run_lines
from spaces_demo.warmup import warm_kernels

__all__ = ["connect_signal", "create_app", "prepare_store", "run_demo"]

log = logging.getLogger("deltasync.demo")

KEEPALIVE_S = 15.0


def _static_dir() -> Path:
    return Path(str(resources.files("spaces_demo") / "static"))


def connect_signal(app: FastAPI, run: DemoRun, base_url: str | None = None) -> None:
    """Wire the signal server in: where the trainer publishes and the follower hears commits.

    * self-contained (training here, no ``--signal-url``) and served at ``base_url``:
      an in-process signal server (``deltasync.server.create_app``) is mounted at
      ``/signal``; the trainer's uploader publishes every commit to it and the
      follower listens to its Server-Sent Events;
    * ``--signal-url``: the follower listens there (a trainer here publishes there too);
    * otherwise (in-process tests): the uploader's Future callbacks wake the follower.

    In every mode the follower also polls the store, so a silent or dead signal server
    only costs latency. Tokens come from ``DELTASYNC_PUBLISH_TOKEN`` /
    ``DELTASYNC_SUBSCRIBE_TOKEN`` for an external server.
    """
    url = run.options.signal_url
    if url is None and run.options.train and base_url is not None:
        from deltasync.server import Settings
        from deltasync.server import create_app as create_signal_app

        signal_app = create_signal_app(Settings(db_path=":memory:"), run.store)
        app.mount("/signal", signal_app)
        app.state.close_signal_streams = signal_app.state.relay.close_streams  # before a shutdown
        url = base_url.rstrip("/") + "/signal"
        token = None
    else:
        token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    if url is None:
        return
    if run.options.train:
        run.publish_url = url
        run.publish_token = (
            None
            if url.endswith("/signal") and run.options.signal_url is None
            else (os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None)
        )
    run.listen_to(url, token, f"signal server {url} (SSE) + store polling")


def create_app(run: DemoRun, *, start: bool = True, base_url: str | None = None) -> FastAPI:
    """The FastAPI app serving ``run``'s page; starts/stops ``run`` with the app when ``start``.

    ``base_url``: where this app will be reachable; mounts the in-process signal server (see
    :func:`connect_signal`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if start:
            run.start()
        try:
            yield
        finally:
            if start:
                await asyncio.to_thread(run.stop)

    app = FastAPI(title="deltasync demo", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    connect_signal(app, run, base_url)
    static = _static_dir()
    app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(static / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "status": run.board.snapshot()["status"]}

    @app.get("/api/state")
    async def state() -> JSONResponse:
        return JSONResponse(run.board.snapshot(), headers={"Cache-Control": "no-store"})

    @app.get("/api/events")
    async def events(request: Request) -> StreamingResponse:
        sub = run.board.subscribe(asyncio.get_running_loop())

        async def stream() -> AsyncIterator[str]:
            try:
                yield "retry: 1000\n\n"
                while True:
                    try:
                        event = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        yield ": keep-alive\n\n"
                        continue
                    if event is None:
                        return
                    yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
            finally:
                run.board.unsubscribe(sub)

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return app


# ------------------------------------------------------------------ entry


def prepare_store(url: str, *, wipe: bool) -> Store:
    """Open the store; with ``wipe`` (training), mark an empty store as the demo's or empty one the
    demo created earlier (see :func:`~spaces_demo.live.prepare_demo_store`).

    Any other non-empty store (someone's run, a directory of files) is refused with a DemoError
    and left untouched.
    """
    local = "://" not in url or url.startswith("file://")
    if wipe and local:
        path = Path(unquote(urlparse(url).path) if url.startswith("file://") else url)
        if path.exists() and not path.is_dir():
            raise StorageError(f"{path} is a file, not a store directory; pass --store to pick another dir")
    store = open_store(url)
    if wipe:
        try:
            prepare_demo_store(store)
        except BaseException:
            store.close()
            raise
    return store


def _check_port(host: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise DemoError(f"--port {port} is not a TCP port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DemoError(f"{host}:{port} is already in use; pass --port to pick another") from exc
            raise DemoError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def _can_open_browser() -> bool:
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _console(run: DemoRun, print_: Callable[[str], None], url: str | None) -> Callable[[], None]:
    """Print one line per change of the inference copy's answer (each entry of the page's answer
    history, with the step the page shows, none skipped), and a summary when a run ends
    (``url``: where the page is still served, None with --exit-when-done); returns a stopper.

    Call it before the run starts: every run's end is queued (:meth:`DemoRun.on_run_end`), so a
    summary is printed for each run, even one that ``--loop`` replaced between two ticks, and
    every answer change is queued (:meth:`LiveBoard.on_answer`), however many come per tick."""
    stop = threading.Event()
    ended: queue.Queue[Episode] = queue.Queue()
    answers: queue.Queue[dict[str, Any]] = queue.Queue()
    run.board.on_answer(answers.put)
    if url is not None:
        run.on_run_end(ended.put)

    def loop() -> None:
        stopping = False
        while not stopping:
            stopping = stop.wait(0.5)  # a last round once stopped: a summary queued meanwhile is printed
            while True:  # every answer change, in order, with the step the page's history shows
                try:
                    g = answers.get_nowait()
                except queue.Empty:
                    break
                sync = "" if g.get("sync_ms") is None else f"  applied in {g['sync_ms']:.1f} ms"
                print_(f"step {g['step']:>4}{sync}  (lag {g['lag']} steps)  inference copy answers {g['text']!r}")
            s = run.board.snapshot()
            while url is not None:
                try:
                    ep = ended.get_nowait()
                except queue.Empty:
                    break
                for line in end_of_run_lines(ep.result or s, url, loop=run.options.loop):
                    print_(line)

    printing = run_in_background(loop, "demo-console")

    def stopper() -> None:
        stop.set()
        wait([printing], 5.0)

    return stopper


def _close_streams(app: FastAPI) -> None:
    """End the in-process signal server's SSE streams, which would otherwise hold a shutdown."""
    close = getattr(app.state, "close_signal_streams", None)
    if close is not None:
        close()


def _server(config: Any, app: FastAPI, run: DemoRun, print_: Callable[[str], None]) -> Any:
    """The page's uvicorn server; its first Ctrl-C stops the run before the server itself."""
    import uvicorn

    class Server(uvicorn.Server):
        stopping = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.stopping or self.should_exit:  # a second Ctrl-C, or already on the way out: at once
                _close_streams(app)
                super().handle_exit(sig, frame)
                return
            # the trainer and the follower stop first, while this server (and the in-process signal
            # server mounted on it) still answers: the trainer's last commit signals are delivered,
            # and the process then says "interrupted" once, last
            self.stopping = True
            print_("stopping the trainer and the follower (Ctrl-C again to quit at once)")

            def then() -> None:
                run.stop()
                _close_streams(app)
                super(Server, self).handle_exit(sig, frame)

            run_in_background(then, "demo-stop")

    return Server(config)


def run_demo(
    options: DemoOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    open_browser: bool = True,
    exit_when_done: bool = False,
    print_: Callable[[str], None] = print,
) -> int:
    """Serve the demo until interrupted (or, with ``exit_when_done``, until training is applied); exit status."""
    import torch
    import uvicorn

    # the trainer and the follower each get one core: on a 2-core machine, torch's
    # intra-op threads in both would mostly wait on each other
    torch.set_num_threads(1)
    _check_port(host, port)
    store = prepare_store(options.store_url, wipe=options.train)
    run = DemoRun(store, options)
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    app = create_app(run, base_url=f"http://{local}:{port}")
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")

    server = _server(config, app, run, print_)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}"
    mode = "self-contained: trainer, store, fetcher" if options.train else "follower: no trainer here"
    print_(f"deltasync demo ({mode}); store {store.url}")
    # before the clock starts: built at the first sync instead, they would hold the follower back
    print_(
        "building the codec's compiled kernels (first run only: up to ~30 s on 2 CPU cores; cached on disk after that)"
    )
    print_(f"kernels ready in {warm_kernels():.1f} s")
    print_(f"open {url} to watch patches land (Ctrl-C to stop)")
    stop_console = _console(run, print_, None if exit_when_done else url)

    def watch() -> None:
        if open_browser and _can_open_browser():
            with contextlib.suppress(Exception):
                webbrowser.open(url)
        if exit_when_done:
            run.current.finished.wait()
            _close_streams(app)
            server.should_exit = True

    run_in_background(watch, "demo-watch")
    try:
        server.run()
    finally:
        stop_console()
        store.close()
    ep = run.current  # stopped: the last run
    if ep.finished.is_set():
        if exit_when_done:
            for line in end_of_run_lines(ep.result or run.board.snapshot(), None):
                print_(line)
        ok = "bit-exact with the trainer's" if ep.bit_exact else "NOT bit-exact with the trainer's"
        print_(f"done: the inference copy holds step {run.board.applied_step}, {ok}")
    if run.board.error and ep.bit_exact is None and exit_when_done:
        return 1
    return 0 if ep.bit_exact is not False else 1
