"""The layering the architecture promises, checked on the import graph (tests/import_graph.py):
format adapters never import each other, operations never import the face, no import cycles."""

from __future__ import annotations

import ckptkit.formats

from import_graph import cycles, graph

#: Modules that operate on any checkpoint: they take a source, never the user-facing face.
OPERATIONS = ("convert", "diff", "sizes", "state_dict", "plots", "browser", "verify", "tables")
ADAPTERS = {
    f"ckptkit.formats.{module.__name__.rpartition('.')[2]}"
    for module in ckptkit.formats.ADAPTERS.values()
}


def test_adapters_import_no_sibling_adapter():
    edges = graph()
    assert len(ADAPTERS) == len(ckptkit.formats.ADAPTERS) >= 8
    for adapter in ADAPTERS:
        assert not edges[adapter] & ADAPTERS, f"{adapter} imports {edges[adapter] & ADAPTERS}"


def test_shared_parts_import_no_adapter():
    edges = graph()
    parts = [m for m in edges if m.startswith("ckptkit.formats.parts.")]
    assert len(parts) >= 4
    for module in parts:
        assert not edges[module] & ADAPTERS, f"{module} imports {edges[module] & ADAPTERS}"


def test_operations_do_not_import_the_face():
    edges = graph()
    for name in OPERATIONS:
        module = f"ckptkit.{name}"
        assert "ckptkit.checkpoint" not in edges[module], f"{module} imports ckptkit.checkpoint"


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
