"""The architecture, stated once and checked on the import graph (tests/import_graph.py).

ckptkit is a stack of layers, each a sub-package (or a few top-level modules); a module may
import only from its own layer or the layers listed before it. Formats and reading sit side by
side on one level and never import each other; no format adapter imports another; only
``ckptkit.storage`` touches files or fsspec.
"""

from __future__ import annotations

import ast
import re

import pytest

import ckptkit.formats

from import_graph import PACKAGE, cycles, graph, module_name

#: The layers, lowest first: (name, module patterns). A module belongs to the first layer one of
#: whose patterns it matches (``pkg`` is the package and everything in it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        ("errors", "extras", "dtypes", "limits", "tunables", "units", "crc32", "progress"),
    ),
    ("storage", ("storage",)),
    ("decoding", ("decoding",)),
    ("catalog", ("catalog",)),
    ("formats | reading", ("formats", "reading")),
    ("operations", ("ops",)),
    ("checkpoint", ("checkpoint",)),
    ("views", ("views",)),
    ("faces", ("runs", "examples", "notebook_runs", "cli", "__main__", "")),
]
#: Modules outside ``ckptkit.storage`` allowed to open files themselves, and why.
OPENS_FILES = {
    "ckptkit.examples": "writes the project's own sample checkpoints with torch (reads none)",
    "ckptkit.cli": "points stdout at os.devnull when the reader of a pipe went away",
    "ckptkit.notebook_runs": "copies the notebooks it ships and writes a run's page (reads none)",
}


def layer_of(module: str) -> int:
    relative = module.removeprefix("ckptkit").removeprefix(".")
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if relative == pattern or (pattern and relative.startswith(pattern + ".")):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def adapters() -> set[str]:
    return {module.__name__ for module in ckptkit.formats.ADAPTERS.values()}


def owner_adapter(module: str) -> str | None:
    """The adapter ``module`` belongs to (itself, or a module inside an adapter's package)."""
    return next((a for a in adapters() if module == a or module.startswith(a + ".")), None)


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


@pytest.mark.parametrize("module", sorted(graph()))
def test_imports_point_down(module):
    edges = graph()
    mine = layer_of(module)
    upward = sorted(t for t in edges[module] if layer_of(t) > mine)
    assert not upward, f"{module} ({LAYERS[mine][0]}) imports a later layer: {upward}"


def test_formats_and_reading_never_import_each_other():
    for module, targets in graph().items():
        for a, b in (("formats", "reading"), ("reading", "formats")):
            if module.startswith(f"ckptkit.{a}"):
                crossing = sorted(t for t in targets if t.startswith(f"ckptkit.{b}"))
                assert not crossing, f"{module} imports {crossing}"


def test_adapters_import_no_sibling_adapter():
    edges = graph()
    assert len(adapters()) == len(ckptkit.formats.ADAPTERS) >= 8
    for module, targets in edges.items():
        mine = owner_adapter(module)
        if mine is None:
            continue
        others = sorted({owner_adapter(t) for t in targets} - {None, mine})
        assert not others, f"{module} imports the adapter(s) {others}"


def test_shared_parts_serve_two_adapters_and_import_none():
    edges = graph()
    parts = [m for m in edges if m.startswith("ckptkit.formats.parts.")]
    assert len(parts) >= 4
    for module in parts:
        assert not {owner_adapter(t) for t in edges[module]} - {None}, module
        users = {owner_adapter(m) for m in _importers(edges, module)} - {None}
        assert len(users) >= 2, f"{module} serves only {sorted(users)}: move it into that adapter"


def _importers(edges: dict[str, set[str]], module: str) -> set[str]:
    """Every module that imports ``module``, directly or through other modules."""
    found: set[str] = set()
    todo = [module]
    while todo:
        target = todo.pop()
        for importer, targets in edges.items():
            if target in targets and importer not in found:
                found.add(importer)
                todo.append(importer)
    return found


def _opens_files(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] == "fsspec"]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append(f"open() line {node.lineno}")
            elif isinstance(func, ast.Attribute) and (
                func.attr in {"read_text", "write_text", "read_bytes", "write_bytes"}
                or (
                    isinstance(func.value, ast.Name)
                    and (func.value.id, func.attr) == ("os", "open")
                )
            ):
                found.append(f"{func.attr}() line {node.lineno}")
    return found


def test_only_storage_touches_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if module.startswith("ckptkit.storage") or module in OPENS_FILES:
            continue
        assert not _opens_files(ast.parse(path.read_text())), (
            f"{module}: {_opens_files(ast.parse(path.read_text()))}"
        )


def test_the_file_rule_finds_file_access():
    tree = ast.parse("import fsspec\nopen('x')\nos.open('y', 0)\nPath('z').read_text()\n")
    assert len(_opens_files(tree)) == 4


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layer_rule_finds_an_upward_import():
    assert layer_of("ckptkit.views.plots") > layer_of("ckptkit.ops.diff")
    assert layer_of("ckptkit.storage") < layer_of("ckptkit.decoding.records")


def test_every_module_states_its_public_names():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        if not re.search(r"^__all__\b", path.read_text(), re.MULTILINE):
            missing.append(module_name(path))
    assert not missing, f"no __all__ in {missing}"


def test_long_modules_say_why():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 600:
            assert "Longer than most" in text.split('"""', 2)[1], (
                f"{module_name(path)}: {text.count(chr(10))} lines; split it, or say why not in "
                "its docstring ('Longer than most: …')"
            )
