"""compare_sizes and ``ckptkit sizes`` on the fsdp2_ws2 sample and its unsharded copies: every
number equals the files on disk or the tensors torch saved."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import ckptkit
from ckptkit.cli import main


def _file_sizes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def test_compare_sizes_matches_files_on_disk(ws2, unsharded):
    reference = ws2.reference()
    st = unsharded / "st"
    frame = ckptkit.compare_sizes(
        str(ws2.path), str(unsharded / "pt"), str(st), str(st / "model.safetensors")
    )
    assert frame.index.tolist() == ["ckpt", "pt", "st", "model.safetensors"]
    assert frame["format"].tolist() == ["dcp", "torch_save", "safetensors", "safetensors"]
    for label, path in [("ckpt", ws2.path), ("pt", unsharded / "pt"), ("st", st)]:
        row = frame.loc[label]
        assert row["size"] == _file_sizes(path), label
        assert row["files"] == len(list(path.iterdir())), label
        assert row["tensor_bytes"] == _tensor_bytes(reference), label
        assert row["model"] == _tensor_bytes(reference["model"]), label  # buffers are tensors
        parts = ["model", "optim", "train", "other", "overhead_bytes", "metadata_bytes"]
        assert row[parts].sum() == row["size"], label
        assert row[["float32", "bfloat16", "int64"]].sum() == row["tensor_bytes"], label
    assert frame.loc["ckpt", "metadata_bytes"] == (ws2.path / ".metadata").stat().st_size
    assert frame.loc["ckpt", "train"] > 0 and frame.loc["st", "other"] == 0
    assert frame.loc["ckpt", "ratio"] == 1.0
    assert frame.loc["pt", "ratio"] == pytest.approx(
        frame.loc["pt", "size"] / frame.loc["ckpt", "size"]
    )
    # safetensors framing is the 8-byte length plus the JSON header, nothing else
    model = frame.loc["model.safetensors"]
    (header,) = struct.unpack("<Q", (st / "model.safetensors").read_bytes()[:8])
    assert model["overhead_bytes"] == 8 + header
    assert model["size"] == (st / "model.safetensors").stat().st_size
    assert model["optim"] == 0 and model["records"] == len(reference["model"])
    # one zip record per tensor chunk in DCP: more framing than in the unsharded files
    assert frame.loc["ckpt", "overhead_bytes"] > 10 * frame.loc["st", "overhead_bytes"]


def test_compare_sizes_labels_and_categories(ws2):
    frame = ckptkit.compare_sizes(str(ws2.path), labels=["run"], categories={"train": "other"})
    assert frame.index.tolist() == ["run"]
    assert frame.loc["run", "train"] == 0 and frame.loc["run", "other"] > 0
    with pytest.raises(ValueError):
        ckptkit.compare_sizes(str(ws2.path), labels=["a", "b"])


def test_cli_sizes(ws2, unsharded, capsys):
    paths = [str(ws2.path), str(unsharded / "st")]
    assert main(["sizes", *paths, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    frame = ckptkit.compare_sizes(*paths)
    assert [row["size"] for row in document["checkpoints"]] == frame["size"].tolist()
    assert [row["label"] for row in document["checkpoints"]] == ["ckpt", "st"]
    assert main(["sizes", *paths, "--labels", "dcp", "--labels", "safetensors"]) == 0
    out = capsys.readouterr().out
    assert "overhead_bytes" in out and "1.000x" in out
    assert out.splitlines()[0].split() == ["checkpoint", "dcp", "safetensors"]
