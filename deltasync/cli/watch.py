"""``delta-upload watch DIR --store URL``: push each new checkpoint a training run writes into DIR.

Checkpoints are pushed in step order through one :class:`DeltaUploader` (each a patch on
the previous one), only once complete (see :mod:`deltasync.cli._watch_scan`). After a restart
the store's head says where to go on: checkpoints at or below it are skipped, and the
first new one continues the chain without an anchor when the head's checkpoint is still
on disk and proven equal to the store by digests.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from deltasync._util.worker import run_in_background
from deltasync.cli._common import STORE_HELP, announce_store, cast_name, cli_uploader, human_bytes
from deltasync.cli._watch_scan import SETTLE, SETTLING, Candidate, CheckpointPattern, Readiness, WatchError
from deltasync.errors import CommitFailed, DeltaSyncError, WriterFenced
from deltasync.storage import open_store

__all__ = ["DESCRIPTION", "EPILOG", "PROG", "WatchOptions", "add_arguments", "run", "run_watch"]

PROG = "delta-upload watch"
DESCRIPTION = (
    "Follow a training output dir and push each new complete checkpoint, in step order,\n"
    "as patches against the previous push (an anchor every --anchor-every pushes). Ctrl-C finishes\n"
    "the commit in flight; a second Ctrl-C abandons it."
)
EPILOG = "example:\n  delta-upload watch outputs/ --store s3://bucket/runs/r1 --signal http://127.0.0.1:8000"

Say = Callable[[str], None]


def _sleep(seconds: float) -> bool:
    threading.Event().wait(seconds)
    return False


@dataclass(slots=True)
class WatchOptions:
    """What ``run_watch`` does; ``wait(seconds)`` sleeps between polls and returns True to stop.

    ``settle``: a complete checkpoint not modified for this many seconds (by ``clock``, the
    wall clock of file mtimes) is pushed at first sight, a younger one once unchanged over two
    polls (the next poll comes when it has settled, at most ``interval`` later). ``once``: poll,
    push what is ready, poll again only if a complete checkpoint still had to settle, then stop.
    """

    interval: float = 10.0
    settle: float = SETTLE
    clock: Callable[[], float] = field(default=time.time)
    once: bool = False
    delete_pushed: bool = False
    cast: Any = None  # a torch dtype
    wait: Callable[[float], bool] = field(default=lambda s: _sleep(s))
    stopping: Callable[[], bool] = field(default=lambda: False)
    say: Say = field(default=lambda m: print(m, flush=True))
    warn: Say = field(default=lambda m: print(m, file=sys.stderr, flush=True))


@dataclass(slots=True)
class _Pushed:
    cand: Candidate
    fingerprint: Any


class _Session:
    """One watch session: the candidates it has dealt with and the checkpoints it pushed."""

    def __init__(self, pattern: CheckpointPattern, up: Any, opts: WatchOptions) -> None:
        self.pattern, self.up, self.opts = pattern, up, opts
        self.ready = Readiness(opts.settle, opts.clock)
        self.head: int | None = up.last_committed_step
        self.resumed = self.head is None  # nothing to resume from on a new run
        self.done: set[Path] = set()
        self.pushed: list[_Pushed] = []
        self.told_waiting: str | None = None  # what was last said while waiting: 'missing' or 'empty'
        self.failed = False
        #: seconds until every complete checkpoint of the last poll has settled (0: none is settling)
        self.settle_wait = 0.0

    # ----------------------------------------------------------- one poll

    def poll(self, final: bool = False) -> int:
        """Look once, push every ready checkpoint in step order; returns how many were pushed.

        ``final``: the last poll of ``--once``, which reports what it leaves behind.
        """
        cands = self.pattern.scan(missing_ok=not self.opts.once)
        if not cands and self.told_waiting != ("missing" if not self.pattern.root.exists() else "empty"):
            self._no_checkpoints()
        for c in cands:
            behind = self.head is not None and c.step <= self.head
            if behind and c.path not in self.done and (self.resumed or c.step != self.head):
                self.opts.say(f"{c.name}: step {c.step} is not after step {self.head} in the store: skipped")
                self.done.add(c.path)
        pending = [c for c in cands if c.path not in self.done and (self.head is None or c.step > self.head)]
        states = {c.path: self.ready.check(c.path) for c in pending}
        head_ckpt = [c for c in cands if c.step == self.head and not self.resumed]
        for c in head_ckpt:
            states[c.path] = self.ready.check(c.path)
        self.settle_wait = max(
            (self.ready.settles_in(p) for p, (_, why) in states.items() if why == SETTLING), default=0.0
        )
        n = 0
        for i, c in enumerate(pending):
            if self.opts.stopping():
                break
            if self.head is not None and c.step <= self.head:  # two names for one step (checkpoint-10, step_10)
                self.opts.warn(f"{c.name}: step {c.step} was just pushed from another checkpoint: skipped")
                self.done.add(c.path)
                continue
            ok, why = states[c.path]
            if not ok:
                if any(states[d.path][0] for d in pending[i + 1 :]):
                    self.opts.warn(f"{c.name}: incomplete ({why}) and a newer checkpoint is complete: skipped")
                    self.done.add(c.path)
                    continue
                if final:
                    self.opts.warn(f"{c.name}: not complete yet ({why}): left for the next run")
                break
            if not self.resumed:
                self._resume([h for h in head_ckpt if states[h.path][0]])
                self.done.update(h.path for h in head_ckpt)
            n += self._push(c)
        return n

    def _no_checkpoints(self) -> None:
        root = self.pattern.root
        if not root.exists():
            self.opts.warn(
                f"waiting for {root} to be created (the training output dir; nothing there yet: start the trainer, "
                "or check the path; Ctrl-C stops)"
            )
            self.told_waiting = "missing"
            return
        if self.pattern.glob is None and (
            any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").exists()
        ):
            raise WatchError(
                f"{root} holds a checkpoint itself, not checkpoint dirs ({self.pattern.describe()}); watch the "
                f"training output dir instead, or push this one with `delta-upload {root} --store URL --step N`"
            )
        self.opts.warn(f"waiting for checkpoints in {root} ({self.pattern.describe()})")
        self.told_waiting = "empty"

    # ---------------------------------------------------------- resume, push

    def _load(self, c: Candidate) -> dict[str, Any] | None:
        from deltasync._util.checkpoint_io import load_checkpoint

        try:
            state = load_checkpoint(c.path)
        except (OSError, DeltaSyncError) as exc:
            self.opts.warn(f"{c.name}: cannot be read ({exc}): skipped")
            return None
        cast = self.opts.cast
        if cast is not None:
            state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
        return state

    def _resume(self, head_ckpt: list[Candidate]) -> None:
        self.resumed = True
        for c in head_ckpt:
            state = self._load(c)
            if state is not None and self.up.resume(state, c.step):
                self.opts.say(
                    f"{c.name}: equal to step {c.step} in the store (digests): the chain goes on with patches"
                )
                return
            self.opts.say(f"{c.name}: differs from step {c.step} in the store: the next push is an anchor")
            return
        self.opts.say(
            f"the checkpoint of step {self.head} (the store's newest) is not on disk: the next push is an anchor"
        )

    def _push(self, c: Candidate) -> int:
        self.done.add(c.path)
        fp = self.ready.current(c.path)
        state = self._load(c)
        if state is None:
            return 0
        t0 = time.perf_counter()
        try:
            info = self.up.push(state, c.step).result()
        except WriterFenced:
            raise
        except CommitFailed as exc:
            self.failed = True
            self.opts.warn(f"{c.name}: step {c.step} was not committed ({exc}); the next push is an anchor")
            return 0
        self.head = c.step
        full = sum(v.numel() * v.element_size() for v in state.values()) or 1
        self.opts.say(
            f"step {info.step}: {info.kind}, {human_bytes(info.nbytes)} ({100 * info.changed / max(info.total, 1):.3f}% "
            f"changed, {info.nbytes / full:.4f} of a full checkpoint) from {c.name} in {time.perf_counter() - t0:.2f} s"
        )
        self.pushed.append(_Pushed(c, fp))
        if self.opts.delete_pushed:
            self._delete_older()
        return 1

    def _delete_older(self) -> None:
        """Delete the checkpoints this session pushed, except the newest it pushed."""
        keep = self.pushed[-1]
        for p in list(self.pushed[:-1]):
            path = p.cand.path
            self.pushed.remove(p)
            if p.cand.step >= keep.cand.step or path.is_symlink() or self.pattern.step_of(path) != p.cand.step:
                self.opts.warn(f"{path}: not deleted (a link, or no longer what was pushed)")
                continue
            if self.ready.fingerprint(_files_of(path)) != p.fingerprint:
                self.opts.warn(f"{path}: changed since step {p.cand.step} was pushed: not deleted")
                continue
            try:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError as exc:
                self.opts.warn(f"{path}: could not delete it ({exc})")
                continue
            self.ready.forget(path)
            self.opts.say(f"deleted {path} (step {p.cand.step} is in the store)")


def _files_of(path: Path) -> list[Path]:
    from deltasync.cli._watch_scan import weight_files

    return weight_files(path)[0]


def run_watch(pattern: CheckpointPattern, up: Any, opts: WatchOptions) -> int:
    """Follow ``pattern.root`` and push through ``up`` until stopped (or, with ``once``, one or two polls)."""
    session = _Session(pattern, up, opts)
    polls = 0
    while True:
        polls += 1
        session.poll(final=opts.once and polls >= 2)
        if opts.stopping() or (opts.once and polls >= 2):
            break
        # a checkpoint written just now is polled again once it has settled, not a whole interval later;
        # --once waits for nothing else
        if session.settle_wait > 0:
            pause = min(opts.interval, session.settle_wait)
        else:
            pause = 0.0 if opts.once else opts.interval
        if (pause > 0 and opts.wait(pause)) or opts.stopping():
            break
    if opts.once and not session.pushed:
        opts.say(f"nothing new to push in {pattern.root}")
    return 1 if session.failed else 0


def run(args: argparse.Namespace) -> int:
    """``delta-upload watch``: build the uploader, handle Ctrl-C / SIGTERM, run the loop."""
    pattern = CheckpointPattern(Path(args.dir), args.glob, args.step_regex)
    pattern.scan(missing_ok=not args.once)  # a file (or, with --once, a missing dir) is an error before anything else
    if args.interval <= 0:
        raise WatchError("--interval must be > 0 seconds")
    if not args.settle >= 0:
        raise WatchError("--settle must be >= 0 seconds")
    import torch

    stop = threading.Event()
    # A signal handler runs in the main thread between two bytecodes, which may be inside stop.wait()
    # holding stop's lock, or inside a print: setting the event or printing there can deadlock. The
    # handler only puts on a SimpleQueue (reentrant); a thread sets the event and says so.
    requests: queue.SimpleQueue[int] = queue.SimpleQueue()
    requested = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal requested
        if requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        requested = True
        requests.put(signum)

    def stop_when_asked() -> None:
        if requests.get() < 0:
            return  # the watch ended without a stop request
        print("stopping after the current commit (Ctrl-C again to abandon it)", file=sys.stderr, flush=True)
        stop.set()

    run_in_background(stop_when_asked, "deltasync-watch-stop")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open_store(args.store) as store:
            announce_store(store)
            up = cli_uploader(store, args)
            abandoned = False
            try:
                opts = WatchOptions(
                    interval=args.interval,
                    settle=args.settle,
                    once=args.once,
                    delete_pushed=args.delete_pushed,
                    cast=getattr(torch, args.cast) if args.cast else None,
                    wait=stop.wait,
                    stopping=lambda: requested,  # set in the handler itself: no push starts after it
                )
                rc = run_watch(pattern, up, opts)
            except KeyboardInterrupt:
                abandoned = True
                raise
            finally:
                if not abandoned:
                    up.close()
            if requested:
                print(f"stopped; the newest committed step is {up.last_committed_step}", file=sys.stderr, flush=True)
            return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        requests.put(-1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``delta-upload watch``."""
    from deltasync.cli._watch_scan import DEFAULT_HELP

    p.add_argument("dir", help=f"training output dir holding checkpoints: {DEFAULT_HELP}")
    p.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    p.add_argument(
        "--glob",
        metavar="PATTERN",
        help="checkpoints are what this pattern (relative to DIR) matches: dirs or .safetensors",
    )
    p.add_argument(
        "--step-regex",
        metavar="REGEX",
        help="regex whose group 1 is the step, searched in the matched path (default: its last number)",
    )
    p.add_argument("--interval", type=float, default=10.0, metavar="SECONDS", help="seconds between polls of DIR")
    p.add_argument(
        "--once",
        action="store_true",
        help="push what is complete now and exit (waiting only for a checkpoint modified in the last --settle seconds)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=SETTLE,
        metavar="SECONDS",
        help="a complete checkpoint not modified for this long is pushed at first sight; a younger one once it is "
        "unchanged between two polls",
    )
    p.add_argument(
        "--delete-pushed",
        action="store_true",
        help="delete a checkpoint dir (all of it, optimizer state too) once a newer one is pushed: only dirs this "
        "process pushed and that match the pattern, never the newest pushed one (the baseline after a restart)",
    )
    p.add_argument("--anchor-every", type=int, default=50, metavar="N", help="full anchor every N pushes")
    p.add_argument(
        "--cast",
        type=cast_name,
        metavar="{bf16,fp16,fp32}",
        help="cast floating tensors to this dtype before diffing (keeps a bf16 run bf16 when the trainer saves "
        "fp32; default: each tensor's own dtype)",
    )
    p.add_argument("--signal", metavar="URL", help="signal server to notify (token: $DELTASYNC_PUBLISH_TOKEN)")
    p.add_argument("--run", metavar="NAME", help="run name at the signal server (default: the store's run id)")
