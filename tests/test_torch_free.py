"""Inspection needs no torch: opening a checkpoint and building every table with torch blocked."""

from __future__ import annotations

from pathlib import Path

from isolated import run_script

FIXTURES = Path(__file__).parent / "fixtures"

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

for path in sys.argv[1:]:
    ckpt = ckptkit.open(path)
    for table in (ckpt.tensors, ckpt.chunks, ckpt.files, ckpt.objects):
        assert len(table) > 0, path
    summary = ckpt.summary()
    assert summary.parameters > 0
    assert "<b>" in ckpt._repr_html_() and "<b>" in summary._repr_html_()
    key = ckpt.tensors["key"].iloc[0]
    assert ckpt.read_numpy(key).size == ckpt.entry(key).numel
    assert "Tensor(" in " ".join(ckpt.objects["preview"]) or len(ckpt.objects)
    try:
        ckpt.read(key)
    except ImportError:
        pass
    else:
        raise AssertionError("read() must need torch")
print("torch-free ok")
"""


def test_open_and_tables_without_torch():
    paths = [
        FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint",
        FIXTURES / "olmo_torch_new_ws2" / "step3",
        FIXTURES / "olmo_core3_trainer_ws2" / "step3",
    ]
    assert "torch-free ok" in run_script(SCRIPT, *paths)
