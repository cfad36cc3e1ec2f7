"""Write realistic sample checkpoints with torch's own distributed checkpoint (DCP) code.

Used by the README demo, notebooks and the test-suite, so that ckptkit is always exercised
on files that torch itself wrote; :func:`sample_checkpoint` writes the notebooks' sample once
and reuses it. Importing this module imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import math
import os
import pathlib
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

__all__ = [
    "VOCAB",
    "DIM",
    "SEQ_LEN",
    "BATCH",
    "LR",
    "BETAS",
    "TinyLM",
    "write_sample",
    "SAMPLES_ENV",
    "samples_directory",
    "sample_checkpoint",
    "scratch_directory",
    "sample_workspace",
    "write_run",
]

VOCAB = 131
DIM = 48
SEQ_LEN = 12
BATCH = 4
LR = 1e-3
BETAS = (0.9, 0.999)


class _Block(nn.Module):
    """A pre-norm transformer block: single-head causal attention plus an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class _Adapter(nn.Module):
    """A bfloat16 bottleneck adapter; casts its input to bf16 and its output back."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(DIM, 20, dtype=torch.bfloat16)
        self.up = nn.Linear(20, DIM, dtype=torch.bfloat16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(F.gelu(self.down(h.to(torch.bfloat16)))).to(h.dtype)


class TinyLM(nn.Module):
    """A tiny language model whose state dict covers the awkward cases a checkpoint reader meets.

    Uneven parameter shapes (`odd`, vocab 131), a bfloat16 submodule (`adapter`), and
    float32 / int64 / 0-d buffers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the output head
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.adapter = _Adapter()
        self.ln_f = nn.LayerNorm(DIM)
        self.odd = nn.Parameter(0.02 * torch.randn(37, 19))
        self.register_buffer("temperature", torch.tensor(1.25))
        self.register_buffer("position_ids", torch.arange(SEQ_LEN))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(torch.arange(DIM // 2) * (-math.log(1e4) / (DIM // 2)))
        angles = self.position_ids[: tokens.shape[1], None].float() * freqs
        h = self.embed(tokens) + torch.cat([angles.sin(), angles.cos()], dim=-1)
        for block in self.blocks:
            h = block(h)
        h = h + self.adapter(h) + self.odd.mean()
        return self.ln_f(h) @ self.embed.weight.t() / self.temperature


def _run_rank(
    rank: int, fn: Callable[..., None], world_size: int, store_path: str, args: tuple
) -> None:
    """Entry point of one spawned rank: join a gloo process group, run `fn`, always tear down.

    Ranks meet through a file store rather than a TCP port picked in advance, which another
    process could take between the pick and the bind; gloo then talks over loopback.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    faulthandler.enable()  # a native abort in gloo/torch still prints where it happened
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except CheckpointException as exc:
        # A BaseException, which torch's spawn wrapper would not report back to the parent.
        raise RuntimeError(str(exc)) from exc
    finally:
        dist.destroy_process_group()
    # Done, its files closed: end here rather than in interpreter shutdown, where objects torch
    # still holds (device meshes, DTensors' groups) are destroyed while gloo's threads may still
    # need the interpreter, and the process can abort ("terminate called without an active
    # exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes sharing a gloo group.

    `fn` must be a top-level function of an importable module (it is pickled by reference).
    A rank killed by a signal (gloo aborted now and then at interpreter exit on a loaded machine,
    before ranks ended by `os._exit`) gets one more try with fresh processes: `fn` must be safe
    to repeat.
    """
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="ckptkit-spawn-") as scratch:
            try:
                mp.spawn(
                    _run_rank,
                    args=(fn, world_size, os.path.join(scratch, "store"), args),
                    nprocs=world_size,
                    join=True,
                    start_method="spawn",
                )
                return
            except ProcessExitedException as exc:
                if attempt == 0 and exc.signal_name is not None:
                    warnings.warn(f"{fn.__qualname__}: {exc}; trying once more", stacklevel=2)
                    continue
                error: ProcessException = exc
            except ProcessException as exc:
                error = exc
        raise RuntimeError(
            f"{fn.__qualname__} failed in a spawned rank (world_size={world_size}):\n{error}"
        ) from error


def _train_and_save(
    rank: int,
    world_size: int,
    path: str,
    steps: int,
    seed: int,
    shard_dim: int,
    use_collectives: bool,
    writer_kwargs: dict[str, Any],
    reference_path: str | None,
) -> None:
    """Rank body of `write_sample`: build, FSDP2-shard and train TinyLM, then save it with DCP."""
    torch.manual_seed(seed)  # same initial weights on every rank
    model = _sharded_model(world_size, shard_dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.01)
    losses = _train(model, optimizer, rank, world_size, steps, seed)
    train = {
        "step": steps,
        "epoch": 0,
        "tokens_seen": steps * world_size * BATCH * SEQ_LEN,
        "losses": losses,
        "run_name": "sample",
        "config": {"lr": LR, "betas": BETAS},
    }
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_sd, "optim": optim_sd, "train": train},
        storage_writer=FileSystemWriter(path, **writer_kwargs),
        use_collectives=use_collectives,
    )

    if reference_path is not None:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_full, optim_full = get_state_dict(model, optimizer, options=full)
        if rank == 0:
            torch.save({"model": model_full, "optim": optim_full, "train": train}, reference_path)


