"""torch's HuggingFaceStorageWriter output (torch >= 2.8), written here: per-rank shards
(``hf_dcp_sharded``), their consolidation, and a rank-0 save that is plain HF-sharded
safetensors; every value is compared with the live tensors the ranks held."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import CoverageError, MissingFileError

from oracle import assert_bit_equal


def _hf_full_state(with_ints: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {
        "rows": torch.randn(7, 5, generator=g),  # Shard(0): 4 + 3 rows
        "cols": torch.randn(4, 9, generator=g),  # Shard(1): 5 + 4 columns
        "half": torch.randn(5, 6, generator=g).to(torch.bfloat16),  # Shard(0), bf16
        "rep": torch.randn(3, generator=g),  # replicated
    }
    if with_ints:  # torch 2.13's consolidation step cannot handle these (FORMATS.md)
        state["ids"] = torch.arange(11, dtype=torch.int64) * 3
        state["scale"] = torch.tensor(1.25)
    return state


def _hf_write_rank(rank: int, world_size: int, root: str) -> None:
    """Rank body: DTensors saved with HuggingFaceStorageWriter, with and without consolidation;
    rank 0 also saves the live full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"rows": Shard(0), "cols": Shard(1), "half": Shard(0), "ids": Shard(0)}
    for name, with_ints, consolidate in (("plain", True, False), ("consolidated", False, True)):
        state = {
            key: distribute_tensor(value, mesh, [placements.get(key, Replicate())])
            for key, value in _hf_full_state(with_ints).items()
        }
        writer = HuggingFaceStorageWriter(
            f"{root}/{name}", save_distributed=True, enable_consolidation=consolidate
        )
        dcp.save(state, storage_writer=writer)
        full = {key: value.full_tensor() for key, value in state.items()}
        if rank == 0:
            torch.save(full, f"{root}/{name}.live.pt")


@pytest.fixture(scope="module")
def hf_written(tmp_path_factory) -> Path:
    from ckptkit.examples import _spawn

    root = tmp_path_factory.mktemp("hf_storage")
    _spawn(_hf_write_rank, 2, str(root))
    return root


def test_hf_storage_writer_rank_shards(hf_written, tmp_path):
    live = torch.load(hf_written / "plain.live.pt")
    ckpt = ckptkit.open(str(hf_written / "plain"))
    assert ckpt.format == "hf_dcp_sharded"
    assert ckpt.catalog.files == (
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    )
    assert set(ckpt.keys()) == {f"model.{key}" for key in live}
    for key, tensor in live.items():
        assert ckpt.entry(f"model.{key}").shape == tuple(tensor.shape), key
        assert_bit_equal(ckpt.read(f"model.{key}"), tensor, key)
    chunks = ckpt.chunks.sort_values("rank")
    cols = chunks[chunks["key"] == "model.cols"]
    assert cols["offsets"].tolist() == [(0, 0), (0, 5)]
    assert cols["sizes"].tolist() == [(4, 5), (4, 4)]
    rows = chunks[chunks["key"] == "model.rows"]
    assert rows["offsets"].tolist() == [(0, 0), (4, 0)]
    # unshard streams it back into one file equal to the live tensors
    ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False)
    out = torch.load(tmp_path / "out" / "model.pt")
    for key, tensor in live.items():
        assert_bit_equal(out[key], tensor, key)


def test_hf_storage_writer_consolidated_layout(hf_written):
    live = torch.load(hf_written / "consolidated.live.pt")
    root = hf_written / "consolidated"
    assert (root / "model.safetensors.index.json").exists()
    consolidated = ckptkit.open(str(root))  # the consolidated files are the checkpoint here
    assert consolidated.format == "safetensors"
    assert {k: consolidated.entry(k).shape for k in consolidated} == {
        f"model.{k}": tuple(v.shape) for k, v in live.items()
    }
    shards = ckptkit.open(str(root / "sharded"))
    assert shards.format == "hf_dcp_sharded"
    for key, tensor in live.items():  # compared with the live tensors, not the consolidation
        assert_bit_equal(shards.read(f"model.{key}"), tensor, key)


def test_hf_storage_writer_rank0_checkpoint_is_plain_hf_sharded(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _hf_full_state(with_ints=False)
    mapping = {"rows": 1, "cols": 1, "half": 2, "rep": 2}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp_path), mapping))
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "safetensors"
    assert sorted(ckpt.catalog.files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for key, tensor in state.items():
        assert_bit_equal(ckpt.read(f"model.{key}"), tensor, key)


def test_hf_storage_writer_missing_rank_shard(hf_written, tmp_path):
    # rank 0's shard gone: the shard numbers no longer start at 1
    shutil.copytree(hf_written / "plain", tmp_path / "plain")
    (tmp_path / "plain" / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(MissingFileError, match="shard-00001-model-00001-of-00001"):
        ckptkit.open(str(tmp_path / "plain"))
    # the last rank's shard gone from a consolidated save: the consolidated shapes expose it
    shutil.copytree(hf_written / "consolidated", tmp_path / "consolidated")
    (
        tmp_path / "consolidated" / "sharded" / "shard-00002-model-00001-of-00001.safetensors"
    ).unlink()
    with pytest.raises(
        CoverageError, match=r"the shards' boxes \(a missing or overlapping shard\?\) leave a hole"
    ):
        ckptkit.open(str(tmp_path / "consolidated" / "sharded"))
