"""Checkpoint variants written by torch's own DCP code, for the test-suite.

Each writer saves a real checkpoint directory and returns its path. With `reference_path`,
the same values are also written with plain `torch.save` (full tensors), so tests can
compare what ckptkit reads against what torch held in memory.
The FSDP2-trained model checkpoints come from `ckptkit.examples.write_sample`.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptkit.examples import _spawn, write_sample

__all__ = [
    "VARIANTS",
    "write_column_sharded",
    "write_empty_chunks",
    "write_sample",
    "write_single_process",
]


def _single_process_state() -> dict[str, Any]:
    """Tensors of many dtypes and layouts plus python objects, as one plain state dict."""
    gen = torch.Generator().manual_seed(0)
    model = {
        "float32": torch.randn(4, 3, generator=gen),
        "transposed": torch.randn(3, 5, generator=gen).t(),  # (5, 3), non-contiguous
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "bfloat16": torch.randn(3, generator=gen).to(torch.bfloat16),
        "int64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "bool": torch.tensor([True, False, True, True]),
        "float16": torch.randn(2, 2, generator=gen).to(torch.float16),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(
            memory_format=torch.channels_last
        ),
    }
    train = {
        "step": 7,
        "run_name": "single",
        "losses": [3.5, 2.25, 1.125],
        "config": {"lr": 0.001, "nested": {"warmup": 10}},
        "tensor_tuple": (torch.ones(2), 5),  # DCP pickles a tuple whole, tensor included
    }
    return {"model": model, "train": train}


def write_single_process(
    path: str | os.PathLike, reference_path: str | os.PathLike | None = None
) -> pathlib.Path:
    """`dcp.save` from one process with no process group (torch falls back to `no_dist`)."""
    path = pathlib.Path(path)
    state = _single_process_state()
    dcp.save(state, storage_writer=FileSystemWriter(path))
    if reference_path is not None:
        torch.save(_single_process_state(), reference_path)
    return path


def _column_sharded_state(world_size: int) -> dict[str, Any]:
    """Full (unsharded) tensors of `write_column_sharded`, identical on every rank."""
    gen = torch.Generator().manual_seed(1)
    return {
        "model": {
            "wide": torch.randn(4, 8 * world_size, generator=gen),  # divides evenly
            "uneven": torch.randn(16, 37, generator=gen),  # 37 columns split unevenly
            "int_cols": torch.arange(30, dtype=torch.int64).reshape(3, 10),
            "replicated": torch.randn(5, 7, generator=gen),
            "few_rows": torch.randn(
                3, 5, generator=gen
            ),  # Shard(0): empty chunk if world_size >= 4
        },
        "train": {"world_size": world_size, "note": "column sharded"},
    }


_PLACEMENTS = {
    "wide": Shard(1),
    "uneven": Shard(1),
    "int_cols": Shard(1),
    "replicated": Replicate(),
    "few_rows": Shard(0),
}


def _save_column_sharded(rank: int, world_size: int, path: str, reference_path: str | None) -> None:
    """Rank body of `write_column_sharded`."""
    mesh = init_device_mesh("cpu", (world_size,))
    full = _column_sharded_state(world_size)
    model = {
        name: distribute_tensor(tensor, mesh, [_PLACEMENTS[name]])
        for name, tensor in full["model"].items()
    }
    assert all(isinstance(t, DTensor) for t in model.values())
    dcp.save({"model": model, "train": full["train"]}, storage_writer=FileSystemWriter(path))
    if reference_path is not None and rank == 0:
        torch.save(full, reference_path)


def write_column_sharded(
    path: str | os.PathLike,
    world_size: int = 2,
    reference_path: str | os.PathLike | None = None,
) -> pathlib.Path:
    """DTensors sharded along columns (`Shard(1)`), one `Replicate()` and one row-sharded
    tensor with only 3 rows, saved by `world_size` spawned gloo ranks.

    Keys: model.{wide (4, 8*ws) Shard(1), uneven (16, 37) Shard(1), int_cols int64 (3, 10)
    Shard(1), replicated (5, 7) Replicate, few_rows (3, 5) Shard(0)}, train.{world_size, note}.
    """
    path = pathlib.Path(path)
    _spawn(
        _save_column_sharded,
        world_size,
        str(path),
        None if reference_path is None else str(reference_path),
    )
    return path


def write_empty_chunks(
    path: str | os.PathLike, reference_path: str | os.PathLike | None = None
) -> pathlib.Path:
    """`write_column_sharded` at 4 ranks: `few_rows` (3 rows over 4 ranks) leaves rank 3
    an empty chunk; `uneven` splits into 10, 10, 10, 7 columns."""
    return write_column_sharded(path, world_size=4, reference_path=reference_path)


# name -> (writer, keyword arguments, can torch's own FileSystemReader load it?)
VARIANTS = {
    "single_process": (write_single_process, {}, True),
    "fsdp2_ws2": (write_sample, {"world_size": 2}, True),
    "fsdp2_ws4": (write_sample, {"world_size": 4}, True),
    "column_sharded": (write_column_sharded, {"world_size": 2}, True),
    "empty_chunks": (write_empty_chunks, {}, True),
    "no_collectives": (write_sample, {"world_size": 2, "use_collectives": False}, False),
    "zstd": (write_sample, {"world_size": 2, "compression": "zstd", "thread_count": 2}, True),
    "safetensors_format": (write_sample, {"world_size": 2, "serialization": "safetensors"}, False),
}