def _sharded_model(world_size: int, shard_dim: int) -> TinyLM:
    """A TinyLM with its blocks, adapter and root FSDP2-sharded over all ranks along
    `shard_dim` (dim 0 for parameters that cannot split evenly along it)."""
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))

    def placement(param: nn.Parameter) -> Shard:
        # FSDP2 only pads uneven shards on dim 0; other dims must exist and divide evenly.
        fits = param.ndim > shard_dim and param.shape[shard_dim] % world_size == 0
        return Shard(shard_dim if fits else 0)

    shard_kwargs: dict[str, Any] = {"mesh": mesh}
    if shard_dim != 0:
        shard_kwargs["shard_placement_fn"] = placement
    for module in [*model.blocks, model.adapter, model]:
        fully_shard(module, **shard_kwargs)
    return model


def _train(
    model: TinyLM,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    steps: int,
    seed: int,
) -> list[float]:
    """Train for `steps` steps on random tokens; the loss of each step averaged over ranks."""
    data = torch.Generator().manual_seed(seed * 1000 + rank + 1)  # each rank sees its own batches
    losses = []
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (BATCH, SEQ_LEN + 1), generator=data)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.num_updates += 1
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # identical trainer state on every rank
        losses.append(mean_loss.item() / world_size)
    return losses


