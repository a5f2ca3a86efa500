"""The options of :class:`~deltasync.serving.driver.VLLMDriver`, grouped: how it updates servers
(:class:`DriverOptions`) and where it reports them (:class:`FleetReporting`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deltasync._util.retry import RetryPolicy
from deltasync.serving.vllm_server import PAUSE_MODES, PROBE_TIMEOUT, PauseMode

__all__ = ["REFUSAL_BACKOFF", "DriverOptions", "FleetReporting"]

#: the backoff before a server tries a step it refused again: 2 s, doubled at each refusal, at most 60 s
REFUSAL_BACKOFF = RetryPolicy(retries=0, backoff=2.0, max_backoff=60.0)


@dataclass(frozen=True, slots=True)
class DriverOptions:
    """How a driver updates its servers.

    pause_mode: ``wait`` (default), ``abort`` or ``keep`` (see :mod:`deltasync.serving.vllm_server`).
    timeout: seconds of each call of an update (sized for one: the pause waits for in-flight requests,
        the prepare and ``update_weights`` download a step). probe_timeout: seconds of the quick calls
        (``/weight_info``, ``/is_paused``, ``/resume``); a server that does not answer one is
        ``unreachable``. api_key: vLLM's ``--api-key``, if set.
    prefetch: each server's workers prepare new steps in the background (``init``). prepare: have each
        server prepare a step before pausing for it (:meth:`VLLMServer.update`).
    all_or_nothing: roll each step out to every server or to none (:class:`~deltasync.serving.rollout.AllOrNothing`).
    retry: the backoff before a refused step is tried again on that server (a newer step is tried at once).
    """

    pause_mode: PauseMode = "wait"
    timeout: float = 600.0
    probe_timeout: float = PROBE_TIMEOUT
    api_key: str | None = None
    prefetch: bool = True
    prepare: bool = True
    all_or_nothing: bool = False
    retry: RetryPolicy = REFUSAL_BACKOFF

    def __post_init__(self) -> None:
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        for name in ("timeout", "probe_timeout"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class FleetReporting:
    """Report each server to the fleet view of ``run`` at the signal server ``signal`` (docs/fleet.md).

    token: a report, subscribe or publish token. replicas: the replica name of each server, in the
    order the servers are given (default: the server URL's ``host:port``). heartbeat: seconds between
    two reports of an unchanged server. digest: the manifest digest of a step (the fleet view checks it
    against the trainer's), when known.
    """

    signal: str
    run: str
    token: str | None = None
    replicas: Sequence[str] | None = None
    heartbeat: float = 10.0
    digest: Callable[[int], str | None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.signal or not self.run:
            raise ValueError("FleetReporting needs the signal server's URL and the run's name there")
        if not (self.heartbeat > 0 and math.isfinite(self.heartbeat)):
            raise ValueError(f"heartbeat must be a finite number of seconds > 0, got {self.heartbeat!r}")
