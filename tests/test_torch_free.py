"""Inspection needs no torch: opening a checkpoint, building every table and reading every tensor
as numpy with torch blocked, checked against the references the writing projects made."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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


TORCH_FREE_UNSHARD = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

for source, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    ckptkit.unshard(source, dst, to="torch", progress=False)
"""


def test_unshard_to_torch_save_without_torch(tmp_path):
    """The torch.save writer names torch's rebuild functions without importing torch: the
    outputs of a torch-blocked unshard load with ``torch.load`` (``model.pt`` with
    ``weights_only=True``) and hold the writing project's tensors and ckptkit's decoded objects,
    and an object holding a tensor (an ``argparse.Namespace``) comes back with that tensor."""
    import argparse

    import torch

    from isolated import run_script

    holder = tmp_path / "holder.pt"
    hidden = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    torch.save(
        {"model": {"w": torch.ones(2)}, "args": argparse.Namespace(t=hidden, lr=0.1)}, holder
    )
    args = [holder, tmp_path / "holder_out"]
    for i, (path, _) in enumerate(CASES):
        args += [FIXTURES / path, tmp_path / f"out{i}"]
    run_script(TORCH_FREE_UNSHARD, *args, timeout=300)
    namespace = torch.load(tmp_path / "holder_out" / "holder.pt", weights_only=False)["args"]
    assert namespace.lr == 0.1 and torch.equal(namespace.t, hidden)
    for i, (path, reference) in enumerate(CASES):
        ckpt = ckptkit.open(str(FIXTURES / path))
        loaded = {  # trainer state holds numpy RNG state, which weights_only refuses
            f.stem: torch.load(f, weights_only=f.stem == "model")
            for f in (tmp_path / f"out{i}").glob("*.pt")
        }
        expected = reference_hashes(FIXTURES / reference)
        for entry in [*ckpt.catalog.tensors(), *ckpt.catalog.objects()]:
            value = _lookup(loaded[entry.group], entry.path[1:] or entry.path)
            if entry.kind == "tensor":
                if entry.key in expected:
                    assert _sha256(value) == expected[entry.key], (path, entry.key)
                continue
            _assert_same(value, ckpt.read_object(entry.key), entry.key)


def test_pickled_state_dict_is_byte_identical_to_torch_save():
    """``data.pkl`` as torch.save writes it, opcode for opcode, for every storage kind."""
    import io
    import zipfile

    import torch

    from ckptkit.ops.writers import torch_save

    state = {
        "w": torch.zeros(2, 3),
        "fp8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "u16": torch.zeros(2, dtype=torch.uint16),
        "nested": {"bf16": torch.ones(3, dtype=torch.bfloat16), "list": [1, 2.5, "x", None]},
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "5d": torch.zeros(1, 2, 3, 4, 300),
        "big": torch.zeros(70000, 1, dtype=torch.int64),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    expected = zipfile.ZipFile(buffer).read("archive/data.pkl")
    slots = {k: v for k, v in state.items()}
    assert torch_save.dumps(slots)[0] == expected


def test_a_pickle_of_many_tensors_is_byte_identical_to_torch_save():
    """Past 256 memo entries (where every tensor of a known dtype and shape is written from a
    template): still torch.save's ``data.pkl``, opcode for opcode, for every storage kind,
    0-d tensors, shapes and dtypes met again after others, and keys of any length."""
    import io
    import zipfile

    import torch

    from ckptkit.ops.writers import torch_save

    kinds = [
        (torch.float32, (4, 8)),
        (torch.float8_e4m3fn, (3,)),
        (torch.bfloat16, (2, 1, 5)),
        (torch.float64, ()),
        (torch.uint16, (70000,)),
        (torch.int64, (1, 2, 3, 4, 300)),
    ]
    state = {}
    for i in range(600):
        dtype, shape = kinds[(i * 7) % len(kinds)]
        state[f"layers.{i}.w" + "x" * (i % 300)] = torch.zeros(shape, dtype=dtype)
    state["nested"] = {"list": [torch.ones(2), 3, "y"], "more": torch.ones(4, 8)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    expected = zipfile.ZipFile(buffer).read("archive/data.pkl")
    assert torch_save.dumps(state)[0] == expected


def _lookup(value, path):
    for part in path:
        value = value[part] if isinstance(value, dict) else value[int(part)]
    return value


def _sha256(tensor) -> str:
    import hashlib

    import torch

    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _assert_same(actual, expected, key: str) -> None:
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, key
        assert torch.equal(actual, expected), key
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), key
        for k in expected:
            _assert_same(actual[k], expected[k], f"{key}.{k}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), key
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{key}.{i}")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, key
        assert np.array_equal(actual, expected), key
    else:
        assert actual == expected or (actual != actual and expected != expected), key
