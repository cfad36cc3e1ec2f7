"""``ckptkit unshard`` / ``ckptkit convert`` from the command line, on a torch-written FSDP2 DCP."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptkit.units import human_bytes, plural

from oracle import assert_bit_equal, torch_unsharded

#: One line per written file: ``  name   12.3 KB  5 tensors, 0 objects`` (``1 tensor``).
FILE_LINE = re.compile(r"^\s+(\S+)\s+(\d+(?:\.\d)? [KMGT]?B)\s+(\d+) tensors?, (\d+) objects?$")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *args], capture_output=True, text=True, timeout=300
    )


def written_files(result: subprocess.CompletedProcess, dst: Path) -> dict[str, tuple[int, int]]:
    """The files the command says it wrote, checked against the disk: name → (tensors, objects)."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    files = {}
    for line in lines[1:]:
        match = FILE_LINE.match(line)
        assert match, f"unexpected output line {line!r}"
        name, size, tensors, objects = match.groups()
        assert size == human_bytes((dst / name).stat().st_size), name
        files[name] = (int(tensors), int(objects))
    total = sum((dst / name).stat().st_size for name in files)
    assert lines[0] == f"wrote {plural(len(files), 'file')} ({human_bytes(total)}) to {dst}"
    assert sorted(p.name for p in dst.iterdir()) == sorted(files)  # nothing else, no staging
    return files


def entry_counts(path: Path) -> dict[str, tuple[int, int]]:
    """(tensors, objects) per top-level group, as torch's own DCP metadata lists them."""
    metadata = FileSystemReader(str(path)).read_metadata()
    counts: dict[str, list[int]] = {}
    for key, item in metadata.state_dict_metadata.items():
        group = metadata.planner_data[key][0]
        counts.setdefault(group, [0, 0])[not isinstance(item, TensorStorageMetadata)] += 1
    return {group: (t, o) for group, (t, o) in counts.items()}


def test_unshard_prints_what_it_wrote(written, tmp_path):
    source = written("fsdp2_ws2")
    dst = tmp_path / "out"
    files = written_files(run("unshard", str(source.path), str(dst), "--quiet"), dst)
    assert files == {f"{group}.pt": n for group, n in entry_counts(source.path).items()}
    expected = torch_unsharded(source.path, tmp_path)
    model = torch.load(dst / "model.pt", weights_only=True, mmap=True)
    assert model.keys() == expected["model"].keys()
    for key, tensor in expected["model"].items():
        assert_bit_equal(model[key], tensor, key)


def test_unshard_safetensors_model_in_bfloat16(written, tmp_path):
    source = written("fsdp2_ws2")
    dst = tmp_path / "st"
    args = ["--to", "safetensors", "--groups", "model", "--dtype", "bf16", "--progress"]
    result = run("unshard", str(source.path), str(dst), *args)
    files = written_files(result, dst)
    n_model = entry_counts(source.path)["model"][0]
    assert files == {"model.safetensors": (n_model, 0)}
    assert "unshard" in result.stderr  # the progress bar asked for, on stderr only
    quiet = run("unshard", str(source.path), str(tmp_path / "again"), *args[:-1])
    assert quiet.returncode == 0 and quiet.stderr == ""  # stderr is not a terminal: no bar
    loaded = safetensors.torch.load_file(dst / "model.safetensors")
    reference = source.reference()["model"]
    assert loaded.keys() == reference.keys()
    for key, tensor in reference.items():
        cast = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert_bit_equal(loaded[key], cast, key)
    assert loaded["embed.weight"].dtype == torch.bfloat16
    assert loaded["num_updates"].dtype == torch.int64  # only floating tensors are cast


