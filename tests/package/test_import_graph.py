"""The package's import graph, read from the source with ``ast``: no import circles, and the
dependency direction of the design (``protocol <- storage <- run <- signal <- uploader/fetcher <-
serving <- integrations/cli``; ``server`` beside uploader/fetcher), no package reading another's
private modules, and vLLM imported by its adapter only.

Every ``deltasync`` import counts: module level, function level and ``if TYPE_CHECKING:`` ones.
``from deltasync.x import y`` is an edge to ``deltasync.x.y`` when ``y`` is a submodule, else to
``deltasync.x``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import deltasync

ROOT = Path(deltasync.__file__).resolve().parent
Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    """``deltasync/fetcher/_lease.py`` -> ``deltasync.fetcher._lease``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    """The deltasync modules one import statement of ``module`` imports."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        yield sub if sub in modules else source


@cache
def import_graph() -> Graph:
    """Module -> the deltasync modules it imports (itself left out)."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    modules = set(files)
    graph: Graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, name, path.name == "__init__.py", modules):
                    if target.split(".")[0] == "deltasync" and target != name:
                        assert target in modules, f"{name} imports {target}, which is not a module of deltasync"
                        deps.add(target)
        graph[name] = deps
    return graph


def strongly_connected(graph: Graph) -> list[set[str]]:
    """Every strongly connected component of more than one module (Tarjan): each holds a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:  # the graph is small (~150 modules): recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=min)


def closed_path(graph: Graph, component: set[str]) -> list[str]:
    """One circle through the first module of ``component`` (``[a, b, ..., a]``), by breadth-first search."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                chain = [v]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [*reversed(chain), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start}")


def cycles(graph: Graph) -> list[list[str]]:
    """One printed circle per strongly connected component."""
    return [closed_path(graph, c) for c in strongly_connected(graph)]


