"""The cases of the format conformance suite (``test_conformance.py``).

A case is one real checkpoint: how to get its path, the format ckptkit must detect there, and an
oracle giving the tensors it must read. Checked-in fixtures have sha256 references written by
the project that made them; checkpoints written in the session by torch (or the safetensors
library) have the live state they were saved from. A new format adapter joins the suite by
adding a case here: every contract item in ``test_conformance.py`` then runs on it.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oracle import raw_bytes

FIXTURES = Path(__file__).parent / "fixtures"


def size_on_disk(location: str | Path, name: str) -> int:
    """The size of a checkpoint's file ``name``: beside the file or under the folder
    ``location``, or a member of the archive it names (a NeMo ``.nemo``), as tarfile reads it."""
    location = Path(location)
    if location.is_file() and tarfile.is_tarfile(location):
        with tarfile.open(location) as tar:
            return next(m.size for m in tar.getmembers() if m.name.removeprefix("./") == name)
    return (location.parent if location.is_file() else location).joinpath(name).stat().st_size


# --------------------------------------------------------------------------------------------
# Oracles.


@dataclass(frozen=True)
class Sha:
    """An expected tensor known by its fixture reference: shape, dtype and SHA-256 of its bytes."""

    shape: tuple[int, ...]
    dtype: str
    sha256: str


Expected = torch.Tensor | Sha


@dataclass(frozen=True)
class Oracle:
    """The tensors a case must read, by ckptkit key.

    ``groups`` are the top-level groups the oracle lists *every* tensor of (None: all groups);
    tensors of other groups are not known to it (e.g. OLMo's references drop the trainer RNG).
    """

    tensors: Mapping[str, Expected]
    groups: frozenset[str] | None = None
    note: str = ""


def expected_matches(actual: torch.Tensor, expected: Expected) -> str | None:
    """None when ``actual`` is bit-equal to ``expected``, else what differs."""
    dtype = str(actual.dtype).removeprefix("torch.")
    if isinstance(expected, Sha):
        if (tuple(actual.shape), dtype) != (expected.shape, expected.dtype):
            return f"shape/dtype {tuple(actual.shape)} {dtype} != {expected.shape} {expected.dtype}"
        if hashlib.sha256(raw_bytes(actual)).hexdigest() != expected.sha256:
            return "sha256 differs"
        return None
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"{tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}"
    if raw_bytes(actual) != raw_bytes(expected):
        return "bytes differ"
    return None


def sha_oracle(
    item: str, *, groups: set[str] | None = None, folder: str | None = None, note: str = ""
) -> Oracle:
    """The oracle of a fixture item from ``reference/tensors.sha256.json``: keys are relative to
    the file's group (``model.pt`` → ``model.``); ``folder`` keeps only the files listed under
    that sub-folder (``olmo_unsharded`` lists two outputs, one of them not copied)."""
    listed = json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())
    tensors: dict[str, Sha] = {}
    for file, specs in listed.items():
        if folder is not None:
            if not file.startswith(f"{folder}/"):
                continue
            file = file.removeprefix(f"{folder}/")
        group = file.split(".")[0]
        for key, spec in specs.items():
            tensors[f"{group}.{key}"] = Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
    return Oracle(tensors, frozenset(groups) if groups is not None else None, note)


def flatten_tensors(state: Any, *, walk_tuples: bool, prefix: tuple = ()) -> dict[str, Any]:
    """Every tensor leaf of a live state dict by dotted key, walked as the format flattens it:
    mappings always (keys as ``str``), lists holding tensors or containers, and tuples too
    when ``walk_tuples`` (torch.save / rank files walk them; DCP pickles a tuple whole)."""
    found: dict[str, Any] = {}

    def holds_more(values) -> bool:
        return any(
            isinstance(v, (Mapping, list, torch.Tensor)) or (walk_tuples and isinstance(v, tuple))
            for v in values
        )

    def visit(path: tuple, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[".".join(map(str, path))] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif (isinstance(value, list) or (walk_tuples and isinstance(value, tuple))) and holds_more(
            value
        ):
            for i, v in enumerate(value):
                visit((*path, i), v)

    visit(prefix, state)
    return found


def live_oracle(state: Any, *, walk_tuples: bool, prefix: tuple = (), note: str = "") -> Oracle:
    """A complete oracle from the live state a checkpoint was saved from."""
    return Oracle(flatten_tensors(state, walk_tuples=walk_tuples, prefix=prefix), None, note)


# --------------------------------------------------------------------------------------------
# Where cases come from.


class Workspace:
    """What cases need to make their paths: the session's ``written`` factory (DCP variants of
    ``writers.VARIANTS``) and a module temporary directory for checkpoints written here, each
    made once (``once``)."""

    def __init__(self, written: Callable, root: Path) -> None:
        self.written = written
        self.root = root
        self._done: dict[str, Any] = {}

    def once(self, name: str, make: Callable[[Path], Any]) -> Any:
        if name not in self._done:
            self._done[name] = make(self.root / name)
        return self._done[name]


@dataclass(frozen=True)
class Case:
    """One checkpoint of the suite: ``locate`` gives its path, ``format`` the expected adapter,
    ``oracle`` the tensors it must read (given the workspace and the path)."""

    id: str
    format: str
    locate: Callable[[Workspace], Path]
    oracle: Callable[[Workspace, Path], Oracle]
    #: whether ``Entry.path`` joined with "." spells the entry's key (every format promises it)
    key_is_joined_path: bool = True


def _fixture(rel: str) -> Callable[[Workspace], Path]:
    return lambda ws: FIXTURES / rel


def _fixture_case(
    id: str,
    format: str,
    rel: str,
    item: str,
    *,
    groups: set[str] | None = None,
    folder: str | None = None,
    note: str = "",
) -> Case:
    return Case(
        id,
        format,
        _fixture(rel),
        lambda ws, path: sha_oracle(item, groups=groups, folder=folder, note=note),
    )


def _written_case(id: str, variant: str) -> Case:
    """A DCP variant of ``writers.VARIANTS``, written once per session by the ``written`` fixture;
    its oracle is the live state saved beside it (DCP keeps tuples whole)."""
    return Case(
        id,
        "dcp",
        lambda ws: ws.written(variant).path,
        lambda ws, path: live_oracle(ws.written(variant).reference(), walk_tuples=False),
    )


# --------------------------------------------------------------------------------------------
# Per-rank files written here by torch: FSDP1 ShardedTensors, FSDP2 DTensors (tests/writers.py)
# and torch's HuggingFaceStorageWriter, all in ONE spawned 2-rank job (each spawn costs seconds).


def _hf_full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "rows": torch.randn(7, 5, generator=g),  # Shard(0): 4 + 3 rows
        "cols": torch.randn(4, 9, generator=g),  # Shard(1): 5 + 4 columns
        "half": torch.randn(5, 6, generator=g).to(torch.bfloat16),  # Shard(0), bf16
        "ids": torch.arange(11, dtype=torch.int64) * 3,  # Shard(0), 6 + 5
        "rep": torch.randn(3, generator=g),  # replicated
        "scale": torch.tensor(1.25),  # 0-d, replicated
    }


def _write_rank_files(rank: int, world_size: int, root: str) -> None:
    """Rank body: ``writers``' FSDP1 and FSDP2 rank-file jobs, then DTensors saved with
    ``HuggingFaceStorageWriter(save_distributed=True)``; rank 0 saves every live reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import writers

    writers._save_fsdp1_rank_files(rank, world_size, f"{root}/fsdp1/ckpt", f"{root}/fsdp1/full.pt")
    writers._save_fsdp2_rank_files(rank, world_size, f"{root}/fsdp2/ckpt", f"{root}/fsdp2/full.pt")

    mesh = init_device_mesh("cpu", (world_size,))
    placements = {"rows": Shard(0), "cols": Shard(1), "half": Shard(0), "ids": Shard(0)}
    state = {
        key: distribute_tensor(value, mesh, [placements.get(key, Replicate())])
        for key, value in _hf_full_state().items()
    }
    writer = HuggingFaceStorageWriter(f"{root}/hf/ckpt", save_distributed=True)
    dcp.save(state, storage_writer=writer)
    full = {key: value.full_tensor() for key, value in state.items()}
    if rank == 0:
        torch.save(full, f"{root}/hf/live.pt")


