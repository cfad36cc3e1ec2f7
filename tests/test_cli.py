"""``ckptkit inspect``: human and JSON output, and errors as one line with a non-zero status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

FIXTURE = Path(__file__).parent / "fixtures" / "olmo_torch_new_ws2" / "step3"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_inspect_json_matches_torch_metadata():
    result = run("inspect", str(FIXTURE / "model_and_optim"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    metadata = dcp.FileSystemReader(str(FIXTURE / "model_and_optim")).read_metadata()
    assert doc["format"] == "dcp"
    tensors = {t["key"]: t for t in doc["tensors"]}
    expected = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    assert tensors.keys() == expected.keys()
    for key, item in expected.items():
        assert tensors[key]["shape"] == list(item.size)
        assert tensors[key]["dtype"] == str(item.properties.dtype).removeprefix("torch.")
        assert tensors[key]["n_chunks"] == len(item.chunks)
        assert tensors[key]["nbytes"] == item.size.numel() * item.properties.dtype.itemsize
    assert {o["key"] for o in doc["objects"]} == set(metadata.state_dict_metadata) - set(expected)
    on_disk = {p.name: p.stat().st_size for p in (FIXTURE / "model_and_optim").glob("*.distcp")}
    assert {f["file"]: f["size"] for f in doc["files"]} == on_disk


def test_inspect_human_output_lists_groups_and_largest_tensors():
    result = run("inspect", str(FIXTURE / "model_and_optim"), "--top", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    metadata = dcp.FileSystemReader(str(FIXTURE / "model_and_optim")).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    objects = len(metadata.state_dict_metadata) - len(tensors)
    files = len(list((FIXTURE / "model_and_optim").glob("*.distcp")))
    assert f"{len(tensors)} tensors, {objects} objects, {files} files" in out
    # parameters: the elements of the model group's tensors
    model = [v for k, v in tensors.items() if metadata.planner_data[k][0] == "model"]
    assert f"{sum(v.size.numel() for v in model):,} parameters" in out
    assert "largest 3 tensors:" in out and "att_proj.weight" in out


def test_inspect_says_what_the_parameter_count_counts(tmp_path):
    """A file with no 'model' group counts every tensor, optimizer state included, and says so."""
    import torch

    state = {"weight": torch.zeros(3, 4), "moments": {"exp_avg": torch.zeros(5)}}
    torch.save(state, tmp_path / "weights.pt")
    out = run("inspect", str(tmp_path / "weights.pt")).stdout
    assert "17 elements in all tensors (no 'model' group)" in out
    assert "parameters in 'model'" not in out
    torch.save(state, tmp_path / "model.pt")
    assert "17 parameters in 'model'" in run("inspect", str(tmp_path / "model.pt")).stdout


def test_inspect_errors_are_one_line_and_non_zero(tmp_path):
    missing = run("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "no such file or directory" in missing.stderr
    (tmp_path / "notes.txt").write_text("hello")
    unknown = run("inspect", str(tmp_path))
    assert unknown.returncode == 2
    assert "not a checkpoint" in unknown.stderr and "notes.txt" in unknown.stderr
    assert unknown.stderr.count("\n") == 1