def area(module: str) -> str:
    """The top-level part of deltasync a module belongs to (``deltasync.fetcher._lease`` -> ``fetcher``);
    each module of the shared private machinery is its own (``deltasync._util.retry`` -> ``_util.retry``)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "_util":
        return f"_util.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def area_imports(src: str) -> dict[str, set[str]]:
    """Area -> {module of ``src`` -> the modules of that area it imports}, for the areas ``src`` imports."""
    out: dict[str, dict[str, set[str]]] = {}
    for module, deps in import_graph().items():
        if area(module) != src:
            continue
        for dep in deps:
            if area(dep) != src:
                out.setdefault(area(dep), {}).setdefault(module, set()).add(dep)
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the graph itself


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "deltasync.protocol" in graph and "deltasync.cli.main" in graph
    assert "deltasync.errors" in graph["deltasync.protocol.manifest"]
    # ``from deltasync.run import reader`` style imports resolve to the submodule
    assert all(dep in graph for deps in graph.values() for dep in deps)


def test_cycles_are_found_and_printed() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_a_submodule_import_is_an_edge_to_the_submodule(tmp_path: Path) -> None:
    modules = {"deltasync.run", "deltasync.run.reader", "deltasync.fetcher._fetcher"}
    node = ast.parse("from deltasync.run import reader, RunReader").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert list(imported(node, "deltasync.fetcher._fetcher", False, modules)) == [
        "deltasync.run.reader",
        "deltasync.run",
    ]
    rel = ast.parse("from ..run import reader").body[0]
    assert isinstance(rel, ast.ImportFrom)
    assert list(imported(rel, "deltasync.fetcher._fetcher", False, modules)) == ["deltasync.run.reader"]
    pkg = ast.parse("from . import _fetcher").body[0]
    assert isinstance(pkg, ast.ImportFrom)
    assert list(imported(pkg, "deltasync.fetcher", True, modules | {"deltasync.fetcher"})) == [
        "deltasync.fetcher._fetcher"
    ]


# ------------------------------------------------------------------------------ no import circles


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


# ------------------------------------------------------------------------------ dependency direction


def _offending(src: str, forbidden: set[str]) -> dict[str, dict[str, set[str]]]:
    return {a: mods for a, mods in area_imports(src).items() if a in forbidden}


OURS = {"__init__", "protocol", "storage", "run", "signal", "uploader", "fetcher", "server", "cli", "integrations"}
OURS |= {"serving"}
OURS |= {"testing", "errors", "_util", "_util.tensors", "_util.checkpoint_io"}
#: the shared private machinery any layer may use (it imports nothing of ours but errors)
MACHINERY = {"_util.worker", "_util.retry", "_util.prometheus", "_util.settings", "_util.cpus", "_util.batches"}
MACHINERY |= {"_util.gcpause", "_util.text"}
OURS |= MACHINERY


def test_every_area_is_named_above() -> None:
    """A new top-level module or package must say where it sits in the direction."""
    assert {area(m) for m in import_graph()} <= OURS


def test_protocol_imports_nothing_of_ours_but_errors() -> None:
    assert _offending("protocol", OURS - {"errors"}) == {}


def test_storage_imports_only_protocol_errors_and_the_shared_machinery() -> None:
    assert _offending("storage", OURS - {"protocol", "errors"} - MACHINERY) == {}


@pytest.mark.parametrize("module", sorted(MACHINERY))
def test_the_shared_machinery_imports_nothing_of_ours_but_errors(module: str) -> None:
    assert _offending(module, OURS - {"errors"}) == {}


@pytest.mark.parametrize("module", ["_util.tensors", "_util.checkpoint_io"])
def test_the_torch_helpers_import_only_protocol_errors_and_the_machinery(module: str) -> None:
    assert _offending(module, OURS - {"protocol", "errors", "_util.tensors"} - MACHINERY) == {}


def test_run_imports_no_higher_layer() -> None:
    assert _offending("run", {"uploader", "fetcher", "signal", "server", "cli", "integrations", "serving"}) == {}


def test_serving_imports_no_higher_layer_and_no_trainer_side() -> None:
    """The receiving side rests on the fetcher and the signal client, never on an engine adapter, the
    CLI, the server or the uploader."""
    assert _offending("serving", {"cli", "integrations", "server", "uploader"}) == {}
    assert "fetcher" in area_imports("serving")


def test_only_serving_s_importers_are_integrations_and_cli() -> None:
    importers = {a for a in OURS - {"serving", "integrations", "cli"} if "serving" in area_imports(a)}
    assert importers == set()


def _third_party(module: str) -> set[str]:
    """The top-level names of what ``module`` imports outside deltasync (any import statement)."""
    path = ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():
        path = ROOT.parent.joinpath(*module.split("."), "__init__.py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_only_the_vllm_adapter_imports_vllm() -> None:
    importers = sorted(m for m in import_graph() if "vllm" in _third_party(m))
    assert importers, "the adapter imports vllm: the scan must see it"
    assert all(m.startswith("deltasync.integrations.vllm.") for m in importers), importers


def test_the_vllm_adapter_is_thin() -> None:
    """``integrations/vllm`` holds what imports vLLM (backend, engine-core hook, engine check) and the
    old name of the driver; the engine-independent machinery lives in ``serving``."""
    folder = ROOT / "integrations" / "vllm"
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in folder.glob("*.py"))
    assert lines <= 1000, f"integrations/vllm has {lines} lines: move what does not need vLLM to deltasync/serving"


def _private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[2:])


def test_no_package_imports_another_package_s_private_modules() -> None:
    found = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph().items()
        for d in deps
        if area(d) != area(m) and _private(d) and not area(d).startswith("_")
    )
    assert found == [], "import the package's public names instead:\n" + "\n".join(found)


def test_uploader_and_fetcher_never_import_each_other() -> None:
    assert _offending("uploader", {"fetcher"}) == {}
    assert _offending("fetcher", {"uploader"}) == {}


@pytest.mark.parametrize(("top", "allowed"), [("cli", set()), ("integrations", {"cli"})])
def test_nothing_imports_cli_or_integrations(top: str, allowed: set[str]) -> None:
    """The top layers: nothing imports them (the CLI may drive integrations)."""
    importers = {a: mods for a in OURS - {top} - allowed for a2, mods in area_imports(a).items() if a2 == top}
    assert importers == {}


def test_server_never_imports_uploader_or_fetcher() -> None:
    assert _offending("server", {"uploader", "fetcher"}) == {}


def test_protocol_starts_no_threads() -> None:
    """The wire format is pure: no pools or threads (the fetcher decodes in parallel through
    ``decode_patch(..., mapper=pool.map)``); a lock or a thread-local is not a thread."""
    pooled = sorted(m for m in import_graph() if area(m) == "protocol" and "concurrent" in _third_party(m))
    assert pooled == []
    for module in import_graph():
        if area(module) == "protocol":
            path = ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")
            text = path.read_text(encoding="utf-8") if path.exists() else ""
            assert "Thread(" not in text, module


#: where the package reads its environment: the entry points, and the one settings module
ENV_READERS = {
    "deltasync._util.settings",  # DELTASYNC_HF_ENDPOINT / HF_ENDPOINT
    "deltasync.protocol.kernels",  # DELTASYNC_KERNELS, at the codec's first use (see kernels.ENV)
    "deltasync.server._settings",  # Settings.from_env: the server's tokens
    "deltasync.storage._s3",  # S3Store(environ=...): the AWS_* defaults, as obstore reads them
    "deltasync.integrations.vllm.extension",  # a vLLM worker's deltasync state: DELTASYNC_NODE_DIR
    "deltasync.serving.node._link",  # hands its environment on to the leader process it starts
    "deltasync.testing.seaweedfs",  # the test server's PATH
}


def test_the_environment_is_read_at_the_edges_only() -> None:
    """``os.environ`` / ``os.getenv`` appear only in the CLI and the modules named above."""
    found = set()
    for module in import_graph():
        if area(module) == "cli":
            continue
        path = ROOT.parent.joinpath(*module.split(".")).with_suffix(".py")
        if not path.exists():
            path = ROOT.parent.joinpath(*module.split("."), "__init__.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                found.add(module)
    assert "deltasync._util.settings" in found and found <= ENV_READERS, sorted(found - ENV_READERS)
