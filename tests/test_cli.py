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
    on_disk[".metadata"] = (FIXTURE / "model_and_optim" / ".metadata").stat().st_size
    assert {f["file"]: f["size"] for f in doc["files"]} == on_disk  # data files and metadata
    assert [f["kind"] for f in doc["files"]] == ["data"] * (len(on_disk) - 1) + ["metadata"]
    summary = doc["summary"]
    assert (summary["tensors"], summary["objects"]) == (len(expected), len(doc["objects"]))
    model = [v for k, v in expected.items() if metadata.planner_data[k][0] == "model"]
    assert summary["parameters"] == sum(v.size.numel() for v in model)
    assert summary["parameters_counted"] == "model"
    assert (summary["files"], summary["bytes_on_disk"]) == (len(on_disk), sum(on_disk.values()))
    top = json.loads(
        run("inspect", str(FIXTURE / "model_and_optim"), "--json", "--top", "2").stdout
    )
    largest = sorted(tensors.values(), key=lambda t: t["nbytes"], reverse=True)[:2]
    assert [t["nbytes"] for t in top["tensors"]] == [t["nbytes"] for t in largest]
    assert top["summary"] == summary


def test_inspect_human_output_lists_groups_and_largest_tensors():
    result = run("inspect", str(FIXTURE / "model_and_optim"), "--top", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    metadata = dcp.FileSystemReader(str(FIXTURE / "model_and_optim")).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    objects = len(metadata.state_dict_metadata) - len(tensors)
    files = len(list((FIXTURE / "model_and_optim").glob("*.distcp"))) + 1  # and .metadata
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


def test_a_closed_pipe_is_quiet_and_successful():
    """``ckptkit … | head``: the reader went away; no error, no traceback, exit 0."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptkit.cli", "inspect", str(FIXTURE), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # before the child writes anything: its first write hits EPIPE
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert stderr == ""


def test_exit_status_separates_usage_errors_from_findings(tmp_path):
    """0 sound, 1 damage found, 2 a typo or not a checkpoint: a CI job can tell them apart."""
    assert run("verify", str(FIXTURE)).returncode == 0
    missing = run("verify", str(tmp_path / "no_such_checkpoint"))
    assert missing.returncode == 2 and missing.stderr.startswith("ckptkit: error:")
    assert run("verify", str(FIXTURE), "--no-crc").returncode == 0  # the earlier flag name
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(FIXTURE, damaged)
    data = damaged / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    found = run("verify", str(damaged))
    assert found.returncode == 1
    head, counts = found.stdout.splitlines()[:2]
    assert head.endswith("problem(s) in 1 file(s)") and counts.startswith("  model_and_optim/__0_0")
    details = [line for line in found.stdout.splitlines() if line.startswith("    ")]
    assert details and all(str(damaged) in line for line in details)  # whole, not cut


def test_selection_options_repeat_and_never_swallow_positionals(tmp_path):
    out = tmp_path / "out"
    done = run("unshard", "--groups", "model", str(FIXTURE), str(out), "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]
    both = run(
        "unshard", "--groups", "model", "--groups", "train", str(FIXTURE), str(tmp_path / "b")
    )
    assert both.returncode == 0, both.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["model.pt", "train.pt"]


def test_bad_values_are_refused_with_the_valid_ones(tmp_path):
    dtype = run("unshard", str(FIXTURE), str(tmp_path / "a"), "--dtype", "bf17")
    assert dtype.returncode == 2 and "bfloat16" in dtype.stderr and "bf16" in dtype.stderr
    size = run("unshard", str(FIXTURE), str(tmp_path / "b"), "--to", "safetensors",
               "--max-shard-size", "5")  # fmt: skip
    assert size.returncode == 2 and "5GB" in size.stderr
    assert not (tmp_path / "b").exists()
    group = run("unshard", str(FIXTURE), str(tmp_path / "c"), "--groups", "modle")
    assert group.returncode == 2 and "groups: model, optim, train" in group.stderr
    key = run("diff", str(FIXTURE), str(FIXTURE), "--keys", "model.transformer.wte.weigth")
    assert key.returncode == 2 and "did you mean 'model.transformer.wte.weight'" in key.stderr


def test_every_command_has_examples_in_its_help():
    for command in ("inspect", "unshard", "convert", "diff", "verify", "sizes", "stats"):
        shown = run(command, "--help")
        assert shown.returncode == 0
        assert f"examples:\n  ckptkit {command} " in shown.stdout, command