def _rank_files(ws: Workspace) -> Path:
    def make(root: Path) -> Path:
        from ckptkit.examples import _spawn  # the gloo spawner tests/writers.py uses too

        for name in ("fsdp1/ckpt", "fsdp2/ckpt", "hf"):
            (root / name).mkdir(parents=True)
        _spawn(_write_rank_files, 2, str(root))
        return root

    return ws.once("rank_files", make)


def _rank_file_case(id: str, format: str, rel: str, reference: str, select=None) -> Case:
    def oracle(ws: Workspace, path: Path) -> Oracle:
        state = torch.load(_rank_files(ws) / reference, weights_only=False)
        return live_oracle(select(state) if select else state, walk_tuples=True)

    return Case(id, format, lambda ws: _rank_files(ws) / rel, oracle)


# --------------------------------------------------------------------------------------------
# Unsharded files written here: torch.save (one file, a directory) and safetensors (one file,
# HF shards with an index).


def _torch_save_state() -> dict:
    gen = torch.Generator().manual_seed(3)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": {
            "embed": {"weight": torch.randn(5, 3, generator=gen)},
            "bf16": torch.randn(4, 2, generator=gen).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "transposed": base.t(),  # non-contiguous
            "row": base[2],  # a view into base's storage, at an offset
            "base": base,
            "channels_last": torch.randn(2, 3, 2, 2, generator=gen).to(
                memory_format=torch.channels_last
            ),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=gen)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "name": "all"}],
        },
        "train": {
            "step": 17,
            "losses": [2.5, 2.25],
            "note": "hello",
            "pair": (torch.ones(2), 5),  # a tuple holding a tensor
            "tensors": [torch.ones(2), torch.zeros(3, dtype=torch.int32)],
        },
    }


