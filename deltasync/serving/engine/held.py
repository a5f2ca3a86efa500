"""The node versions one engine worker holds mapped: the one its engine serves and the one prepared next.

Each is a :class:`~deltasync.serving.node.versions.Version` of the node mirror and its tensors by
checkpoint name, mapped (a mapping keeps a version's data alive after the node collects it: the served
one is what an undo reloads). :meth:`HeldVersions.fetch` gets the next one from the node (built there
if the node has none), checked against what the engine takes (:class:`~.layout.LayoutGate`) and paged
in, all before any pause. With :class:`~deltasync.serving.engine.pinning.HostPins` (a CUDA engine),
the mapped tensors are registered with CUDA while they are held (in the prepare, never in the pause).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deltasync.fetcher import SyncStats
from deltasync.serving.engine.layout import LayoutGate, View
from deltasync.serving.engine.mirror_metrics import MirrorMetrics
from deltasync.serving.engine.pinning import HostPins
from deltasync.serving.engine.prepare_log import BuildWork
from deltasync.serving.node.mirror import NodeMirror
from deltasync.serving.node.versions import Version, populate

__all__ = ["HeldVersions"]

#: the tensors an engine loaded at start, by checkpoint name, or a callable returning them
Seed = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


class HeldVersions:
    """The served and the prepared version of one worker, with their mapped tensors (and pins).

    node: the node's mirror the versions come from. gate: checks each version's layout and tied
    names. pin: registers the mapped tensors with CUDA (None: no pinning). metrics, clock: the
    mirror's (``observe_node`` after each fetch and, pinned, each promotion).
    """

    def __init__(
        self,
        node: NodeMirror,
        gate: LayoutGate,
        pin: HostPins | None,
        *,
        metrics: MirrorMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.node = node
        self.gate = gate
        self.pin = pin
        self.metrics = metrics
        self.clock = clock
        #: the version the engine holds exactly (None: unknown, the first commit loads every tensor)
        self.served: Version | None = None
        #: its tensors, mapped: keeps them alive for an undo
        self.served_view: View = {}
        #: the version prepared ahead of the served one (None: none)
        self.prepared: Version | None = None
        self.prepared_view: View = {}
        #: the stats of the sync that built the prepared version, when this worker's request built it
        self.built_stats: SyncStats | None = None
        #: what the last :meth:`fetch` spent
        self.work = BuildWork()

    @property
    def pinned(self) -> bool:
        """Whether views are registered with CUDA: then they are mapped shared and write-protected
        (registered 6.8x faster than copy-on-write mappings; a loader's write would fault)."""
        return self.pin is not None and self.pin.enabled

    @property
    def pinned_bytes(self) -> int | None:
        """The bytes registered with CUDA (None: no pinning)."""
        return None if self.pin is None else self.pin.nbytes

    def seed(self, seed: Seed, step: int | None, seed_id: str | None) -> None:
        """The engine serves the tensors it loaded at start (``step``, when known): held as the served
        version (the node's version of that step if it has one, else one made of the seed)."""
        get = lambda: self.node.seed(seed, step, seed_id=seed_id, check=self.gate.check)  # noqa: E731
        version, view = self.node.mapped(get, read_only=self.pinned)
        self._hold(view)
        self.served, self.served_view = version, view

    def fetch(self, step: int, serving: int | None) -> Version:
        """The node's version of ``step``, built if the node has none, checked and paged in: held as the
        prepared one (``serving``: the step the engine serves, for a refusal's message)."""
        reuse = {} if self.served is None else self.served.by_file(self.served_view)
        if self.prepared is not None:
            reuse.update(self.prepared.by_file(self.prepared_view))
        t0 = self.clock()
        version, view = self.node.mapped(lambda: self.node.ensure(step), reuse=reuse, read_only=self.pinned)
        got = self.clock() - t0
        built = next((b for b in self.node.built if b.id == version.id), None)
        if built is not None:  # this worker's leader read the store for it: its sync is this worker's to report
            self.node.built.remove(built)
        self.built_stats = _stats(built) if built is not None else None
        self.gate.check(version.layout())
        self.gate.check_tied(version.step, view, serving)
        mapped_before = {id(t) for t in reuse.values()}
        populate(t for t in view.values() if id(t) not in mapped_before)  # page faults here, not in the pause
        self._hold(view)
        self._release(self.prepared_view)
        work = None if built is None else built.stats.get("cpu_s", built.stats.get("seconds"))
        self.work = BuildWork(got, None if work is None else float(work), self.clock() - t0)
        nbytes = self.node.versions.nbytes_on_disk()
        self.metrics.observe_node(nbytes=nbytes, built=built is not None, pinned=self.pinned_bytes)
        self.prepared, self.prepared_view = version, view
        return version

    def promote(self) -> None:
        """The engine serves the prepared version now: the served one is let go."""
        self._release(self.served_view)  # the prepared view's hold passes to the served one
        if self.pin is not None:
            nbytes = self.node.versions.nbytes_on_disk()
            self.metrics.observe_node(nbytes=nbytes, built=False, pinned=self.pin.nbytes)
        self.served, self.served_view = self.prepared, self.prepared_view
        self.prepared, self.prepared_view = None, {}
        self.built_stats = None

    def drop_prepared(self) -> None:
        """The prepared version is let go (an undo: the engine goes back to the served one)."""
        self._release(self.prepared_view)
        self.prepared, self.prepared_view = None, {}

    def close(self) -> None:
        """Unregister every pin."""
        if self.pin is not None:
            self.pin.close()

    def _hold(self, view: Mapping[str, Any]) -> None:
        if self.pin is not None:
            self.pin.hold(view.values())

    def _release(self, view: Mapping[str, Any]) -> None:
        if self.pin is not None:
            self.pin.release(view.values())


def _stats(version: Version) -> SyncStats:
    """The :class:`SyncStats` of the sync that built a version (this process's leader's)."""
    fields = dict(version.stats.get("sync") or {})
    fields.setdefault("step", version.step if version.step is not None else -1)
    return SyncStats(**fields)