def test_unshard_keys_globs_select_entries(written, tmp_path):
    source = written("fsdp2_ws2")
    dst = tmp_path / "some"
    globs = ["model.blocks.0.*", "model.odd", "optim.state.*.exp_avg"]
    files = written_files(
        run(
            "unshard",
            str(source.path),
            str(dst),
            "--quiet",
            *[a for g in globs for a in ("--keys", g)],
        ),
        dst,
    )
    expected = torch_unsharded(source.path, tmp_path)
    want_model = {k: v for k, v in expected["model"].items() if k.startswith("blocks.0.")}
    want_model["odd"] = expected["model"]["odd"]
    state = expected["optim"]["state"]  # `*` spans dots: every parameter's exp_avg
    assert files == {"model.pt": (len(want_model), 0), "optim.pt": (len(state), 0)}
    model = torch.load(dst / "model.pt", weights_only=True)
    assert model.keys() == want_model.keys()
    for key, tensor in want_model.items():
        assert_bit_equal(model[key], tensor, key)
    optim = torch.load(dst / "optim.pt", weights_only=True)
    assert list(optim) == ["state"]  # param_groups did not match
    assert optim["state"].keys() == state.keys()
    for fqn, values in optim["state"].items():
        assert list(values) == ["exp_avg"]  # no exp_avg_sq, no step
        assert_bit_equal(values["exp_avg"], state[fqn]["exp_avg"], fqn)


def test_unshard_max_shard_size_writes_hf_shards_and_index(written, tmp_path):
    source = written("fsdp2_ws2")
    dst = tmp_path / "hf"
    args = ["--to", "safetensors", "--groups", "model", "--max-shard-size", "20KB", "--quiet"]
    files = written_files(run("unshard", str(source.path), str(dst), *args), dst)
    shards = sorted(name for name in files if name.endswith(".safetensors"))
    n = len(shards)
    assert n > 1
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert files["model.safetensors.index.json"] == (0, 0)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    reference = source.reference()["model"]
    loaded = {}
    for shard in shards:
        tensors = safetensors.torch.load_file(dst / shard)
        assert files[shard] == (len(tensors), 0)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000 or (
            len(tensors) == 1
        )
        assert all(index["weight_map"][key] == shard for key in tensors)
        loaded.update(tensors)
    assert loaded.keys() == reference.keys() == index["weight_map"].keys()
    for key, tensor in reference.items():
        assert_bit_equal(loaded[key], tensor, key)


def test_existing_output_is_refused_without_overwrite(written, tmp_path):
    source = written("fsdp2_ws2")
    dst = tmp_path / "out"
    written_files(run("unshard", str(source.path), str(dst), "--groups", "model", "--quiet"), dst)
    before = (dst / "model.pt").read_bytes()
    mtime = (dst / "model.pt").stat().st_mtime_ns

    again = run("unshard", str(source.path), str(dst), "--groups", "model", "--dtype", "bfloat16")
    assert again.returncode == 2
    assert again.stdout == ""
    assert again.stderr.count("\n") == 1 and again.stderr.startswith("ckptkit: error: ")
    assert "model.pt" in again.stderr and "--overwrite" in again.stderr
    assert (dst / "model.pt").read_bytes() == before
    assert (dst / "model.pt").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in dst.iterdir()) == ["model.pt"]  # no staging left behind

    args = ["--groups", "model", "--dtype", "bfloat16", "--overwrite", "--quiet"]
    written_files(run("unshard", str(source.path), str(dst), *args), dst)
    replaced = torch.load(dst / "model.pt", weights_only=True)
    assert replaced["embed.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("groups", [["model"], None])
def test_convert_to_dcp_is_read_by_dcp_to_torch_save(written, tmp_path, groups):
    source = written("fsdp2_ws2")
    dst = tmp_path / "dcp"
    args = ["--to", "dcp", "--quiet"] + [a for g in groups or () for a in ("--groups", g)]
    files = written_files(run("convert", str(source.path), str(dst), *args), dst)
    counts = entry_counts(source.path)
    kept = [g for g in counts if groups is None or g in groups]
    assert set(files) == {"__0_0.distcp", ".metadata"}
    assert files["__0_0.distcp"] == (
        sum(counts[g][0] for g in kept),
        sum(counts[g][1] for g in kept),
    )
    back = torch_unsharded(dst, tmp_path)
    expected = torch_unsharded(source.path, tmp_path)
    assert sorted(back) == sorted(kept)
    for key, tensor in expected["model"].items():
        assert_bit_equal(back["model"][key], tensor, key)
    if groups is None:
        assert back["train"] == expected["train"]
        assert back["optim"]["param_groups"] == expected["optim"]["param_groups"]
