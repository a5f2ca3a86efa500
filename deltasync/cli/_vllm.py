"""``deltasync follow --vllm URL [URL ...]``: a sidecar keeping vLLM servers at the newest committed step.

Each new committed step (SSE from ``--signal``, else polling the store) runs
:class:`~deltasync.serving.driver.VLLMDriver`'s whole update sequence on every server
(pause, the four weight-transfer phases with ``weight_version=str(step)``, prefix-cache reset,
resume); one line per server and step; a step a server refused is retried with backoff. With
``--signal``, each server is reported to the signal server's fleet view as one replica.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from deltasync.cli._common import announce_store

__all__ = ["add_vllm_arguments", "run_vllm", "wait_until_answering"]

#: seconds between two tries of a server that does not answer yet
START_POLL = 2.0


def wait_until_answering(
    urls: Sequence[str],
    *,
    get: Callable[[str], Any] | None = None,
    wait: Callable[[float], object],
    say: Callable[[str], None],
) -> None:
    """Return once every server in ``urls`` answers HTTP at all (``GET /health``, any status).

    A sidecar started with its server (``vllm serve ... &`` then ``deltasync follow --vllm``) meets a
    server that does not listen yet: a GPU server takes a minute or more to load. Connection errors
    are waited out (one line says so, naming the URL, in case it has a typo); an answer, even an error
    status, ends the wait, and setting up the backend then says what is wrong. ``wait(seconds)``
    returns true when the caller stops (Ctrl-C): the wait ends then too.
    """
    import httpx

    def fetch(url: str) -> Any:
        return httpx.get(url, timeout=10.0)

    getter = get if get is not None else fetch
    for url in urls:
        said = False
        while True:
            try:
                getter(f"{url.rstrip('/')}/health")
                break
            except httpx.TransportError as exc:
                if not said:
                    say(
                        f"waiting for the vLLM server at {url} to answer ({type(exc).__name__}: a server takes a "
                        "minute or more to start; check the URL if this lasts; Ctrl-C stops)"
                    )
                    said = True
            if wait(START_POLL):
                return


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--vllm`` options of ``deltasync follow``."""
    g = p.add_argument_group("vLLM servers (instead of --out)")
    g.add_argument(
        "--vllm",
        nargs="+",
        metavar="URL",
        help="base URLs of vLLM servers to keep at the newest step (started with VLLM_SERVER_DEV_MODE=1 and "
        '--weight-transfer-config \'{"backend": "deltasync"}\')',
    )
    g.add_argument(
        "--vllm-store",
        metavar="URL",
        help="the store URL as the servers reach it (default: --store)",
    )
    g.add_argument(
        "--pause-mode",
        choices=("wait", "abort", "keep"),
        default="wait",
        help="in-flight requests at each update: wait for them (default), abort them, or keep them frozen "
        "(they then finish on the new weights: mixed samples)",
    )
    g.add_argument("--vllm-timeout", type=float, default=600.0, metavar="SECONDS", help="timeout of each HTTP call")
    g.add_argument("--no-prefetch", action="store_true", help="do not prepare new steps in the background")
    g.add_argument(
        "--all-or-nothing",
        action="store_true",
        help="roll each step out to every server or to none: prepare it everywhere first, and bring the servers "
        "that took it back to their previous step if any server does not",
    )


def run_vllm(args: argparse.Namespace) -> int:
    """Drive the servers until ``--until`` is served everywhere (exit 0) or Ctrl-C."""
    from deltasync.run import RunReader
    from deltasync.serving.driver import ServerUpdate, VLLMDriver
    from deltasync.signal import StepWatcher
    from deltasync.storage import open_store

    token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    api_key = os.environ.get("VLLM_API_KEY") or None
    stop = threading.Event()
    with open_store(args.store) as store:
        announce_store(store)
        reader = RunReader(store)
        run = args.run or (reader.run_id() if args.signal else None)
        reporting = bool(args.signal) and not args.no_report
        if reporting and run is None:
            print(
                "not reporting to the fleet view: the run's name is not known yet (nothing committed); pass --run",
                file=sys.stderr,
                flush=True,
            )
            reporting = False
        replicas = [f"{args.replica}-{i}" for i in range(len(args.vllm))] if args.replica else None
        driver = VLLMDriver(
            args.vllm,
            args.vllm_store or store.url,
            pause_mode=args.pause_mode,
            timeout=args.vllm_timeout,
            api_key=api_key,
            prefetch=not args.no_prefetch,
            signal=args.signal if reporting else None,
            signal_token=os.environ.get("DELTASYNC_REPORT_TOKEN") or token,
            run=run if reporting else None,
            replicas=replicas,
            all_or_nothing=args.all_or_nothing,
        )
        with driver:
            wait_until_answering(args.vllm, wait=stop.wait, say=lambda line: print(line, file=sys.stderr, flush=True))
            driver.init()
            for url, step in driver.serving().items():
                print(f"{url}: serving step {step if step is not None else '(none yet)'}", file=sys.stderr, flush=True)

            def report(u: ServerUpdate) -> None:
                if u.ok:
                    print(f"step {u.step} -> {u.url}: serving (paused {u.pause_s * 1000:.0f} ms)", flush=True)
                else:
                    print(f"step {u.step} -> {u.url}: {u.state}: {u.error}", file=sys.stderr, flush=True)

            watcher = StepWatcher(
                reader.latest_step,
                signal_url=args.signal,
                token=token,
                run=run,
                heartbeat=min(2.0, args.poll_interval),
                poll_interval=args.poll_interval,
                stop=stop,
            )
            serving = driver.follow(watcher, until=args.until, on_update=report)
    print("stopped; serving: " + ", ".join(f"{u} step {s}" for u, s in serving.items()))
    if args.until is not None:
        return 0 if all(s is not None and s >= args.until for s in serving.values()) else 1
    return 0
