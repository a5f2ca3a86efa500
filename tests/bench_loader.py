"""Loads a script of ``benchmarks/`` as a module, for the smoke tests of the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_bench(name: str, *, imports: tuple[str, ...] = ()) -> Iterator[Any]:
    """Import ``benchmarks/<name>.py`` as module ``name`` for a test module's life (a fixture body).

    ``imports``: the other ``benchmarks/`` scripts it loads under their own names (``bench_payload``),
    taken out of ``sys.modules`` with it.
    """
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        for loaded in (name, *imports):
            sys.modules.pop(loaded, None)
