"""What an engine worker's mirror records: :class:`MirrorMetrics`, and :class:`NoMetrics` when nothing does.

:class:`~deltasync.serving.engine.mirror.EngineMirror` (its prepares, commits and undos) and the
parameter audit (:mod:`~deltasync.serving.engine.params_audit`) record through this protocol only;
:class:`deltasync.fetcher.metrics.SyncMetrics` implements it (a vLLM worker's ``/metrics``). A
recorder has every method: nothing probes for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from deltasync.fetcher import SyncStats

__all__ = ["MirrorMetrics", "NoMetrics"]


class MirrorMetrics(Protocol):
    """The recorder of an engine mirror (:class:`deltasync.fetcher.metrics.SyncMetrics` is one)."""

    def observe_sync(self, stats: SyncStats, *, pause_s: float | None = None) -> None:
        """A step the engine serves now, with the stats of the sync that built it and the pause."""

    def observe_applied(self, step: int, *, seconds: float | None = None) -> None:
        """A step the engine serves now, built by another worker's request (no sync stats of its own)."""

    def observe_pause(self, seconds: float) -> None:
        """The engine's pause of an update whose sync another worker made."""

    def observe_failure(self, kind: str) -> None:
        """A failure of ``kind``: ``prepare`` (getting the version) or ``load`` (the engine refused it)."""

    def observe_node(self, *, nbytes: int, built: bool, pinned: int | None = None) -> None:
        """The node mirror after a prepare or a commit: its bytes on disk, whether this worker's
        request built the version, and the bytes registered with CUDA (None: no pinning)."""

    def observe_prepare(self, seconds: float, *, starved: bool = False) -> None:
        """A prepare that worked: its latency from when the step was first heard of, and whether it starved."""

    def observe_update(self, *, prepared: bool, pause_s: float) -> None:
        """A commit: whether its step was prepared before it, and the engine's pause."""

    def observe_load(self, *, loaded: int, scattered: int = 0, elements: int = 0) -> None:
        """What a commit's pause wrote: tensors loaded whole, tensors scattered and their elements."""

    def observe_param_audit(self, *, ok: int, mismatched: int) -> None:
        """A chunk of the parameter audit: tensors that hash to the step's digests, and those that do not."""


class NoMetrics:
    """A :class:`MirrorMetrics` that records nothing: the mirror's default."""

    def observe_sync(self, stats: SyncStats, *, pause_s: float | None = None) -> None:
        """Nothing recorded."""

    def observe_applied(self, step: int, *, seconds: float | None = None) -> None:
        """Nothing recorded."""

    def observe_pause(self, seconds: float) -> None:
        """Nothing recorded."""

    def observe_failure(self, kind: str) -> None:
        """Nothing recorded."""

    def observe_node(self, *, nbytes: int, built: bool, pinned: int | None = None) -> None:
        """Nothing recorded."""

    def observe_prepare(self, seconds: float, *, starved: bool = False) -> None:
        """Nothing recorded."""

    def observe_update(self, *, prepared: bool, pause_s: float) -> None:
        """Nothing recorded."""

    def observe_load(self, *, loaded: int, scattered: int = 0, elements: int = 0) -> None:
        """Nothing recorded."""

    def observe_param_audit(self, *, ok: int, mismatched: int) -> None:
        """Nothing recorded."""
