"""``deltasync follow --vllm URL [URL ...]``: a sidecar keeping vLLM servers at the newest committed step.

Each new committed step (SSE from ``--signal``, else polling the store) runs
:class:`~deltasync.serving.driver.VLLMDriver`'s whole update sequence on each server, every server
on its own (one that hangs or is gone never holds back the others): prepare, pause, the four
weight-transfer phases with ``weight_version=str(step)``, prefix-cache reset, resume; one line per
server and step; a step a server refused is retried with backoff. A server that does not answer
(at start, or later) is reported unreachable and set up once it answers (a restarted server is a
new process: it is set up again). A server that answers garbage (not its API, an error, too much,
too slowly) is reported ``failed`` (or ``unreachable``) and the others are kept current; ``--until N``
returns once every server that counts serves N. With ``--signal``, each server is reported to the
signal server's fleet view as one replica, with its step's manifest digest.

After each update the server's behavioural audit runs (unless ``--no-audit``): its result is one line,
and an audit that could not run is one line too, ``<url>: audit of step N could not run: <why>``,
once per server, step and reason (also the fleet's ``audit_error`` and the metric
``deltasync_vllm_audits_unavailable_total``). Every text a server sent is printed escaped.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltasync._util.text import escape_text
from deltasync.cli._common import announce_store

if TYPE_CHECKING:
    from deltasync.run import RunReader
    from deltasync.serving.audit import AuditResult, AuditSource
    from deltasync.serving.driver import ServerUpdate, VLLMDriver
    from deltasync.storage import Store

__all__ = ["add_vllm_arguments", "run_vllm"]


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
    g.add_argument(
        "--vllm-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="timeout of each call of an update, sized for one update: the pause waits for in-flight requests, the "
        "prepare and update_weights download the step (default 600); a server that hangs holds only its own update",
    )
    g.add_argument(
        "--probe-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="timeout of the quick calls (/weight_info, /is_paused, /resume); a server that does not answer one is "
        "unreachable (default 10)",
    )
    g.add_argument("--no-prefetch", action="store_true", help="do not prepare new steps in the background")
    g.add_argument(
        "--no-prepare",
        action="store_true",
        help="do not have each server prepare a step before pausing it (the pause then includes the download)",
    )
    g.add_argument(
        "--no-audit",
        action="store_true",
        help="do not audit what each server computes after each update (probe logprobs, prefix-cache canary; "
        "docs/audit.md)",
    )
    g.add_argument(
        "--audit-action",
        choices=("report", "pause", "rollback"),
        default="report",
        help="what to do with a server whose audit fails: report it diverged (default), pause it (out of the "
        "rotation until it is restarted), or roll it back to the step it served before",
    )
    g.add_argument(
        "--audit-params-every",
        type=int,
        default=0,
        metavar="N",
        help="every N updates, also re-hash each server's parameters against the step's digests (0: never)",
    )
    g.add_argument(
        "--all-or-nothing",
        action="store_true",
        help="roll each step out to every server or to none: prepare it everywhere first, and bring the servers "
        "that took it back to their previous step if any server does not",
    )


def _digests(reader: RunReader) -> Callable[[int], str | None]:
    """The manifest digest of a step, read once per step (None when it cannot be read)."""
    from deltasync.errors import DeltaSyncError

    cache: dict[int, str | None] = {}
    lock = threading.Lock()

    def digest(step: int) -> str | None:
        with lock:
            if step in cache:
                return cache[step]
        value = None
        with contextlib.suppress(DeltaSyncError, OSError):
            value = reader.committed(step).digest
        with lock:
            if value is not None:
                cache[step] = value
        return value

    return digest


def _audit_source(store: Store, args: argparse.Namespace) -> AuditSource:
    """The driver's audit of ``store``'s probes (``deltasync.serving.audit``), with the CLI's options."""
    from deltasync.serving.audit import AuditConfig, AuditSource

    if args.audit_params_every < 0:
        raise SystemExit("deltasync follow: error: --audit-params-every must be >= 0")
    return AuditSource(store, AuditConfig(action=args.audit_action, params_every=args.audit_params_every))


class _Lines:
    """What the sidecar prints while it follows: one line per update, change and audit (stdout for what
    went well, stderr for the rest), every server's text escaped; an audit that could not run once per
    server, step and reason."""

    def __init__(self, driver: VLLMDriver) -> None:
        self.driver = driver
        self._said: set[tuple[str, int | None, str]] = set()
        self._lock = threading.Lock()

    @staticmethod
    def say(line: str) -> None:
        print(escape_text(line), file=sys.stderr, flush=True)

    @staticmethod
    def out(line: str) -> None:
        print(escape_text(line), flush=True)

    def update(self, u: ServerUpdate) -> None:
        prep = ""
        if u.prepare_s is not None:
            prep = f"prepared in {u.prepare_s * 1000:.0f} ms, " if u.prepared else "not prepared, "
        if u.ok:
            self.out(f"step {u.step} -> {u.url}: serving ({prep}paused {u.pause_s * 1000:.0f} ms)")
            if u.audit is not None:
                self.out(f"{u.url}: {u.audit.summary()}")
        else:
            self.say(f"step {u.step} -> {u.url}: {u.state}: {_unprefixed(u.url, u.error)}")

    def change(self, url: str, what: str) -> None:
        self.say(f"{url}: {_unprefixed(url, what)}")

    def audit(self, url: str, result: AuditResult | None, why: str | None) -> None:
        if result is not None:
            self.out(f"{url}: {result.summary()}")
            return
        # an audit that could not run is kept only while the server still serves the step it was of
        step = self.driver.serving().get(url)
        reason = _unprefixed(url, why) or "no reason given"
        with self._lock:
            if (url, step, reason) in self._said:
                return  # said once per server, step and reason: not at every re-audit of a set-up
            self._said.add((url, step, reason))
        self.say(f"{url}: audit of step {'?' if step is None else step} could not run: {reason}")

    def started(self) -> None:
        """One line per server after the set-up: what it serves, or why it is not driven yet."""
        for s in self.driver.sessions:
            state, why = s.state()
            step = "(none yet)" if s.serving is None else s.serving
            if state == "unreachable":
                self.say(f"{s.url}: unreachable (no answer yet): set up once it answers; the others are kept current")
            elif state in ("failed", "needs_replacement"):
                self.say(
                    f"{s.url}: {state} (serving step {step}): {_unprefixed(s.url, why)}; the others are kept current"
                )
            else:
                self.say(f"{s.url}: serving step {step}")


