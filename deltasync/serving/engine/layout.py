"""What an engine takes of a version's layout: checked once per layout, its tied names, its scatter loader.

An :class:`~deltasync.serving.engine.mirror.EngineMirror` asks its :class:`LayoutGate` before the
engine is touched by a layout it has not seen: the engine's ``check`` refuses a layout it cannot take
in place (:class:`EngineIncompatible`) and names the names it ties to another (one parameter for both:
tied embeddings); the ``scatter`` factory gives the loader of only the changed elements for that layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltasync.errors import EngineIncompatible
from deltasync.protocol import TensorChange

if TYPE_CHECKING:
    import torch

__all__ = ["Check", "Layout", "LayoutGate", "Loader", "Scatter", "ScatterFor", "View", "same_bits"]

log = logging.getLogger("deltasync.mirror")

#: checkpoint name -> (torch dtype, shape)
Layout = Mapping[str, tuple[Any, tuple[int, ...]]]
#: a version's tensors by checkpoint name, mapped from the node mirror
View = dict[str, "torch.Tensor"]
#: the engine's loader: takes ``(checkpoint name, host tensor)`` pairs and copies them into the live weights
Loader = Callable[[Iterable[tuple[str, Any]]], Any]
#: checks, before anything is loaded, that the engine takes tensors of this layout in place; raises
#: :class:`EngineIncompatible` when it does not. Returns the names the engine ties to another name of
#: the layout (name -> that name; tied embeddings), or None
Check = Callable[[Layout], Mapping[str, str] | None]
#: writes what changed into the engine, in the pause: takes the changes (one per changed name, positions
#: None where not known: the whole tensor) and the new tensors by name (``scatter.ScatterLoader``)
Scatter = Callable[[Sequence[TensorChange], Mapping[str, Any]], Any]
#: the :data:`Scatter` of a layout (its tied names left out)
ScatterFor = Callable[[Layout], Scatter]


class LayoutGate:
    """The engine's answer to the layouts of the versions it is to serve (asked once per layout).

    check: see :data:`Check` (None: every layout is taken, nothing is tied).
    scatter_for: see :data:`ScatterFor` (None, or when it fails for a layout: whole tensors go to the loader).
    """

    def __init__(self, check: Check | None = None, scatter_for: ScatterFor | None = None) -> None:
        self.check_layout = check
        self.scatter_for = scatter_for
        #: names the engine ties to another name (one parameter): never loaded, equal to it in every version
        self.tied: dict[str, str] = {}
        #: the scatter loader of the layout checked last (None: whole tensors go to the loader)
        self.scatter: Scatter | None = None
        self._checked: dict[str, tuple[Any, tuple[int, ...]]] | None = None

    def check(self, layout: Layout) -> None:
        """Ask the engine about ``layout`` unless it is the one checked last; raises its refusal."""
        if layout == self._checked:
            return
        tied = self.check_layout(layout) if self.check_layout is not None else None
        self.tied = dict(tied or {})
        self._checked = dict(layout)
        self.scatter = None
        if self.scatter_for is not None:
            try:
                self.scatter = self.scatter_for({n: s for n, s in layout.items() if n not in self.tied})
            except Exception as exc:  # noqa: BLE001 - the engine's own loader still works
                log.warning(
                    "cannot write changed elements in place (%s: %s): loading whole tensors", type(exc).__name__, exc
                )

    def check_tied(self, step: int | None, view: Mapping[str, Any], serving: int | None) -> None:
        """A version whose tied names do not hold the same bits cannot be served (the engine holds one
        parameter for both): refused while preparing, before the engine is touched."""
        for name, target in self.tied.items():
            a, b = view.get(name), view.get(target)
            if a is not None and b is not None and not same_bits(a, b):
                raise EngineIncompatible(
                    f"step {step} of the run holds different values in {name} and {target}, which this engine "
                    "ties (one parameter for both: tie_word_embeddings in the model's config), so it cannot serve "
                    "that step bit-exact; start the engine with the trainer's config (tie_word_embeddings: false "
                    f"when the trainer trains them apart). The engine still serves step {serving}"
                )

    def loaded(self, names: Iterable[str]) -> list[str]:
        """The names of ``names`` the engine loads (a tied name is loaded through the name it is tied to)."""
        return [n for n in names if n not in self.tied]


def same_bits(a: Any, b: Any) -> bool:
    """Whether two host tensors hold the same bits (NaN payloads and signed zeros included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))
