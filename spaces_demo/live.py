"""The live system behind the page: a trainer thread and an inference follower.

Self-contained mode (nothing configured): the trainer trains a tiny Qwen3 with
AdamW (fp32 master weights) and pushes the bf16 view of every step through a
:class:`~deltasync.DeltaUploader` into the store; the follower waits for a new
step, reads its manifest, brings a separate bf16 inference copy there with
:meth:`~deltasync.DeltaFetcher.sync` and records what it now answers.

Follower mode (``train=False``): only the follower runs, against a store that a
trainer elsewhere writes to.

The follower runs the one :class:`deltasync.signal.FollowLoop` over a
:class:`deltasync.signal.StepWatcher` (as ``deltasync follow`` and the vLLM prefetcher do): the
signal server's SSE stream when :func:`spaces_demo.app.connect_signal` names one, and store polling
in every mode, with :class:`StepSignal` (the uploader's Future callbacks, in-process) cutting the
pauses short.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from deltasync._util.worker import run_in_background
from deltasync.errors import DeltaSyncError, DemoError, ObjectNotFound
from deltasync.fetcher import DeltaFetcher
from deltasync.signal import Attempt, FollowLoop, RetryPolicy, StepSeen, StepWatcher
from deltasync.storage import Store
from deltasync.uploader import CommitInfo, DeltaUploader
from spaces_demo.board import LiveBoard
from spaces_demo.rows import bit_snapshot, layer_change, manifest_row
from spaces_demo.step_signal import StepSignal
from spaces_demo.toy import PROMPT, TARGET, build_model, greedy, layer_groups
from spaces_demo.trainer import ANCHOR_BYTES_FRACTION, ToyTrainer, demo_uploader, wait_for_commit

__all__ = [
    "ANCHOR_BYTES_FRACTION",
    "DEMO_KEY",
    "DEMO_MARKER",
    "DemoOptions",
    "DemoRun",
    "Episode",
    "StepSignal",
    "bit_snapshot",
    "layer_change",
    "manifest_row",
    "prepare_demo_store",
]

log = logging.getLogger("deltasync.demo")

DEMO_KEY = "demo.json"
"""Store key where the trainer records which toy model it trains (read by followers)."""

DEMO_MARKER = ".deltasync-demo"
"""Store key the demo writes into an empty store it starts training in. Only a store holding it
is ever emptied by the demo (at start, and by ``--loop``); the marker itself stays."""


def prepare_demo_store(store: Store) -> None:
    """Make ``store`` ready for a fresh training run, or refuse (DemoError) and touch nothing.

    An empty store gets the demo's marker; a store holding the marker (the demo made it)
    is emptied except for the marker; any other store (a real run, someone's files) is refused.
    """
    keys = [o.key for o in store.list("")]
    if not keys:
        store.put(DEMO_MARKER, json.dumps({"created_by": "deltasync demo"}).encode())
        return
    if DEMO_MARKER not in keys:
        raise DemoError(
            f"{store.url} is not empty and was not created by the demo ({len(keys)} objects, e.g. {keys[0]}); "
            "the demo trains only into an empty store or one it created, and never deletes anything else: "
            "pass --store with a new path or an empty directory"
        )
    rest = [k for k in keys if k != DEMO_MARKER]
    if rest:
        store.delete_many(rest)


MAX_NEW_MANIFESTS = 64  # a follower far behind reads only the newest manifests for the charts
#: reconnects to the signal server: 0.2 s, doubling, at most 5 s apart
RECONNECT = RetryPolicy(retries=0, backoff=0.2, max_backoff=5.0)
STEP_THROUGH = 16  # up to this many new steps are applied one by one (exact per-step heatmap), more are jumped
#: while the signal stream is up, the follower still checks the store this often (a lost signal)
SIGNAL_STORE_CHECK_S = 5.0
#: a signal stream that failed this many times releases the trainer (the follower polls meanwhile)
LISTEN_LOST = 3
#: how long a run's trainer waits for its follower to listen before its first commit (then trains anyway)
LISTEN_WAIT_S = 15.0
#: how long a run's trainer waits, after committing the initial weights, for the inference copy to hold them
READY_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``deltasync demo`` runs (see its --help)."""

    store_url: str
    train: bool = True
    steps: int = 400
    lr: float = 1e-3
    model: str = "small"
    anchor_every: int = 50
    step_interval: float = 0.25
    poll_interval: float = 0.5
    signal_url: str | None = None
    signal_run: str | None = None
    seed: int = 0
    loop: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise DemoError("--steps must be >= 1")
        if not self.lr > 0:
            raise DemoError("--lr must be > 0")
        if self.anchor_every < 1:
            raise DemoError("--anchor-every must be >= 1")
        if self.step_interval < 0 or not self.poll_interval > 0:
            raise DemoError("--step-interval must be >= 0 and the poll interval > 0")
        if self.loop < 0:
            raise DemoError("--loop must be >= 0 seconds")
        if self.loop and not self.train:
            raise DemoError("--loop restarts training: it cannot be combined with --no-train")
        if self.loop and "://" in self.store_url and not self.store_url.startswith(("file://", "memory://")):
            raise DemoError("--loop empties the store before each new run: use it with a local store only")


# -------------------------------------------------------------------- run


@dataclass(eq=False)
class Episode:
    """One training run of the demo (``--loop`` starts the next one): its number, its own events
    and its result.

    :meth:`DemoRun.restart` builds the next episode whole and publishes it with one assignment
    to :attr:`DemoRun.current`, so whoever reads ``run.current`` once gets one run's number,
    events and result together, never one run's number with the previous run's ``finished``.
    """

    number: int
    #: the in-process wake-up of this run's follower (the uploader's Future callbacks)
    signal: StepSignal
    #: tells this run's threads to end
    stop: threading.Event = field(default_factory=threading.Event)
    #: set once the follower holds the trainer's last step and compared it (or a thread failed)
    finished: threading.Event = field(default_factory=threading.Event)
    #: set once the trainer is done and handed over its last weights (``final``)
    trainer_done: threading.Event = field(default_factory=threading.Event)
    #: set once the follower listens: its signal stream is up (or keeps failing: it polls), or its
    #: first store poll is done when there is no signal server; the trainer's first commit waits for it
    listening: threading.Event = field(default_factory=threading.Event)
    #: set once the inference copy holds its first step (the initial weights): the trainer's first
    #: training step waits for it, so the first applied step is never behind a slow first sync
    ready: threading.Event = field(default_factory=threading.Event)
    #: the follower's copy equals the trainer's last weights bit for bit (None until compared)
    bit_exact: bool | None = None
    #: the trainer's last step and its bf16 weights, for the follower's comparison
    final: tuple[int, dict[str, Any]] | None = None
    #: the page's snapshot as the run ended (set before ``finished``): what the terminal summarizes
    result: dict[str, Any] | None = None

    def end(self) -> None:
        """Tell this run's threads to end, and release every wait of theirs."""
        self.stop.set()
        self.signal.close()
        self.listening.set()
        self.ready.set()


class DemoRun:
    """Owns the trainer and follower threads; ``start()`` then ``stop()``.

    runs: with ``--loop``, stop looping after this many training runs (None: until stopped).
    """

    def __init__(self, store: Store, options: DemoOptions, *, runs: int | None = None) -> None:
        import torch

        self.store = store
        self.options = options
        self.runs = runs
        self._torch = torch
        self.board = LiveBoard(
            {
                "mode": "self-contained" if options.train else "follower",
                "store": store.url,
                "prompt": PROMPT,
                "target": TARGET,
                "steps": options.steps if options.train else None,
                "model": None,
                "groups": [],
                "bit_exact": None,
                "episode": 0,
                # the signal server the follower listens to (None: in-process callbacks + store polling)
                "signal_server": None,
                # the anchor rules the page explains (null in follower mode: the trainer elsewhere decides)
                "uploader": {"anchor_every": options.anchor_every, "anchor_bytes_fraction": ANCHOR_BYTES_FRACTION}
                if options.train
                else None,
            }
        )
        # set by spaces_demo.app.connect_signal: where the trainer publishes its commits
        self.publish_url: str | None = None
        self.publish_token: str | None = None
        # set by spaces_demo.app.connect_signal (listen_to): the signal server the follower listens to
        self.listen_url: str | None = None
        self.listen_token: str | None = None
        self.listen_source: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: the current run's threads (trainer, follower) by name: each a future of its own worker
        self._threads: dict[str, Future[None]] = {}
        self._loop_stop = threading.Event()
        self._loop_thread: Future[None] | None = None
        self._ending = threading.Lock()
        self._on_run_end: list[Callable[[Episode], None]] = []
        #: the run in progress (or the last one); replaced as a whole by :meth:`restart`
        self.current = self._new_episode(0)
        self.board.set_info(signal=self._signal_source(self.current))

    @property
    def closed(self) -> bool:
        """True once :meth:`stop` ran."""
        return self._closed

    @property
    def episode(self) -> int:
        """The current run's number (0 for the first; ``--loop`` counts up)."""
        return self.current.number

    @property
    def finished(self) -> threading.Event:
        """The current run's ``finished`` event (read ``current`` once to pair it with its number)."""
        return self.current.finished

    @property
    def bit_exact(self) -> bool | None:
        """Whether the current run ended bit-exact (None until the follower compared)."""
        return self.current.bit_exact

    def on_run_end(self, fn: Callable[[Episode], None]) -> None:
        """Call ``fn(episode)`` once for every run that ends (compared bit for bit, or failed), with
        its ``result`` set, from the thread that ended it; register before :meth:`start`. Unlike a
        reader polling :attr:`current`, it cannot miss a run that the loop replaced quickly."""
        self._on_run_end.append(fn)

    def _end_run(self, ep: Episode) -> None:
        with self._ending:  # a failing trainer and the follower may both end the run
            if ep.finished.is_set():
                return
            ep.result = self.board.snapshot()
            ep.finished.set()
        for fn in self._on_run_end:
            try:
                fn(ep)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the run's threads
                log.exception("a run-end listener failed")

    def listen_to(self, url: str, token: str | None, source: str) -> None:
        """Make the follower listen to the signal server at ``url`` (SSE), described as ``source``."""
        self.listen_url, self.listen_token, self.listen_source = url, token, source
        self.board.set_info(signal=source, signal_server=url)

    def _signal_run(self, episode: int) -> str:
        return self.options.signal_run or f"demo-{episode}"

    @property
    def signal_run(self) -> str:
        """The run name at the signal server: given, or one per episode (a new run restarts at step 0)."""
        return self._signal_run(self.current.number)

    def _signal_source(self, ep: Episode) -> str:
        return self.listen_source or ep.signal.source

    def _new_episode(self, number: int) -> Episode:
        # in-process: the uploader's Future callbacks notify it (see _train); plus store polling
        signal = StepSignal()
        signal.source = "in-process uploader callbacks + store polling" if self.options.train else "store polling"
        return Episode(number, signal)

    # --------------------------------------------------------------- control

    def start(self) -> None:
        """Start the trainer (self-contained mode) and follower threads; once."""
        with self._lock:
            if self._threads or self._closed:
                raise RuntimeError("DemoRun already started")
            self._start_threads(self.current)
            if self.options.loop:
                self._loop_thread = run_in_background(self._loop, "demo-loop")

    def _start_threads(self, ep: Episode) -> None:
        self._threads = {}
        if self.options.train:
            self._threads["demo-trainer"] = run_in_background(self._guard(ep, lambda: self._train(ep)), "demo-trainer")
        self._threads["demo-follower"] = run_in_background(self._guard(ep, lambda: self._follow(ep)), "demo-follower")

    def _stop_threads(self, timeout: float) -> None:
        self.current.end()
        for t in self._threads.values():
            wait([t], timeout)

    def _join_stopped_threads(self, timeout: float) -> bool:
        """Wait until the stopped run's threads have ended (however long that takes on a busy
        machine: a thread of the old run must never write over the new run's page); False when
        the demo is being stopped meanwhile."""
        started = time.monotonic()
        warned = False
        for name, t in self._threads.items():
            while True:
                if wait([t], 0.25).done:
                    break
                if self._loop_stop.is_set():
                    return False
                if not warned and time.monotonic() - started > timeout:
                    log.warning("the last run's %s has not ended after %g s; still waiting for it", name, timeout)
                    warned = True
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every thread and end the pages' streams."""
        self._loop_stop.set()
        if self._loop_thread is not None:
            wait([self._loop_thread], timeout)
        with self._lock:
            self._closed = True
            self._stop_threads(timeout)
        self.board.close()

    def restart(self, timeout: float = 30.0) -> None:
        """Train again from a fresh model in an emptied store (``--loop``); pages get a new snapshot.

        The last run's threads end first; then the store is emptied, the page reset to the new
        run's number and the new :class:`Episode` published, before its threads start."""
        with self._lock:
            if self._closed:
                return
            self._stop_threads(0.0)
            if not self._join_stopped_threads(timeout):
                return  # stop() is under way
            prepare_demo_store(self.store)  # empties a store the demo created; refuses any other
            ep = self._new_episode(self.current.number + 1)
            # one step for the page: no snapshot shows the new run's number with the old run's state
            self.board.reset(episode=ep.number, signal=self._signal_source(ep))
            self.current = ep
            self._start_threads(ep)

    def _loop(self) -> None:
        while not self._loop_stop.is_set():
            ep = self.current
            if not ep.finished.wait(0.5):
                continue
            if self.runs is not None and ep.number + 1 >= self.runs:
                return
            if self._loop_stop.wait(self.options.loop):
                return
            try:
                self.restart()
            except Exception as exc:  # noqa: BLE001 - shown on the page; the loop stops
                log.exception("restarting the demo failed")
                self.board.set_error(f"restart failed: {type(exc).__name__}: {exc}")
                return

    def _guard(self, ep: Episode, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - shown on the page, the server keeps running
                log.exception("%s failed", threading.current_thread().name)
                self.board.set_error(f"{threading.current_thread().name}: {type(exc).__name__}: {exc}")
                self.board.set_status("failed")
                ep.listening.set()  # a failed follower keeps no trainer waiting
                ep.ready.set()
                self._end_run(ep)

        return run

    # --------------------------------------------------------------- trainer

    def _train(self, ep: Episode) -> None:
        opts = self.options
        trainer = ToyTrainer(opts.model, seed=opts.seed + ep.number, lr=opts.lr)
        model = trainer.model
        self.store.put(DEMO_KEY, json.dumps({"model": opts.model, "prompt": PROMPT}).encode())
        self.board.set_status("training")

        # the follower listens before the first commit, so the page shows how every step reaches it
        if not ep.listening.wait(LISTEN_WAIT_S):
            log.warning("the follower is not listening after %g s; training anyway (it polls the store)", LISTEN_WAIT_S)
        up = demo_uploader(
            self.store,
            opts.anchor_every,
            signal_url=self.publish_url,
            signal_token=self.publish_token,
            signal_run=self._signal_run(ep.number),
        )

        def on_commit(fut: Future[CommitInfo]) -> None:
            try:
                info = fut.result()
            except DeltaSyncError as exc:
                self.board.set_error(f"commit failed: {exc}")
                return
            if info.kind != "skipped":
                ep.signal.notify(info.step)
            # the store's head as it moves on (the follower finds it later): a staleness sample
            self.board.set_head(info.committed_step)
            self.board.trainer_update(committed=info.committed_step, last_kind=info.kind, signals=_signals(up))

        with up:
            last = up.last_committed_step
            first = 0 if last is None else last + 1
            loss_v: float | None = None
            for i in range(opts.steps + 1):
                if ep.stop.is_set():
                    break
                t0 = time.perf_counter()
                step = first + i
                if i:
                    loss_v = trainer.step()
                t1 = time.perf_counter()
                fut = up.push(model, step)
                push_ms = 1000 * (time.perf_counter() - t1)
                self.board.trainer_step(step, loss=loss_v, lr=opts.lr, train_ms=1000 * (t1 - t0), push_ms=push_ms)
                fut.add_done_callback(on_commit)
                # lockstep with the store (see wait_for_commit): the same run on every machine
                wait_for_commit(fut, ep.stop.is_set)
                if not i and not ep.ready.wait(READY_WAIT_S):
                    # the clock starts once the inference copy holds the initial weights
                    log.warning(
                        "the inference copy does not hold step %d after %g s; training anyway", step, READY_WAIT_S
                    )
                ep.stop.wait(max(0.0, opts.step_interval - (time.perf_counter() - t0)))
        # closed: the notifier sent what it had, so these counts are final
        self.board.trainer_update(done=True, signals=_signals(up))
        self._final_check(ep, model)

    def _final_check(self, ep: Episode, model: Any) -> None:
        """Hand the follower the trainer's last weights, to compare once it holds that step."""
        torch = self._torch
        last = self.board.trainer
        if last is not None and last.get("step") is not None:
            state = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
            ep.final = (int(last["step"]), state)
        ep.trainer_done.set()

    def _maybe_finish(self, ep: Episode, infer: Any, seen: int | None) -> None:
        if ep.finished.is_set() or not ep.trainer_done.is_set():
            return
        final = ep.final
        if final is None or infer is None or seen != final[0]:
            return
        torch = self._torch
        got = infer.state_dict()
        want = final[1]
        ep.bit_exact = sorted(got) == sorted(want) and all(
            torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
        )
        self.board.set_info(bit_exact=ep.bit_exact)
        self.board.set_status("done" if ep.bit_exact else "MISMATCH")
        self._end_run(ep)

    # -------------------------------------------------------------- follower

    def _follow(self, ep: Episode) -> None:
        opts = self.options
        fetcher = DeltaFetcher(self.store, verify=True)
        reader = fetcher.reader
        infer: Any = None
        toy: Any = None
        groups: list[tuple[str, list[str]]] = []
        seen: int | None = None
        last_tick = 0.0
        lost = 0  # signal streams that failed (the page's own server is not up yet at the first try)
        via = "store"  # how the newest step was found: announced by the signal server, or by a store poll
        if not opts.train:
            self.board.set_status("waiting for a trainer")

        def latest() -> int | None:
            try:
                return fetcher.latest_step()
            except DeltaSyncError as exc:  # an unreachable store: shown, and polled again
                log.warning("cannot list the store: %s", exc)
                self.board.set_error(f"{type(exc).__name__}: {exc}")
                return None

        watcher = StepWatcher(
            latest,
            signal_url=self.listen_url,
            token=self.listen_token,
            run=self._signal_run(ep.number),
            heartbeat=1.0,
            poll_interval=opts.poll_interval,
            # with a signal server its stream is the fast path; the store is checked now and then in
            # case a signal was lost (polling at poll_interval while the stream is up would find most
            # steps before their signal is read, and the page could not tell a working stream apart)
            store_check_interval=SIGNAL_STORE_CHECK_S if self.listen_url else opts.poll_interval,
            reconnect=RECONNECT,
            stop=ep.stop,
            # the uploader's Future callbacks (in-process) cut the pause between polls short
            wait=lambda seconds: ep.signal.wait(seen, seconds),
        )

        def observe(observed: StepSeen) -> None:
            nonlocal last_tick, lost, via
            if time.monotonic() - last_tick >= 1.0:
                self.board.tick()
                last_tick = time.monotonic()
            lost += observed.kind == "lost"
            if not ep.listening.is_set() and (
                self.listen_url is None or observed.kind in ("signal", "heartbeat") or lost >= LISTEN_LOST
            ):
                ep.listening.set()  # the first poll is done, the stream is up, or it keeps failing
            self._maybe_finish(ep, infer, seen)
            if observed.step is not None and (seen is None or observed.step > seen):
                via = "signal" if observed.kind == "signal" else "store"

        def catch_up(step: int) -> None:
            """Bring the inference copy to the newest committed step (``step`` or newer), and show it."""
            nonlocal infer, toy, groups, seen
            new = [s for s in fetcher.steps() if seen is None or s > seen]
            if not new:
                return
            if infer is None:
                toy, infer = self._inference_copy()
                groups = layer_groups(list(infer.state_dict()))
                full = sum(v.numel() * v.element_size() for v in infer.state_dict().values())
                params = sum(v.numel() for v in infer.state_dict().values())
                self.board.set_info(
                    model={
                        "name": toy.name,
                        "arch": "Qwen3ForCausalLM",
                        "params": params,
                        "full_bytes": full,
                        "layers": toy.config.num_hidden_layers,
                        "hidden": toy.config.hidden_size,
                    },
                    groups=[g for g, _ in groups],
                )
            self.board.set_head(new[-1], found=new)
            t0 = time.perf_counter()
            jumped = len(new) > STEP_THROUGH
            if jumped:
                # far behind: jump (the fetcher picks patches or the nearest anchor); the
                # skipped steps are on the timeline but were never held by this copy
                for s in new[-MAX_NEW_MANIFESTS:-1]:
                    self.board.committed({**manifest_row(reader.committed(s).manifest), "layers": None})
                new = new[-1:]
            for s in new:
                # the copy holds the store's previous committed step (unless it just jumped):
                # diffing its bits before and after gives this step's exact per-layer change
                before = bit_snapshot(infer) if seen is not None and not jumped else None
                fetcher.sync(infer, step=s)
                row = manifest_row(reader.committed(s).manifest)
                row["layers"] = None
                if before is not None:
                    row["layers"], row["observed_changed"] = layer_change(before, infer, groups)
                self.board.committed({**row, "held": True})
                seen = s
            target = new[-1]
            sync_ms = 1000 * (time.perf_counter() - t0)
            t1 = time.perf_counter()
            text = greedy(infer, toy.tokenizer)
            gen_ms = 1000 * (time.perf_counter() - t1)
            # the true path of these steps: announced by the signal server, or found by a store poll
            self.board.applied(
                target, sync_ms=sync_ms, gen_ms=gen_ms, text=text, verified=True, steps=len(new), via=via
            )
            self.board.set_error(None)
            ep.ready.set()
            if self.board.trainer is None or not self.board.trainer.get("done"):
                self.board.set_status("training" if opts.train else "following")

        def show_failure(attempt: Attempt) -> None:
            if attempt.error is not None:
                # a bad or unreachable step: the inference copy stays at its last good state
                log.warning("sync failed: %s", attempt.error)
                self.board.set_error(f"{type(attempt.error).__name__}: {attempt.error}")

        try:
            FollowLoop(watcher, catch_up, held=lambda: seen, observe=observe, report=show_failure).run()
        finally:
            ep.listening.set()  # a follower that ended (or failed) keeps no trainer waiting
            ep.ready.set()

    def _inference_copy(self) -> tuple[Any, Any]:
        torch = self._torch
        name = self.options.model
        try:
            meta = json.loads(self.store.get(DEMO_KEY))
            name = str(meta.get("model", name))
        except ObjectNotFound:
            pass
        except ValueError:
            log.warning("%s in %s is not valid JSON; using --model %s", DEMO_KEY, self.store.url, name)
        # a different seed than the trainer: everything it holds comes from the store
        return build_model(name, seed=self.options.seed + 1, dtype=torch.bfloat16)


def _signals(up: DeltaUploader) -> dict[str, int] | None:
    """What became of the uploader's commit signals (None without a signal server)."""
    n = up.notifier
    if n is None:
        return None
    return {"sent": n.sent, "refused": n.rejected, "failed": n.failed, "superseded": n.superseded}
