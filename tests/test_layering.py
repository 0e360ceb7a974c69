"""The package layering, read from the source's import statements (nothing is imported):

    hicache.integrations                   engine adapters (vLLM's connector): nothing imports them
    hicache.daemon                         the daemon: server, service, sessions, CLI, demo
        |
    hicache (top package), hicache.engine  core, client library, engine-side helpers
    hicache.storage                        storage backends
        |
    hicache.kernels                        Triton kernels and their torch references
        |
    hicache.errors

An import of a lower layer from a higher one is fine; the other way round is not. Every
import counts for the layers (one inside a function too: it is still a dependency);
the cycle check follows the imports a module runs when it is imported (module level,
``if TYPE_CHECKING:`` blocks left out).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


@cache
def modules() -> dict[str, Path]:
    """Every module of the distribution by dotted name, from pyproject.toml's package
    list and package-dir mapping (``hicache.daemon`` lives in ``daemon/``)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for package in setuptools["packages"]:
        directory = ROOT / setuptools["package-dir"].get(package, package.replace(".", "/"))
        for path in sorted(directory.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, name: str, path: Path) -> list[str]:
    """The hicache modules one import statement imports."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = _package_of(name, path).split(".")
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        candidates = []
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            candidates.append(submodule if submodule in modules() else base)
    out = []
    for candidate in candidates:
        while candidate and candidate not in modules():  # `import hicache.x.y` where y is a name
            candidate = candidate.rpartition(".")[0]
        if candidate:
            out.append(candidate)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]):
    """The import statements run when the module is imported (into if / try blocks,
    not into functions, classes or ``if TYPE_CHECKING:``)."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _module_level(block)


@cache
def imports(*, everywhere: bool) -> dict[str, set[str]]:
    """Module -> the hicache modules it imports (``everywhere``: in any scope; else at
    import time only)."""
    graph = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        statements = (
            [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if everywhere
            else list(_module_level(tree.body))
        )
        graph[name] = {t for stmt in statements for t in _targets(stmt, name, path) if t != name}
    return graph


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_distribution_is_what_the_checks_walk():
    names = set(modules())
    assert {"hicache.client", "hicache.protocol", "hicache.daemon.service", "hicache.kernels.page_copy",
            "hicache.storage.lmdb_backend", "hicache.engine.reference"} <= names
    assert imports(everywhere=False)["hicache.daemon.service"] >= {"hicache.protocol", "hicache.daemon.sessions"}


def test_nothing_imports_the_engine_integrations():
    """An integration imports its engine (vLLM): nothing else may import it, or hicache
    would need that engine installed."""
    graph = imports(everywhere=True)
    assert "hicache.integrations.vllm" in graph
    users = {name for name, targets in graph.items() if any(_in(t, "hicache.integrations") for t in targets)}
    assert {u for u in users if not _in(u, "hicache.integrations")} == set()


def test_every_package_is_in_the_distribution():
    """A subpackage missing from pyproject.toml's list works from a checkout and is
    missing from a wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {package: ROOT / setuptools["package-dir"].get(package, package.replace(".", "/"))
             for package in setuptools["packages"]}
    listed = {path.resolve() for path in roots.values()}
    found = {init.parent.resolve() for root in roots.values() for init in root.rglob("__init__.py")}
    assert found <= listed, sorted(str(path) for path in found - listed)


_TRITON_KERNELS = ("hicache.kernels.page_copy", "hicache.kernels.kv_indices", "hicache.kernels.slot_alloc")


def test_copy_plans_and_the_tier_manager_do_not_import_triton():
    """Pools and the tier manager build copy plans (hicache.kernels.copy_plan); only
    the movers that run copies import a Triton module."""
    planners = [name for name in modules()
                if name in ("hicache.pools", "hicache.kernels.copy_plan") or _in(name, "hicache.tiers")]
    assert "hicache.tiers.manager" in planners
    wrong = sorted(f"{name} imports {target}" for name in planners
                   for target in imports(everywhere=True)[name] if target in _TRITON_KERNELS)
    for name in planners:
        tree = ast.parse(modules()[name].read_text())
        for stmt in ast.walk(tree):
            if isinstance(stmt, ast.Import) and any(a.name.split(".")[0] == "triton" for a in stmt.names):
                wrong.append(f"{name} imports triton")
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == "triton":
                wrong.append(f"{name} imports triton")
    assert not wrong, wrong


def test_nothing_below_the_daemon_imports_it():
    wrong = sorted(f"{name} imports {target}" for name, targets in imports(everywhere=True).items()
                   if not _in(name, "hicache.daemon") for target in targets if _in(target, "hicache.daemon"))
    assert not wrong, wrong


def test_kernels_import_nothing_above_them():
    wrong = sorted(f"{name} imports {target}" for name, targets in imports(everywhere=True).items()
                   if _in(name, "hicache.kernels") for target in targets
                   if not (_in(target, "hicache.kernels") or target == "hicache.errors"))
    assert not wrong, wrong


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module
    (Tarjan), shortest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, set(c)) for c in components]


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle inside one strongly connected component (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError("not a strongly connected component")


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = _cycles(imports(everywhere=False))
    assert not cycles, " ; ".join(" -> ".join(cycle) for cycle in cycles)
