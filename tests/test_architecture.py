"""The package's shape, read from its source with `ast` (nothing imported):

- no import circle among its modules, counting every import: at the top, in
  a function (a lazy import is still an arrow) and under TYPE_CHECKING;
- no core module imports an edge one: the HTTP API (`session_runtime.api`)
  and the command line (`session_runtime.cli`) sit on top, and nothing below
  them reaches up;
- no package file over 400 lines (docs/architecture.md);
- each subpackage imports none of those above it (NOT_BELOW: what its
  `__init__.py` says it may not import).

`from package import name` is an arrow to the submodule where `name` is one,
else to the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("session_runtime", "radix_ext")
EDGES = ("session_runtime.api", "session_runtime.cli")
MAX_LINES = 400
# A subpackage, and the packages above it that it must never import.
_TOP = ("session_runtime.api", "session_runtime.cli", "session_runtime.replay")
NOT_BELOW = {
    "session_runtime.protocols": (*_TOP, "session_runtime.runtime", "session_runtime.store", "session_runtime.backends",
                                  "session_runtime.proxy", "session_runtime.templates"),
    "session_runtime.templates": (*_TOP, "session_runtime.runtime", "session_runtime.store", "session_runtime.backends",
                                  "session_runtime.proxy"),
    "session_runtime.model": (*_TOP, "session_runtime.runtime", "session_runtime.store", "session_runtime.backends"),
    "session_runtime.proxy": (*_TOP, "session_runtime.runtime", "session_runtime.store", "session_runtime.backends"),
    "session_runtime.backends": (*_TOP, "session_runtime.runtime", "session_runtime.store"),
    "session_runtime.store": (*_TOP, "session_runtime.runtime"),
    "session_runtime.runtime": _TOP,
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _targets(module: str, is_package: bool, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules an import statement points at."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[:len(here) - (node.level - 1)]
            base = ".".join(here + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each package module and the package modules it imports, anywhere in it."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(name, path.name == "__init__.py", node, modules)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _is_edge(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EDGES)


def test_the_walk_finds_a_circle_and_an_arrow_up():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert _is_edge("session_runtime.api.app") and not _is_edge("session_runtime.apis")


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_core_module_imports_the_api_or_the_cli():
    up = sorted((m, d) for m, deps in import_graph().items() if not _is_edge(m) for d in deps if _is_edge(d))
    assert not up, "core modules importing the edge: " + ", ".join(f"{m} -> {d}" for m, d in up)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_subpackage_imports_one_above_it():
    graph = import_graph()
    up = sorted((m, d) for package, above in NOT_BELOW.items() for m, deps in graph.items() if _within(m, package)
                for d in deps if any(_within(d, a) for a in above))
    assert not up, "imports of a package above: " + ", ".join(f"{m} -> {d}" for m, d in up)


def test_no_package_file_over_400_lines():
    long = sorted((len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(ROOT)))
                  for p in _modules().values())
    over = [f"{path} ({n})" for n, path in long if n > MAX_LINES]
    assert not over, f"files over {MAX_LINES} lines: " + ", ".join(over)
