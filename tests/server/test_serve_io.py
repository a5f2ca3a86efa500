"""``deltasync serve`` runs uvicorn on httptools and uvloop where they are installed (the ``server``
extra), else on h11 and asyncio: a missing one is a fallback, never a failure."""

from __future__ import annotations

import sys

import pytest

from deltasync.cli.serve import _io_stack


def test_httptools_and_uvloop_where_installed_else_h11_and_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("httptools")
    if sys.platform != "win32":
        pytest.importorskip("uvloop")
        assert _io_stack() == ("httptools", "uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it raises ImportError
    assert _io_stack() == ("httptools", "asyncio")
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert _io_stack() == ("h11", "asyncio")
