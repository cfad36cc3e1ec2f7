"""Inspection needs no torch: opening a checkpoint, building every table and reading every tensor
as numpy with torch blocked, checked against the references the writing projects made."""

from __future__ import annotations

import json
from pathlib import Path

import ckptkit

from oracle import inspect_without_torch

FIXTURES = Path(__file__).parent / "fixtures"
#: (checkpoint, the writing project's reference hashes of its unsharded tensors)
CASES = [
    ("dcp_torch22_fsdp1_ws2/checkpoint", "dcp_torch22_fsdp1_ws2/reference"),
    ("olmo_torch_new_ws2/step3", "olmo_torch_new_ws2/reference"),
    ("olmo_core3_trainer_ws2/step3", "olmo_core3_trainer_ws2/reference"),
]


def reference_hashes(reference: Path) -> dict[str, str]:
    """``{group.key: sha256}`` from ``tensors.sha256.json`` (``model.pt`` keys → ``model.``)."""
    table = json.loads((reference / "tensors.sha256.json").read_text())
    return {
        f"{file.removesuffix('.pt')}.{key}": spec["sha256"]
        for file, tensors in table.items()
        for key, spec in tensors.items()
    }


def test_open_tables_and_numpy_reads_without_torch():
    results = inspect_without_torch(*(FIXTURES / path for path, _ in CASES))
    for (path, reference), seen in zip(CASES, results, strict=True):
        catalog = ckptkit.open(str(FIXTURES / path)).catalog
        assert set(seen["tensors"]) == {e.key for e in catalog.tensors()}, path
        assert set(seen["objects"]) == {e.key for e in catalog.objects()}, path
        expected = reference_hashes(FIXTURES / reference)
        compared = {key: seen["tensors"][key] for key in expected}
        assert compared == expected, path
