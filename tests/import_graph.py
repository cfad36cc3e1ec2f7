"""ckptkit's module import graph, read from the source with ``ast`` (nothing is imported).

``python tests/import_graph.py`` prints each module with the ckptkit modules it imports (at
module level or inside functions alike); ``tests/test_layering.py`` checks the layering rules
on the same graph.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptkit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ckptkit modules ``path`` imports (``from . import x`` resolved to ``pkg.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in ``base`` itself
                found.add(base)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    """Every ckptkit module → the ckptkit modules it imports (a fresh copy each call)."""
    return {module: set(targets) for module, targets in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, frozenset[str]]:
    """The graph, parsed once per process: the layering tests ask for it ~100 times."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): frozenset(imports_of(p, modules)) for p in paths}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), i.e. import cycles; a
    package's ``__init__`` re-exporting its submodules is not counted as a cycle with them."""
    edges = {
        m: {t for t in targets if not (m.startswith(t + ".") and t in edges)}
        for m, targets in edges.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


if __name__ == "__main__":
    edges = graph()
    for module in sorted(edges):
        short = sorted(m.removeprefix("ckptkit.") for m in edges[module])
        print(f"{module.removeprefix('ckptkit.') or 'ckptkit'} -> {', '.join(short) or '-'}")
    print("cycles:", cycles(edges) or "none")
    sys.exit(0)