def _torch_save_file(ws: Workspace) -> Path:
    def make(root: Path) -> Path:
        root.mkdir()
        torch.save(_torch_save_state(), root / "ckpt.pt")
        return root / "ckpt.pt"

    return ws.once("torch_save_file", make)


def _torch_save_dir(ws: Workspace) -> Path:
    def make(root: Path) -> Path:
        root.mkdir()
        for group, value in _torch_save_state().items():
            torch.save(value, root / f"{group}.pt")
        return root

    return ws.once("torch_save_dir", make)


def _safetensors_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {
        "embed.weight": torch.randn(6, 4, generator=gen),
        "layers.0.attn.bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "layers.0.ids": torch.arange(9, dtype=torch.int64),
        "layers.1.mask": torch.tensor([True, False]),
        "layers.1.f64": torch.randn(2, 3, generator=gen).to(torch.float64),
        "layers.1.u8": torch.arange(5, dtype=torch.uint8),
        "scalar": torch.tensor(2.0, dtype=torch.float16),
        "empty": torch.empty(0, 3),
    }


def _safetensors_file(ws: Workspace) -> Path:
    from safetensors.torch import save_file

    def make(root: Path) -> Path:
        root.mkdir()
        save_file(_safetensors_state(), root / "weights.safetensors", metadata={"format": "pt"})
        return root / "weights.safetensors"

    return ws.once("safetensors_file", make)


def _safetensors_hf(ws: Workspace) -> Path:
    def make(root: Path) -> Path:
        root.mkdir()
        from writers import write_hf_safetensors

        write_hf_safetensors(root, _safetensors_state(), split=4)
        return root

    return ws.once("safetensors_hf", make)


# --------------------------------------------------------------------------------------------
# The cases.

_DROPS_TRAIN = "the reference lists model and optim only (OLMo drops the trainer state / RNG)"

