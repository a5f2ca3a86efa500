"""The serving layer's top floor stays easy to change (issue 46): measured on the source, not by eye.

In ``deltasync/serving/``, ``deltasync/integrations/`` and ``deltasync/fetcher/_follow.py``:
no class over 300 lines, no function over 80, no constructor over 8 parameters, at most 10
``dict[str, Any]`` in all, and no private attribute read on another object (``other._x``), except
the few vLLM and torch internals the adapters must reach, each listed below with why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deltasync"
AREA = [PACKAGE / "serving", PACKAGE / "integrations", PACKAGE / "fetcher" / "_follow.py"]

MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
MAX_INIT_PARAMS = 8
MAX_ANY_DICTS = 10

#: ``object._name`` reads outside the object's own class that cannot be avoided: other projects'
#: internals with no public equivalent (file name, the attribute read)
FOREIGN_INTERNALS = {
    ("scatter.py", "_schema"),  # torch's OpOverload schema (which arguments an op writes): no public accessor
}


def _files() -> list[Path]:
    out: list[Path] = []
    for root in AREA:
        out += [root] if root.is_file() else sorted(root.rglob("*.py"))
    return out


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(f, ast.parse(f.read_text(), str(f))) for f in _files()]


def _span(node: ast.AST) -> int:
    end = getattr(node, "end_lineno", None) or 0
    return end - getattr(node, "lineno", 0) + 1


def test_the_area_is_found() -> None:
    assert len(_files()) > 20


def test_no_class_is_over_300_lines() -> None:
    big = [
        f"{f.relative_to(PACKAGE)}:{n.lineno} {n.name} ({_span(n)} lines)"
        for f, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and _span(n) > MAX_CLASS_LINES
    ]
    assert not big, big


def test_no_function_is_over_80_lines() -> None:
    big = [
        f"{f.relative_to(PACKAGE)}:{n.lineno} {n.name} ({_span(n)} lines)"
        for f, tree in _trees()
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and _span(n) > MAX_FUNCTION_LINES
    ]
    assert not big, big


def test_no_constructor_takes_over_8_parameters() -> None:
    wide = []
    for f, tree in _trees():
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                a = n.args
                count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
                if count > MAX_INIT_PARAMS:
                    wide.append(f"{f.relative_to(PACKAGE)}:{n.lineno} ({count} parameters)")
    assert not wide, wide


def test_few_untyped_dicts() -> None:
    counts = {str(f.relative_to(PACKAGE)): len(re.findall(r"dict\[str, Any\]", f.read_text())) for f in _files()}
    found = {k: v for k, v in counts.items() if v}
    assert sum(found.values()) <= MAX_ANY_DICTS, found


def test_no_private_attribute_is_read_on_another_object() -> None:
    reach = []
    for f, tree in _trees():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            text = ast.unparse(n)
            if any(f.name == name and (text == attr or n.attr == attr) for name, attr in FOREIGN_INTERNALS):
                continue
            reach.append(f"{f.relative_to(PACKAGE)}:{n.lineno} {text}")
    assert not reach, reach


def test_no_decision_on_an_error_text() -> None:
    """``"..." in str(exc)`` and the like: errors are told apart by class (deltasync.errors), never by text."""
    pattern = re.compile(r"""["'][^"']+["']\s+in\s+(str\((exc|e|err|error)\)|(exc|e|err)\.message)""")
    found = [
        f"{f.relative_to(PACKAGE)}:{i}"
        for f in _files()
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
