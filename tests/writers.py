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
    "write_fsdp1_rank_files",
    "write_fsdp2_rank_files",
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


# --------------------------------------------------------------------------------------------
# Per-rank torch.save files (not DCP): what FSDP users write with `torch.save` on every rank.


def _train_tiny_lm(model: torch.nn.Module, rank: int, steps: int = 2) -> torch.optim.Optimizer:
    """A few AdamW steps on rank-specific random batches (so optimizer state is non-trivial)."""
    import torch.nn.functional as F

    from ckptkit.examples import SEQ_LEN, VOCAB

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.85, 0.97))
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (3, SEQ_LEN + 1), generator=data)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _save_fsdp1_rank_files(rank: int, world_size: int, path: str, reference_path: str) -> None:
    """Rank body of `write_fsdp1_rank_files`."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ckptkit.examples import TinyLM, _Adapter, _Block

    torch.manual_seed(0)
    model = FSDP(
        TinyLM(),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({_Block, _Adapter}),  # bf16 adapter: its own unit
        use_orig_params=True,
    )
    optimizer = _train_tiny_lm(model, rank)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": model.state_dict(),
            "optim": FSDP.optim_state_dict(model, optimizer),
            "train": {"step": 2, "rank": rank},
        }
    torch.save(state, pathlib.Path(path) / f"rank{rank}.pt")
    # The reference: the model's FULL_STATE_DICT, and the optimizer state as torch's own
    # ShardedTensor.gather() assembles the saved shards. (On CPU/gloo torch 2.13's FULL
    # optimizer state dict is unusable: it segfaults with offload_to_cpu + rank0_only, and
    # otherwise comes back with every exp_avg equal to its exp_avg_sq.)
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)
    ):
        full = {"model": model.state_dict(), "optim": _gathered(state["optim"], rank)}
    if rank == 0:
        torch.save(full, reference_path)


def _gathered(value: Any, rank: int) -> Any:
    """``value`` with every ShardedTensor gathered to rank 0 (a collective: all ranks call it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        out = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
        value.gather(dst=0, out=out)
        return out
    if isinstance(value, dict):
        return {k: _gathered(v, rank) for k, v in value.items()}
    if isinstance(value, list):
        return [_gathered(v, rank) for v in value]
    return value


def write_fsdp1_rank_files(
    path: str | os.PathLike, reference_path: str | os.PathLike, world_size: int = 2
) -> pathlib.Path:
    """FSDP1 (`device_id=cpu`) TinyLM after 2 AdamW steps; every rank `torch.save`s
    `{"model", "optim"}` under `SHARDED_STATE_DICT` (ShardedTensors) plus `{"train": {"step",
    "rank"}}` to `path/rank{N}.pt`; rank 0 saves the FULL_STATE_DICT of the same job."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _spawn(_save_fsdp1_rank_files, world_size, str(path), str(reference_path))
    return path


def _full(value: Any) -> Any:
    """`value` with every DTensor gathered to a full tensor (a collective: all ranks call it)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _save_fsdp2_rank_files(rank: int, world_size: int, path: str, reference_path: str) -> None:
    """Rank body of `write_fsdp2_rank_files`."""
    from torch.distributed.fsdp import fully_shard

    from ckptkit.examples import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))
    for module in [*model.blocks, model.adapter, model]:
        fully_shard(module, mesh=mesh)
    optimizer = _train_tiny_lm(model, rank)
    hsdp_mesh = init_device_mesh("cpu", (1, world_size))  # (replicate, shard), as HSDP uses
    gen = torch.Generator().manual_seed(7)
    extra = {
        "columns": distribute_tensor(
            torch.randn(5, 2 * world_size + 1, generator=gen), mesh, [Shard(1)]
        ),
        "replicated": distribute_tensor(torch.randn(3, 4, generator=gen), mesh, [Replicate()]),
        "hsdp": distribute_tensor(
            torch.randn(9, 4, generator=gen), hsdp_mesh, [Replicate(), Shard(0)]
        ),
    }
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "train": {"extra": extra, "rank": rank},
    }
    torch.save(state, pathlib.Path(path) / f"rank{rank}.pt")
    bare = pathlib.Path(path).parent / "bare"  # `torch.save(model.state_dict())` alone
    bare.mkdir(exist_ok=True)
    torch.save(model.state_dict(), bare / f"rank{rank}.pt")
    full = _full(state)
    if rank == 0:
        torch.save(full, reference_path)