CASES: list[Case] = [
    # checked-in fixtures (torch 2.2, OLMo 0.6.0, OLMo-core), against their sha256 references
    _fixture_case(
        "fixture-dcp-torch22", "dcp", "dcp_torch22_fsdp1_ws2/checkpoint", "dcp_torch22_fsdp1_ws2"
    ),
    _fixture_case(
        "fixture-olmo-torch-new-step",
        "olmo_dcp",
        "olmo_torch_new_ws2/step3",
        "olmo_torch_new_ws2",
        groups={"model", "optim"},
        note=_DROPS_TRAIN,
    ),
    _fixture_case(
        "fixture-olmo-torch-new-dcp",
        "dcp",
        "olmo_torch_new_ws2/step3/model_and_optim",
        "olmo_torch_new_ws2",
    ),
    _fixture_case(
        "fixture-olmo-core3-step",
        "olmo_dcp",
        "olmo_core3_trainer_ws2/step3",
        "olmo_core3_trainer_ws2",
        groups={"model", "optim"},
        note=_DROPS_TRAIN,
    ),
    _fixture_case(
        "fixture-olmo-core3-dcp",
        "dcp",
        "olmo_core3_trainer_ws2/step3/model_and_optim",
        "olmo_core3_trainer_ws2",
    ),
    _fixture_case("fixture-olmo-local", "olmo_local", "olmo_local_ws2/step3", "olmo_local_ws2"),
    _fixture_case(
        "fixture-olmo-core-v0", "olmo_core_v0", "olmo_core_v010_ws2/step3", "olmo_core_v010_ws2"
    ),
    _fixture_case(
        "fixture-olmo-unsharded-safetensors",
        "safetensors",
        "olmo_unsharded/step3-unsharded-safetensors",
        "olmo_unsharded",
        folder="step3-unsharded-safetensors",
    ),
    _fixture_case(
        "fixture-olmo-legacy",
        "rank_files",
        "olmo_torch_legacy_ws2/step3",
        "olmo_torch_legacy_ws2",
        groups={"model", "optim"},
        note=_DROPS_TRAIN,
    ),
    # DCP written by torch's own dcp.save in this session (tests/writers.py VARIANTS)
    _written_case("dcp-single-process", "single_process"),
    _written_case("dcp-fsdp2-ws2", "fsdp2_ws2"),
    _written_case("dcp-empty-chunks-ws4", "empty_chunks"),
    _written_case("dcp-no-collectives", "no_collectives"),
    _written_case("dcp-zstd", "zstd"),
    _written_case("dcp-safetensors-serialization", "safetensors_format"),
    # per-rank torch.save files and HF per-rank shards, written by torch in this module
    _rank_file_case("rank-files-fsdp1-sharded-tensor", "rank_files", "fsdp1/ckpt", "fsdp1/full.pt"),
    _rank_file_case("rank-files-fsdp2-dtensor", "rank_files", "fsdp2/ckpt", "fsdp2/full.pt"),
    _rank_file_case(
        "rank-files-fsdp2-bare-model",
        "rank_files",
        "fsdp2/bare",
        "fsdp2/full.pt",
        select=lambda full: {"model": full["model"]},
    ),
    _rank_file_case(
        "hf-dcp-sharded", "hf_dcp_sharded", "hf/ckpt", "hf/live.pt", lambda s: {"model": s}
    ),
    # unsharded files written by torch.save / the safetensors library
    Case(
        "torch-save-file",
        "torch_save",
        _torch_save_file,
        lambda ws, path: live_oracle(_torch_save_state(), walk_tuples=True, prefix=("ckpt",)),
    ),
    Case(
        "torch-save-dir",
        "torch_save",
        _torch_save_dir,
        lambda ws, path: live_oracle(_torch_save_state(), walk_tuples=True),
    ),
    Case(
        "safetensors-file",
        "safetensors",
        _safetensors_file,
        lambda ws, path: live_oracle(_safetensors_state(), walk_tuples=True, prefix=("weights",)),
    ),
    Case(
        "safetensors-hf-shards",
        "safetensors",
        _safetensors_hf,
        lambda ws, path: live_oracle(_safetensors_state(), walk_tuples=True, prefix=("model",)),
    ),
]


def _torch_save_pre16_file(ws: Workspace) -> Path:
    """The torch.save state in the pre-1.6 (non-zip) format, under a ``.ckpt`` suffix."""

    def make(root: Path) -> Path:
        root.mkdir()
        path = root / "legacy.ckpt"
        torch.save(_torch_save_state(), path, _use_new_zipfile_serialization=False)
        return path

    return ws.once("torch_save_pre16_file", make)


CASES.append(
    Case(
        "torch-save-pre16-file",
        "torch_save",
        _torch_save_pre16_file,
        lambda ws, path: live_oracle(_torch_save_state(), walk_tuples=True, prefix=("legacy",)),
    )
)


# Megatron-core torch_dist fixtures: their reference (Megatron's load_plain_tensors) is keyed by
# the stored DCP key, so it covers the ``stacked.`` group (stacked layer tensors as stored); the
# per-layer and other groups are checked against it in tests/test_formats_megatron.py.
MEGATRON_ITEMS = (
    "megatron_mcore016_gpt_tp2_ws2",
    "megatron_mcore016_gpt_dp2_ws2",
    "megatron_mcore016_gpt_tp2_bf16_ws2",
    "megatron_mcore015_gpt_tp2_ws2",
    "megatron_mcore015_gpt_dp2_ws2",
)


def _megatron_stacked_oracle(item: str) -> Oracle:
    listed = json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())
    tensors = {
        f"stacked.{key}": Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
        for key, spec in listed["reference.pt"].items()
        # stacked: ``layers.`` then a name; the <= 0.15 reformulated optimizer tensors, which
        # the reference gives flattened (1-D), stay as stored outside ``stacked``
        if ".layers." in key
        and not key.split(".layers.")[1][0].isdigit()
        and len(spec["shape"]) > 1
    }
    return Oracle(tensors, frozenset({"stacked"}), "stacked layer tensors as stored")


CASES.extend(
    Case(
        f"fixture-{item.replace('_', '-')}",
        "megatron_dist",
        _fixture(f"{item}/checkpoint"),
        lambda ws, path, item=item: _megatron_stacked_oracle(item),
    )
    for item in MEGATRON_ITEMS
)


