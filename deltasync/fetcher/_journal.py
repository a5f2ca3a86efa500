"""A journal to undo one sync after the fact.

A live engine applies a step in two moves: the fetcher brings a host mirror to the
step (in the background), then the engine loads the tensors that changed. When the
engine refuses them, the mirror must go back to the step the engine still serves:
:class:`SyncJournal` keeps the old bits of every element the sync wrote. It also says what the
sync applied to each tensor (:attr:`SyncJournal.changes`), so that nothing downstream recomputes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from deltasync.fetcher._apply import Undo, alias_groups
from deltasync.fetcher._stats import SyncStats
from deltasync.fetcher._target import TargetTensor
from deltasync.protocol import TensorChange

__all__ = ["SyncJournal"]


class SyncJournal:
    """Pass one to :meth:`DeltaFetcher.sync` to be able to undo that sync later.

    After the sync, ``names`` are the tensors whose bits it wrote (tied names included), ``step``
    the step reached, ``base_step`` the step the target held before (None when unknown) and
    ``stats`` its :class:`SyncStats`, and ``changes`` what it applied: for each of ``names``, one
    :class:`~deltasync.protocol.TensorChange` with the flat positions written (sorted, unique; folded
    across the steps of the plan; every element whose bits changed is among them), or ``positions``
    None where the sync wrote the whole tensor (an anchor load: which elements differ is not known
    without comparing; a caller that needs them compares those tensors only). Values are left in the
    target (``values`` None).
    :meth:`rollback` restores the old bits and the fetcher's record of what the target holds. Roll
    back journals newest first; a journal rolls back once.
    """

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.step: int | None = None
        self.base_step: int | None = None
        #: timings and bytes of the sync (set when it returns)
        self.stats: SyncStats | None = None
        #: what the sync applied, by tensor name (see the class docstring)
        self.changes: Mapping[str, TensorChange] = MappingProxyType({})
        self._undo = Undo()
        self._restore: Callable[[], None] | None = None

    def record(
        self,
        undo: Undo,
        tensors: Mapping[str, TargetTensor],
        step: int,
        base_step: int | None,
        stats: SyncStats,
        restore: Callable[[], None],
        *,
        changes: Mapping[str, TensorChange] | None = None,
    ) -> None:
        """Called by the sync that used this journal: take over its undo log (``undo`` is emptied);
        ``restore`` puts the fetcher's record of the target back after a :meth:`rollback`;
        ``changes``: what it applied, by name (whole tensors where not given)."""
        self._undo.extend(undo)
        written = self._undo.names
        self.names = tuple(sorted(n for n, primary in alias_groups(tensors).items() if primary in written))
        given = changes or {}
        self.changes = MappingProxyType({n: given.get(n) or TensorChange(n) for n in self.names})
        self.step, self.base_step, self.stats, self._restore = step, base_step, stats, restore

    def rollback(self) -> None:
        """Put every element the sync wrote back as it was."""
        self._undo.rollback()
        if self._restore is not None:
            self._restore()
            self._restore = None
        self.names = ()
        self.changes = MappingProxyType({})