def write_sample(
    path: str | os.PathLike,
    *,
    world_size: int = 2,
    steps: int = 2,
    seed: int = 0,
    shard_dim: int = 0,
    use_collectives: bool = True,
    compression: str | None = None,
    serialization: str = "torch_save",
    thread_count: int = 1,
    reference_path: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Train a tiny model for `steps` AdamW steps under FSDP2 on gloo/CPU at `world_size` ranks
    and save it with torch.distributed.checkpoint (DCP) to `path`.

    The checkpoint holds `{"model", "optim", "train"}`; `train` is plain python trainer state.
    With `reference_path`, rank 0 also `torch.save`s the same state gathered to full tensors.
    """
    writer_kwargs: dict[str, Any] = {"thread_count": thread_count}
    if compression == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        writer_kwargs["_extensions"] = [ZStandard()]
    elif compression is not None:
        raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
    if serialization == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        writer_kwargs["serialization_format"] = SerializationFormat.SAFETENSORS
    elif serialization != "torch_save":
        raise ValueError(
            f"serialization must be 'torch_save' or 'safetensors', got {serialization!r}"
        )

    path = pathlib.Path(path)
    _spawn(
        _train_and_save,
        world_size,
        str(path),
        steps,
        seed,
        shard_dim,
        use_collectives,
        writer_kwargs,
        None if reference_path is None else str(reference_path),
    )
    return path


#: Environment variable naming the directory :func:`sample_checkpoint` keeps its samples in
#: (a test session or CI sets it to a temporary directory it removes afterwards).
SAMPLES_ENV = "CKPTKIT_SAMPLES"


def samples_directory() -> pathlib.Path:
    """Where :func:`sample_checkpoint` keeps samples: ``$CKPTKIT_SAMPLES`` if set, else a
    per-user cache directory (``$XDG_CACHE_HOME/ckptkit/samples``, ``~/.cache/...``)."""
    configured = os.environ.get(SAMPLES_ENV)
    if configured:
        return pathlib.Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "ckptkit" / "samples"


def sample_checkpoint(*, steps: int = 2, world_size: int = 2, seed: int = 0) -> pathlib.Path:
    """The sample checkpoint (:func:`write_sample` with these settings), written once into
    :func:`samples_directory` and reused by every later call, in any process.

    Notebooks run on it when given no checkpoint of their own. Writers take a file lock, so two
    processes never write the same sample at once; a sample is written in a scratch directory
    and renamed into place when complete, so a half-written one is never returned. The full
    state dict the training job held is saved next to it, as ``path.parent / "reference.pt"``.
    """
    root = samples_directory()
    root.mkdir(parents=True, exist_ok=True)
    name = f"fsdp2-ws{world_size}-steps{steps}-seed{seed}-torch{torch.__version__}"
    final = root / name
    if not final.is_dir():
        with _file_lock(root / f".{name}.lock"):
            if not final.is_dir():  # another process may have written it while we waited
                scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
                try:
                    write_sample(
                        scratch / "checkpoint",
                        world_size=world_size,
                        steps=steps,
                        seed=seed,
                        reference_path=scratch / "reference.pt",
                    )
                    os.rename(scratch, final)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)  # gone already when renamed
    return final / "checkpoint"


def scratch_directory(prefix: str = "ckptkit-") -> pathlib.Path:
    """A new empty directory for a notebook's outputs, inside :func:`samples_directory` when
    ``$CKPTKIT_SAMPLES`` is set (so a test session removes it with the samples), else in the
    system's temporary directory. The caller removes it when done."""
    parent = os.environ.get(SAMPLES_ENV) or None
    if parent is not None:
        pathlib.Path(parent).mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


@contextlib.contextmanager
def sample_workspace() -> Iterator[pathlib.Path]:
    """Point :func:`sample_checkpoint` (in this process and every process started inside the
    block, e.g. notebook kernels) at a fresh temporary directory, removed on exit. When
    ``$CKPTKIT_SAMPLES`` is already set, that directory is used and left alone."""
    if os.environ.get(SAMPLES_ENV):
        yield pathlib.Path(os.environ[SAMPLES_ENV])
        return
    workspace = pathlib.Path(tempfile.mkdtemp(prefix="ckptkit-samples-"))
    os.environ[SAMPLES_ENV] = str(workspace)
    try:
        yield workspace
    finally:
        os.environ.pop(SAMPLES_ENV, None)
        shutil.rmtree(workspace, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (``flock``) for the block; released when the
    process dies, so a crashed writer never blocks the next one."""
    import fcntl

    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _train_and_save_steps(
    rank: int, world_size: int, path: str, steps: list[int], seed: int
) -> None:
    """Rank body of `write_run`: one FSDP2 training job saving a DCP checkpoint per step."""
    torch.manual_seed(seed)
    model = _sharded_model(world_size, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.01)
    losses: list[float] = []
    for step in range(1, max(steps) + 1):
        losses += _train(model, optimizer, rank, world_size, 1, seed * 100_000 + step)
        if step not in steps:
            continue
        train = {"step": step, "losses": list(losses), "run_name": "run", "config": {"lr": LR}}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "train": train},
            storage_writer=FileSystemWriter(os.path.join(path, f"step{step}")),
        )


def write_run(
    path: str | os.PathLike,
    *,
    steps: tuple[int, ...] | list[int] = (1, 2, 3),
    world_size: int = 2,
    seed: int = 0,
) -> pathlib.Path:
    """A run folder as a training job leaves it: TinyLM trained with AdamW under FSDP2 on
    gloo/CPU at `world_size` ranks, saved with DCP into `path/step{N}` at each of `steps`
    (a new batch every step, so weights and optimizer moments move between checkpoints)."""
    wanted = sorted(set(steps))
    if not wanted or wanted[0] < 1:
        raise ValueError(f"steps must be positive step numbers, got {steps!r}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _spawn(_train_and_save_steps, world_size, str(path), wanted, seed)
    return path


def _main() -> None:
    """Command line entry: `python -m ckptkit.examples PATH [options]`."""
    parser = argparse.ArgumentParser(description=write_sample.__doc__)
    parser.add_argument("path")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-dim", type=int, default=0)
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--compression", choices=["zstd"])
    parser.add_argument("--serialization", choices=["torch_save", "safetensors"])
    parser.add_argument("--thread-count", type=int, default=1)
    parser.add_argument("--reference-path")
    ns = parser.parse_args()

    # Import by module name so spawned ranks pickle `ckptkit.examples._train_and_save`,
    # not a function of `__main__`.
    from .examples import write_sample as write

    out = write(
        ns.path,
        world_size=ns.world_size,
        steps=ns.steps,
        seed=ns.seed,
        shard_dim=ns.shard_dim,
        use_collectives=not ns.no_collectives,
        compression=ns.compression,
        serialization=ns.serialization or "torch_save",
        thread_count=ns.thread_count,
        reference_path=ns.reference_path,
    )
    print(out)


if __name__ == "__main__":
    _main()