class _ScriptedNet(torch.nn.Module):
    """A small module for ``torch.jit.script``: a nested submodule, a Sequential, buffers."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.embed = torch.nn.Embedding(6, 3)
        self.layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        self.scale = torch.nn.Parameter(torch.randn(4, generator=gen).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(ids)) * self.scale.float() + self.steps


def _torchscript_file(ws: Workspace) -> Path:
    def make(root: Path) -> Path:
        root.mkdir()
        torch.jit.save(torch.jit.script(_ScriptedNet()), root / "net.pt")
        return root / "net.pt"

    return ws.once("torchscript_file", make)


CASES.append(
    Case(
        "torchscript-file",
        "torchscript",
        _torchscript_file,  # oracle: what torch.jit.load gives back, under the file's group
        lambda ws, path: live_oracle(
            dict(torch.jit.load(path).state_dict()), walk_tuples=True, prefix=("net",)
        ),
    )
)


# DeepSpeed ZeRO fixtures (deepspeed 0.19.8): ``model.*`` against zero_to_fp32's fp32 state dict
# (BF16_Optimizer: the live fp32 masters, its converter refuses it), ``module.*`` against the
# model-state file's own tensors, ``optim.*`` against the live Adam moments and step.
DEEPSPEED_ITEMS = (
    "deepspeed_zero1_ws2",
    "deepspeed_zero2_ws2",
    "deepspeed_zero3_ws2",
    "deepspeed_zero3_ws4",
    "deepspeed_zero2_bf16_ws2",
    "deepspeed_zero3_bf16_ws2",
    "deepspeed_zero1_bf16_fp32accum_ws2",
    "deepspeed_zero2_legacy_serialization_ws2",
)


def deepspeed_oracle(item: str) -> Oracle:
    """Every ``model``, ``module`` and ``optim`` tensor of a DeepSpeed fixture, by ckptkit key.
    Stage 1 saves no frozen parameters, so ``model.*`` (like zero_to_fp32) has none: the
    BF16_Optimizer reference, made from memory, lists one, left out here."""
    reference = FIXTURES / item / "reference"
    listed = json.loads((reference / "tensors.sha256.json").read_text())
    engine = json.loads((reference / "engine_info.json").read_text())
    tensors: dict[str, Sha] = {}
    for file, specs in listed.items():
        for key, spec in specs.items():
            sha = Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
            if file.startswith("reference/fp32_model"):
                frozen_unsaved = engine["zero_stage"] == 1 and key in engine["frozen"]
                if not frozen_unsaved:
                    tensors[f"model.{key}"] = sha
            elif (
                file.endswith("model_states.pt")
                and key.startswith("module.")
                and (all(spec["shape"]) or not spec["shape"])  # not stage 3's empty placeholders
            ):
                tensors[key] = sha
    moments = json.loads((reference / "optim_reference.json").read_text())
    step = hashlib.sha256(raw_bytes(torch.tensor(float(moments["adam_step"])))).hexdigest()
    for name, stats in moments["params"].items():
        for stat in ("exp_avg", "exp_avg_sq"):
            spec = stats[stat]
            tensors[f"optim.state.{name}.{stat}"] = Sha(
                tuple(spec["shape"]), spec["dtype"], spec["sha256"]
            )
        tensors[f"optim.state.{name}.step"] = Sha((), "float32", step)
    return Oracle(tensors, frozenset({"model", "module", "optim"}), "trainer state not hashed")


CASES.extend(
    Case(
        f"fixture-{item.replace('_', '-')}",
        "deepspeed_zero",
        _fixture(f"{item}/checkpoint"),
        lambda ws, path, item=item: deepspeed_oracle(item),
    )
    for item in DEEPSPEED_ITEMS
)
CASES.append(  # the tag directory itself, opened without its run directory's ``latest``
    Case(
        "fixture-deepspeed-zero3-ws2-tag-dir",
        "deepspeed_zero",
        _fixture("deepspeed_zero3_ws2/checkpoint/global_step2"),
        lambda ws, path: deepspeed_oracle("deepspeed_zero3_ws2"),
    )
)


# --------------------------------------------------------------------------------------------
# Named per-rank files of training libraries, written here by torch's own FSDP2 (2 gloo ranks,
# one spawned job): verl's ``global_step_7/actor/{model,optim,extra_state}_world_size_2_rank_{r}.pt``
# (+ ``fsdp_config.json``, ``huggingface/config.json``, the run's
# ``latest_checkpointed_iteration.txt``) and Accelerate's FSDP ``use_dcp=False``
# ``pytorch_model_fsdp_0_rank{r}.bin`` + ``optimizer_0_rank{r}.bin`` (+ ``scheduler.bin``,
# ``random_states_{r}.pkl``), as verl's and Accelerate's save code write
# them, with other models and seeds. Each saves its live full state beside it.

VERL_STEP = 7


class _VerlLM(torch.nn.Module):
    """verl's test model shape (embed, linear layers, head), smaller and uneven (37 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(37, 20)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(20, 20) for _ in range(3))
        self.norm = torch.nn.LayerNorm(20)
        self.lm_head = torch.nn.Linear(20, 37, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.lm_head(self.norm(h))


class _AccelerateBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.c_attn = torch.nn.Linear(width, 3 * width)
        self.c_proj = torch.nn.Linear(3 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.c_proj(torch.nn.functional.gelu(self.c_attn(self.ln(h))))


class _AccelerateLM(torch.nn.Module):
    """A GPT-2-like model (blocks of LayerNorm + MLP) with an unsharded int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(29, 12)
        self.h = torch.nn.ModuleList(_AccelerateBlock(12) for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(12)
        self.register_buffer("position_ids", torch.arange(9, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.h:
            h = block(h)
        return self.ln_f(h) @ self.wte.weight.t()


def _train(model: torch.nn.Module, vocab: int, seed: int, rank: int):
    """Two AdamW steps (rank-specific batches) and a scheduler: non-trivial optimizer state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.5)
    data = torch.Generator().manual_seed(seed + rank)
    for _ in range(2):
        ids = torch.randint(vocab, (2, 9), generator=data)
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids.reshape(-1)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return optimizer, scheduler


def _sharded(model: torch.nn.Module, units) -> None:
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit)
    fully_shard(model)