def write_fsdp2_rank_files(
    path: str | os.PathLike, reference_path: str | os.PathLike, world_size: int = 2
) -> pathlib.Path:
    """FSDP2 TinyLM after 2 AdamW steps; every rank `torch.save`s its DTensor `model.state_dict()`
    and `optimizer.state_dict()` plus `train.extra` DTensors sharded by columns, replicated, and on
    a 2-D (1, world_size) mesh, to `path/rank{N}.pt` (and the bare model state dict alone to
    `path/../bare/rank{N}.pt`); rank 0 saves them all gathered."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _spawn(_save_fsdp2_rank_files, world_size, str(path), str(reference_path))
    return path


def _resave_rank(rank: int, world_size: int, reference_path: str, path: str) -> None:
    """Rank body of :func:`write_resave`."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = torch.load(reference_path, weights_only=False)["model"]

    def placement(t: torch.Tensor) -> Shard:
        return Shard(1) if t.ndim == 2 and t.shape[1] % world_size == 0 else Shard(0)

    state = {
        k: distribute_tensor(v, mesh, [placement(v)]) if v.ndim else v for k, v in model.items()
    }
    dcp.save({"model": state}, storage_writer=FileSystemWriter(path))


def write_resave(
    path: str | os.PathLike, reference_path: str | os.PathLike, world_size: int
) -> None:
    """A reference model re-saved by ``dcp.save`` from ``world_size`` ranks, 2-D tensors split
    by columns where they divide (Shard(1): chunks that do not tile rows), the rest by rows."""
    _spawn(_resave_rank, world_size, str(reference_path), str(path))


def write_hf_safetensors(root: pathlib.Path, tensors: dict[str, torch.Tensor], split: int) -> dict:
    """An HF-sharded safetensors folder written by the safetensors library: the sorted names up
    to ``split`` in shard 1, the rest in shard 2, plus ``model.safetensors.index.json`` (returned)."""
    import json

    from safetensors.torch import save_file

    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:split],
        "model-00002-of-00002.safetensors": names[split:],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, root / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text("{}")
    return index


# --------------------------------------------------------------------------------------------
# A mutant copy of the fsdp2_ws2 sample: one change of each kind `ckptkit.diff` tells apart.

# keys of the mutant copy (model group of fsdp2_ws2's reference, relative to "model")
PERTURBED = "blocks.1.fc1.weight"  # one element + 0.25
CLOSE = "blocks.0.qkv.weight"  # × (1 + 2e-6): inside rtol=1e-5
REMOVED = "ln_f.bias"
ADDED = "extra.weight"
RECAST = "odd"  # float32 → bfloat16
RESHAPED = "adapter.up.bias"  # (48,) → (40,)
MUTANT_STEP = 99  # train.step of the mutant


def mutant_state(reference: dict) -> dict:
    """The ``model`` and ``train`` groups of ``reference`` (fsdp2_ws2's), with the changes above."""
    model = {k: v.clone() for k, v in reference["model"].items()}
    model[PERTURBED][3, 5] += 0.25
    model[CLOSE] = model[CLOSE] * (1 + 2e-6)
    del model[REMOVED]
    model[ADDED] = torch.ones(3, 4)
    model[RECAST] = model[RECAST].to(torch.bfloat16)
    model[RESHAPED] = model[RESHAPED][:40].clone()
    train = dict(reference["train"], step=MUTANT_STEP)
    return {"model": model, "train": train}


def write_mutant(path: str | os.PathLike, reference: dict) -> pathlib.Path:
    """A single-process `dcp.save` of `mutant_state(reference)`."""
    path = pathlib.Path(path)
    dcp.save(mutant_state(reference), storage_writer=FileSystemWriter(path))
    return path