def _unprefixed(url: str, text: str | None) -> str | None:
    """``text`` without the server's URL where it names it (the line already starts with it): the
    errors carry it for programmatic callers, a sidecar line would say it twice."""
    if text is None:
        return None
    return text.replace(f"{url}: ", "").replace(f"{url}/", "/")


def run_vllm(args: argparse.Namespace) -> int:
    """Drive the servers until ``--until`` is served by every server that counts (exit 0: at least one
    serves it, and every other is reported failed, unreachable or needs replacement) or Ctrl-C."""
    from deltasync.run import RunReader
    from deltasync.signal import StepWatcher
    from deltasync.storage import open_store

    token = os.environ.get("DELTASYNC_SUBSCRIBE_TOKEN") or os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    stop = threading.Event()
    # the sidecar prints each outcome, change and audit itself (one line each, through the driver's
    # callbacks): the driver's own log lines would repeat them
    logging.getLogger("deltasync.vllm.driver").setLevel(logging.ERROR)

    with open_store(args.store) as store:
        announce_store(store)
        reader = RunReader(store)
        run = args.run or (reader.run_id() if args.signal else None)
        if args.signal and not args.no_report and run is None:
            _Lines.say(
                "not reporting to the fleet view: the run's name is not known yet (nothing committed); pass --run"
            )
        driver = _driver(args, store, reader, run if args.signal and not args.no_report else None, token)
        lines = _Lines(driver)
        with driver, contextlib.ExitStack() as scope:
            if driver.metrics is not None:
                endpoint = scope.enter_context(driver.metrics.serve(args.metrics_port, args.metrics_host))
                _Lines.say(f"metrics at {endpoint.url}")
            driver.init()  # a server that does not answer, or answers garbage, is set up again later
            lines.started()
            watcher = StepWatcher(
                reader.latest_step,
                signal_url=args.signal,
                token=token,
                run=run,
                heartbeat=min(2.0, args.poll_interval),
                poll_interval=args.poll_interval,
                stop=stop,
            )
            serving = driver.follow(
                watcher, until=args.until, on_update=lines.update, on_change=lines.change, on_audit=lines.audit
            )
            states = {s.url: s.state() for s in driver.sessions}
    lines.out("stopped; serving: " + ", ".join(_standing(u, s, states[u]) for u, s in serving.items()))
    if args.until is not None:
        counted = [s for u, s in serving.items() if states[u][0] not in ("failed", "unreachable", "needs_replacement")]
        return 0 if counted and all(s is not None and s >= args.until for s in counted) else 1
    return 0


def _standing(url: str, step: int | None, state: tuple[str, str | None]) -> str:
    """``URL step S``, or ``URL failed (last step S): why`` for a server that does not count."""
    if state[0] in ("failed", "unreachable", "needs_replacement"):
        return f"{url} {state[0]} (last step {step}){': ' + state[1] if state[1] else ''}"
    return f"{url} step {step}"


def _driver(
    args: argparse.Namespace, store: Store, reader: RunReader, run: str | None, token: str | None
) -> VLLMDriver:
    """The sidecar's driver, with the CLI's options (``run``: report to the fleet view of that run)."""
    from deltasync.serving.driver import DriverOptions, FleetReporting, VLLMDriver

    metrics = None
    if args.metrics_port is not None:
        from deltasync.serving.driver_metrics import DriverMetrics

        metrics = DriverMetrics()
    options = DriverOptions(
        pause_mode=args.pause_mode,
        timeout=args.vllm_timeout,
        probe_timeout=args.probe_timeout,
        api_key=os.environ.get("VLLM_API_KEY") or None,
        prefetch=not args.no_prefetch,
        prepare=not args.no_prepare,
        all_or_nothing=args.all_or_nothing,
    )
    fleet = None
    if run is not None:
        replicas = [f"{args.replica}-{i}" for i in range(len(args.vllm))] if args.replica else None
        report_token = os.environ.get("DELTASYNC_REPORT_TOKEN") or token
        fleet = FleetReporting(args.signal, run, report_token, replicas, digest=_digests(reader))
    return VLLMDriver(
        args.vllm,
        args.vllm_store or store.url,
        options,
        reporting=fleet,
        audit=None if args.no_audit else _audit_source(store, args),
        metrics=metrics,
    )