def _write_library_rank_files(rank: int, world_size: int, root: str) -> None:
    """Rank body: verl's and Accelerate's per-rank layouts of FSDP2 models; rank 0 saves each
    job's full state (model and optimizer gathered by torch) beside them."""
    import random

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import writers

    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    # verl (verl/utils/checkpoint/fsdp_checkpoint_manager.py): model/optimizer state_dict()
    torch.manual_seed(21)
    model = _VerlLM()
    _sharded(model, model.layers)
    optimizer, scheduler = _train(model, 37, 500, rank)
    actor = Path(root) / "verl" / f"global_step_{VERL_STEP}" / "actor"
    (actor / "huggingface").mkdir(parents=True, exist_ok=True)
    name = f"world_size_{world_size}_rank_{rank}.pt"
    rng = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    extra = {"lr_scheduler": scheduler.state_dict(), "rng": rng}
    torch.save(model.state_dict(), actor / f"model_{name}")
    torch.save(optimizer.state_dict(), actor / f"optim_{name}")
    torch.save(extra, actor / f"extra_state_{name}")
    full = {
        "model": get_model_state_dict(model, options=full_options),
        "optim": writers._full(optimizer.state_dict()),
        "extra_state": extra,
    }
    if rank == 0:
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
        (actor / "huggingface" / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (Path(root) / "verl" / "latest_checkpointed_iteration.txt").write_text(str(VERL_STEP))
        torch.save(full, Path(root) / "verl_reference.pt")

    # Accelerate save_fsdp_model / save_fsdp_optimizer (fsdp_version=2, use_dcp=False)
    torch.manual_seed(33)
    model = _AccelerateLM()
    _sharded(model, model.h)
    optimizer, scheduler = _train(model, 29, 700, rank)
    out = Path(root) / "accelerate" / "ckpt"
    out.mkdir(parents=True, exist_ok=True)
    optim_state = get_optimizer_state_dict(model, optimizer)
    torch.save(get_model_state_dict(model), out / f"pytorch_model_fsdp_0_rank{rank}.bin")
    torch.save(optim_state, out / f"optimizer_0_rank{rank}.bin")
    torch.save({"step": 2, "cpu": torch.get_rng_state()}, out / f"random_states_{rank}.pkl")
    full = {
        "model": get_model_state_dict(model, options=full_options),
        "optim": writers._full(optim_state),
        "scheduler": scheduler.state_dict(),
    }
    if rank == 0:
        torch.save(scheduler.state_dict(), out / "scheduler.bin")
        torch.save(full, Path(root) / "accelerate_reference.pt")


def write_library_rank_files(root: Path) -> Path:
    """Spawn :func:`_write_library_rank_files` at world size 2 into ``root``; returns it."""
    from ckptkit.examples import _spawn

    root.mkdir(parents=True, exist_ok=True)
    _spawn(_write_library_rank_files, 2, str(root))
    return root


def _library_rank_files(ws: Workspace) -> Path:
    return ws.once("library_rank_files", write_library_rank_files)


def _library_case(id: str, rel: str, reference: str) -> Case:
    def oracle(ws: Workspace, path: Path) -> Oracle:
        state = torch.load(_library_rank_files(ws) / reference, weights_only=False)
        return live_oracle(state, walk_tuples=True)

    return Case(id, "rank_files", lambda ws: _library_rank_files(ws) / rel, oracle)


CASES += [
    _library_case(
        "rank-files-verl-fsdp2", f"verl/global_step_{VERL_STEP}/actor", "verl_reference.pt"
    ),
    _library_case("rank-files-accelerate-fsdp2", "accelerate/ckpt", "accelerate_reference.pt"),
]


# NeMo (tests/fixtures/generators/nemo.py): ``.nemo`` archives read in place (the torch.save
# layout against the state dict NeMo saved; the torch_dist layout, and NeMo 2's ``weights/``,
# against the Megatron fixture's reference they were copied with, as for the Megatron cases).
CASES += [
    _fixture_case("fixture-nemo-asr", "nemo", "nemo_asr/model.nemo", "nemo_asr"),
    Case(
        "fixture-nemo-megatron-dist",
        "nemo",
        _fixture("nemo_megatron_dist/model.nemo"),
        lambda ws, path: _megatron_stacked_oracle("nemo_megatron_dist"),
    ),
    Case(
        "fixture-nemo2-gpt",
        "nemo",
        _fixture("nemo2_gpt/checkpoint"),
        lambda ws, path: _megatron_stacked_oracle("nemo2_gpt"),
    ),
]


# Megatron-LM legacy --ckpt-format torch (tests/fixtures/generators/megatron_legacy.py): TP (and
# PP) rank files merged by Megatron's naming rules; the oracle is the TP=1, PP=1 model. Cases open
# the iteration folder (file paths are relative to it); test_megatron_legacy opens the run folders.
CASES += [
    _fixture_case(
        "fixture-megatron-legacy-tp2-ws2",
        "megatron_legacy",
        "megatron_legacy_tp2_ws2/run/iter_0000010",
        "megatron_legacy_tp2_ws2",
        groups={"model"},
        note="TP=2 merged against the TP=1 model (GQA, TE names, untied)",
    ),
    _fixture_case(
        "fixture-megatron-legacy-tp2-pp2-ws4",
        "megatron_legacy",
        "megatron_legacy_tp2_pp2_ws4/run/iter_0000010",
        "megatron_legacy_tp2_pp2_ws4",
        groups={"model"},
        note="TP=2 x PP=2, legacy names, tied embeddings, against the TP=1, PP=1 model",
    ),
    _fixture_case(
        "fixture-megatron-legacy-swiglu-tp2-ws2",
        "megatron_legacy",
        "megatron_legacy_swiglu_tp2_ws2/run/iter_0000010",
        "megatron_legacy_swiglu_tp2_ws2",
        groups={"model"},
        note="SwiGLU fc1 halves interleaved by rank, bf16, against the TP=1 model",
    ),
]


# DeepSpeed pipeline parallel (deepspeed 0.19.8, tests/fixtures/generators/deepspeed_pipe.py):
# ``model.*`` (the layer files, PipelineModule.state_dict() names) against every stage's
# ``engine.module.state_dict()`` after DeepSpeed's own load_checkpoint into a fresh engine,
# ``optim.fp32.*`` / ``optim.state.*`` against that engine's full fp32 params and Adam moments.
def deepspeed_pipe_oracle(item: str) -> Oracle:
    """Every ``model`` and ``optim`` tensor of a DeepSpeed pipeline fixture, by ckptkit key
    (a tied parameter's optimizer state from the first stage holding it; all stages agree)."""
    reference = FIXTURES / item / "reference"
    listed = json.loads((reference / "tensors.sha256.json").read_text())
    tensors: dict[str, Sha] = {}
    for key, spec in listed["reference/module_state_dict.pt"].items():
        tensors[f"model.{key}"] = Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
    moments = json.loads((reference / "optim_reference.json").read_text())
    step = hashlib.sha256(raw_bytes(torch.tensor(float(moments["adam_step"])))).hexdigest()
    for name, by_stage in moments["params"].items():
        stats = by_stage[min(by_stage, key=int)]
        for stat, key in (
            ("fp32", f"optim.fp32.{name}"),
            ("exp_avg", f"optim.state.{name}.exp_avg"),
            ("exp_avg_sq", f"optim.state.{name}.exp_avg_sq"),
        ):
            spec = stats[stat]
            tensors[key] = Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
        tensors[f"optim.state.{name}.step"] = Sha((), "float32", step)
    return Oracle(tensors, frozenset({"model", "optim"}), "trainer state not hashed")


CASES += [
    Case(
        "fixture-deepspeed-pipe-ws2",
        "deepspeed_zero",
        _fixture("deepspeed_pipe_ws2/checkpoint"),
        lambda ws, path: deepspeed_pipe_oracle("deepspeed_pipe_ws2"),
    ),
    Case(  # the tag directory itself, without the run directory's ``latest``
        "fixture-deepspeed-pipe-ws2-tag-dir",
        "deepspeed_zero",
        _fixture("deepspeed_pipe_ws2/checkpoint/global_step2"),
        lambda ws, path: deepspeed_pipe_oracle("deepspeed_pipe_ws2"),
    ),
]


# Trainer output layouts (tests/fixtures/generators/: accelerate_save_state.py, torchtitan_like.py,
# lightning_ckpt.py, composer_like.py, hf_save_pretrained.py), against the library's own load;
# where the layout keeps its model under another key (Lightning's ``state_dict``, Composer's
# ``state.model``, HF's ``pytorch_model``, a flat-key DCP) the oracle lists the group ``model``.


def _flat_sha_oracle(item: str) -> Oracle:
    """A flat-key DCP's reference (``model.safetensors``: the model's own keys), by ckptkit key,
    which is the stored key itself (no ``model.`` level in the checkpoint)."""
    listed = json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())
    tensors = {
        key: Sha(tuple(spec["shape"]), spec["dtype"], spec["sha256"])
        for key, spec in listed["model.safetensors"].items()
    }
    return Oracle(tensors, frozenset({"model"}), "the model's own keys, one group model")


_MODEL_ONLY = "the reference is the library's own load of the model; the rest is not hashed"

CASES += [
    _fixture_case(
        "fixture-accelerate-fsdp2-sharded",
        "accelerate",
        "accelerate_fsdp2_sharded_ws2/checkpoint",
        "accelerate_fsdp2_sharded_ws2",
        groups={"model"},
        note=_MODEL_ONLY,
    ),
    Case(
        "fixture-torchtitan-flat-dcp",
        "dcp",
        _fixture("torchtitan_flat_dcp_ws2/step-20"),
        lambda ws, path: _flat_sha_oracle("torchtitan_flat_dcp_ws2"),
    ),
    _fixture_case(
        "fixture-lightning-ckpt",
        "torch_save",
        "lightning_ckpt/last.ckpt",
        "lightning_ckpt",
        groups={"model"},
        note=_MODEL_ONLY,
    ),
    _fixture_case(
        "fixture-composer-mono",
        "torch_save",
        "composer_mono/ep0-ba10-rank0.pt",
        "composer_mono",
        groups={"model"},
        note=_MODEL_ONLY,
    ),
    _fixture_case(
        "fixture-composer-sharded",
        "dcp",
        "composer_sharded_ws2/ep0-ba10",
        "composer_sharded_ws2",
        groups={"model"},
        note=_MODEL_ONLY,
    ),
    _fixture_case(
        "fixture-hf4-bin-sharded",
        "torch_save",
        "hf_save_pretrained_v4/bin_sharded",
        "hf_save_pretrained_v4",
        folder="bin_sharded",
    ),
    _fixture_case(
        "fixture-hf4-safetensors-sharded",
        "safetensors",
        "hf_save_pretrained_v4/st_sharded",
        "hf_save_pretrained_v4",
        folder="st_sharded",
    ),
    _fixture_case(
        "fixture-hf5-safetensors-sharded",
        "safetensors",
        "hf_save_pretrained_v5/st_sharded",
        "hf_save_pretrained_v5",
        folder="st_sharded",
    ),
]


# NeMo tensor-parallel .nemo (tests/fixtures/generators/nemo.py, nemo_megatron_tp2): the TP=2 ranks
# merged by Megatron's naming rules against the TP=1 tensors they were split from.
CASES += [
    Case(
        "fixture-nemo-megatron-tp2",
        "nemo",
        _fixture("nemo_megatron_tp2/model.nemo"),
        lambda ws, path: sha_oracle(
            "nemo_megatron_tp2",
            note="TP=2 ranks merged against the TP=1 model they were split from",
        ),
    ),
]
