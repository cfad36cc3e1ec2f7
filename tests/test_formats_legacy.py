"""Per-rank ``rank{N}.pt`` files (OLMo legacy, FSDP1 ShardedTensors, FSDP2 DTensors) and OLMo /
OLMo-core step directories, each opened as one checkpoint and checked against the references
their own projects made (sha256) or the full state gathered in the writing job."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.decoding.unpickler import is_opaque
from ckptkit.formats import olmo_core_v0, olmo_dcp, olmo_local, rank_files

from isolated import run_script
from oracle import assert_bit_equal, assert_matches_sha256, raw_bytes
from writers import write_fsdp1_rank_files, write_fsdp2_rank_files

FIXTURES = Path(__file__).parent / "fixtures"
LEGACY = FIXTURES / "olmo_torch_legacy_ws2"
TORCH_NEW = FIXTURES / "olmo_torch_new_ws2"
OLMO_CORE = FIXTURES / "olmo_core3_trainer_ws2"


def _reference(item: Path) -> dict:
    return json.loads((item / "reference" / "tensors.sha256.json").read_text())


def _lookup(state, path):
    """``state`` walked by a catalog path (dict keys compared as strings, as flattening spells them)."""
    for part in path:
        if isinstance(state, dict):
            state = state[part] if part in state else {str(k): v for k, v in state.items()}[part]
        else:
            state = state[part]
    return state


def _assert_reads_match(ckpt: ckptkit.Checkpoint, reference: dict) -> int:
    count = 0
    for entry in ckpt.catalog.tensors():
        assert_bit_equal(ckpt.read(entry.key), _lookup(reference, entry.path), entry.key)
        count += 1
    return count


def _walk(value, prefix=""):
    """Dotted keys of every tensor in a loaded state (as tensors.sha256.json spells them)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{prefix}{k}.")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{prefix}{i}.")
    elif torch.is_tensor(value):
        yield prefix[:-1], value


def _assert_file_matches_sha256(path: Path, expected: dict) -> None:
    state = torch.load(path, weights_only=True)
    found = dict(_walk(state))
    assert found.keys() == expected.keys(), path.name
    for key, spec in expected.items():
        tensor = found[key]
        assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [
            spec["shape"],
            spec["dtype"],
        ], key
        assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key


def _plain(value):
    """Trainer state with paths as strings (ckptkit decodes pathlib objects to str)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return str(value) if isinstance(value, os.PathLike) else value


# --------------------------------------------------------------------------------------------
# OLMo "legacy" (torch_legacy) rank files.


def test_olmo_legacy_rank_files_match_olmos_unsharder():
    ckpt = ckptkit.open(str(LEGACY / "step3"))
    assert ckpt.format == "rank_files"
    assert ckpt.catalog.facts.world_size == 2
    assert ckpt.catalog.facts.sharding == "ShardedTensor"
    assert ckpt.catalog.files == ("rank0.pt", "rank1.pt")
    reference = _reference(LEGACY)
    expected = {
        f"{file.split('.')[0]}.{key}": (spec["dtype"], tuple(spec["shape"]))
        for file, tensors in reference.items()
        for key, spec in tensors.items()
    }
    tensors = ckpt.tensors.set_index("key")
    model_optim = tensors[tensors["group"].isin(["model", "optim"])]
    assert {k: (r["dtype"], r["shape"]) for k, r in model_optim.iterrows()} == expected
    assert assert_matches_sha256(ckpt, LEGACY / "reference" / "tensors.sha256.json") == 116

    # FSDP1 dim-0 shards, uneven over two ranks: global offsets from ShardMetadata
    wte = ckpt.chunks[ckpt.chunks["key"] == "model.transformer.wte.weight"].sort_values("rank")
    assert wte["offsets"].tolist() == [(0, 0), (66, 0)]
    assert wte["sizes"].tolist() == [(66, 48), (65, 48)]
    assert wte["file"].tolist() == ["rank0.pt", "rank1.pt"]
    # a per-rank plain tensor: one entry, both ranks' copies as chunks
    step = ckpt.chunks[ckpt.chunks["key"] == "optim.state.transformer.wte.weight.step"]
    assert step["rank"].tolist() == [0, 1] and ckpt.entry(step["key"].iloc[0]).n_chunks == 1

    # trainer state spread at the top level of each rank file → group train
    assert ckpt.read_object("train.global_step") == 3
    assert ckpt.read_object("train.checkpoints") == ["runs/ckptkit-fixture-olmo06/step3"]
    assert ckpt.read_object("optim.param_groups.0.lr") == 0.003
    assert torch.equal(ckpt.read("train.rng.torch", rank=1), ckpt.read("train.rng.torch"))
    assert ckpt.objects.set_index("key").loc["train.global_step", "rank"] == 0
    with pytest.raises(ckptkit.KeyNotFoundError, match="only a shard"):
        ckpt.read("model.transformer.wte.weight", rank=1)

    assert ckpt.config["sharded_checkpointer"] == "torch_legacy"
    row = ckpt.config_table.set_index("key").loc["model.d_model", "value"]
    assert row == 48


def test_unshard_legacy_gives_olmos_model_optim_train_split(tmp_path):
    result = ckptkit.unshard(str(LEGACY / "step3"), str(tmp_path / "out"), progress=False)
    assert sorted(f.name for f in result.files) == ["model.pt", "optim.pt", "train.pt"]
    reference = _reference(LEGACY)
    for name in ("model.pt", "optim.pt"):
        _assert_file_matches_sha256(tmp_path / "out" / name, reference[name])
    optim = torch.load(tmp_path / "out" / "optim.pt", weights_only=True)
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.05, 0.0]
    assert optim["param_groups"][0]["params"][0] == "transformer.blocks.0.att_proj.weight"
    # train.pt = rank 0's trainer state; OLMo's unsharder drops rng, ckptkit keeps it
    ours = torch.load(tmp_path / "out" / "train.pt", weights_only=False)
    olmos = torch.load(LEGACY / "reference" / "train.pt", weights_only=False)
    assert set(ours) - set(olmos) == {"rng"}
    assert {k: v for k, v in ours.items() if k != "rng"} == _plain(olmos)


# --------------------------------------------------------------------------------------------
# OLMo torch_new and OLMo-core step directories.


def test_olmo_torch_new_step_directory_is_one_checkpoint(tmp_path):
    step = TORCH_NEW / "step3"
    ckpt = ckptkit.open(str(step))
    assert ckpt.format == "olmo_dcp" and ckpt.url.endswith("step3")
    assert ckpt.catalog.facts.layout == "OLMo torch_new"
    assert ckpt.catalog.facts.unfinished is None
    assert ckpt.catalog.files == (
        "model_and_optim/__0_0.distcp",
        "model_and_optim/__1_0.distcp",
        "train/rank0.pt",
        "train/rank1.pt",
    )
    assert assert_matches_sha256(ckpt, TORCH_NEW / "reference" / "tensors.sha256.json") == 116
    dcp_keys = set(ckptkit.open(str(step / "model_and_optim")).keys())
    train = torch.load(step / "train" / "rank0.pt", weights_only=False)
    assert set(ckpt.keys()) == dcp_keys | {f"train.{k}" for k in train if k != "rng"} | {
        "train.rng.python",
        "train.rng.numpy",
        "train.rng.torch",
    }
    assert ckpt.read_object("train.global_step") == train["global_step"] == 3
    assert ckpt.read_object("train.rng.python", rank=1) == train["rng"]["python"]
    assert torch.equal(ckpt.read("train.rng.torch"), train["rng"]["torch"])
    rng = ckpt.objects.set_index("key").loc[["train.rng.python"]]
    assert list(rng["file"]) == ["train/rank0.pt"]  # the table previews the copy reads return
    assert ckpt.config["sharded_checkpointer"] == "torch_new"


def test_unshard_torch_new_matches_the_legacy_split_of_the_same_job(tmp_path):
    """OLMo has no unsharder for torch_new (OLMo #838); the same job's legacy checkpoint was
    unsharded by OLMo itself, so that split is the reference for all three files."""
    out = tmp_path / "out"
    ckptkit.unshard(str(TORCH_NEW / "step3"), str(out), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.pt", "optim.pt", "train.pt"]
    for reference in (_reference(TORCH_NEW), _reference(LEGACY)):
        for name in ("model.pt", "optim.pt"):
            _assert_file_matches_sha256(out / name, reference[name])
    ours = torch.load(out / "train.pt", weights_only=False)
    olmos = torch.load(LEGACY / "reference" / "train.pt", weights_only=False)
    assert {k: v for k, v in ours.items() if k != "rng"} == _plain(olmos)


def test_olmo_core_step_directory_with_trainer_state_and_config():
    step = OLMO_CORE / "step3"
    ckpt = ckptkit.open(str(step))
    assert ckpt.format == "olmo_dcp"
    facts = ckpt.catalog.facts
    assert facts.layout == "OLMo-core" and facts.olmo_core_metadata["version"] == "3.0.0"
    assert facts.rank_files == ("train/rank0.pt", "train/rank1.pt")
    assert facts.metadata_files == ("model_and_optim/.metadata", ".metadata.json")
    assert assert_matches_sha256(ckpt, OLMO_CORE / "reference" / "tensors.sha256.json") == 84
    train = torch.load(step / "train" / "rank0.pt", weights_only=False)
    assert ckpt.read_object("train.global_step") == train["global_step"] == 3
    assert ckpt.read_object("train.data_loader.seed") == train["data_loader"]["seed"]
    assert torch.equal(ckpt.read("train.rng.torch.state"), train["rng"]["torch"]["state"])
    assert ckpt.config["run_name"] == "ckptkit-fixture-olmo-core3"
    table = ckpt.config_table.set_index("key")["value"]
    assert table["model.d_model"] == 48 and table["run_name"] == "ckptkit-fixture-olmo-core3"
    assert ckpt.summary().by_group.loc["train", "tensors"] == 1


def _copy(src: Path, dst: Path, *, without: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*without) if without else None)
    return dst


def test_unfinished_saves_open_with_a_reason_and_a_warning(tmp_path):
    tmp_dir = _copy(TORCH_NEW / "step3", tmp_path / "step3-tmp")
    with pytest.warns(UserWarning, match=r"step3-tmp.*unfinished"):
        ckpt = ckptkit.open(str(tmp_dir))
    assert "step3-tmp" in ckpt.catalog.facts.unfinished
    assert ckpt.read_object("train.global_step") == 3

    no_marker = _copy(OLMO_CORE / "step3", tmp_path / "core" / "step3", without=(".metadata.json",))
    with pytest.warns(UserWarning, match=r"core/step3.*\.metadata\.json"):
        ckpt = ckptkit.open(str(no_marker))
    assert "completion marker" in ckpt.catalog.facts.unfinished
    assert len(ckpt.catalog.tensors()) == 85

    no_dcp = _copy(TORCH_NEW / "step3", tmp_path / "nodcp" / "step3")
    (no_dcp / "model_and_optim" / ".metadata").unlink()
    with pytest.warns(UserWarning, match=r"model_and_optim/\.metadata is missing"):
        ckpt = ckptkit.open(str(no_dcp))
    assert {e.group for e in ckpt.catalog.entries.values()} == {"train"}

    legacy_tmp = _copy(LEGACY / "step3", tmp_path / "legacy" / "step3-tmp")
    with pytest.warns(UserWarning, match="step3-tmp"):
        ckpt = ckptkit.open(str(legacy_tmp))
    assert "step3-tmp" in ckpt.catalog.facts.unfinished


def test_missing_and_duplicated_ranks_are_named(tmp_path):
    missing = _copy(LEGACY / "step3", tmp_path / "missing", without=("rank1.pt",))
    with pytest.raises(ckptkit.FormatError, match=r"missing/rank1\.pt: missing; world size 2"):
        ckptkit.open(str(missing))

    copied = _copy(LEGACY / "step3", tmp_path / "copied")
    shutil.copy(copied / "rank0.pt", copied / "rank1.pt")
    with pytest.raises(ckptkit.FormatError, match=r"copied/rank1\.pt: holds rank 0's"):
        ckptkit.open(str(copied))

    twice = _copy(LEGACY / "step3", tmp_path / "twice")
    shutil.copy(twice / "rank1.pt", twice / "rank01.pt")
    with pytest.raises(ckptkit.FormatError, match=r"twice/rank1\.pt: rank 1 is also rank01\.pt"):
        ckptkit.open(str(twice))

    step = _copy(OLMO_CORE / "step3", tmp_path / "core")
    (step / "train" / "rank1.pt").unlink()
    with pytest.raises(ckptkit.FormatError, match=r"train/rank1\.pt missing"):
        ckptkit.open(str(step))


# --------------------------------------------------------------------------------------------
# Rank files written here by torch 2.13: FSDP1 ShardedTensors and FSDP2 DTensors.


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp1")
    write_fsdp1_rank_files(root / "ckpt", root / "full.pt")
    return root


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    write_fsdp2_rank_files(root / "ckpt", root / "full.pt")
    return root


def test_fsdp1_sharded_state_dict_rank_files_equal_the_full_state_dict(fsdp1, tmp_path):
    """Model: FULL_STATE_DICT of the same job; optimizer: torch's ShardedTensor.gather() of the
    saved shards (torch 2.13's FULL optimizer state dict is broken on CPU, see writers.py)."""
    ckpt = ckptkit.open(str(fsdp1 / "ckpt"))
    assert ckpt.format == "rank_files" and ckpt.catalog.facts.sharding == "ShardedTensor"
    full = torch.load(fsdp1 / "full.pt", weights_only=False)
    n_model = len(full["model"])
    n_optim = sum(torch.is_tensor(v) for s in full["optim"]["state"].values() for v in s.values())
    assert _assert_reads_match(ckpt, full) == n_model + n_optim == len(ckpt.catalog.tensors())
    assert {e.key for e in ckpt.catalog.select(groups="model")} == {
        f"model.{k}" for k in full["model"]
    }
    odd = ckpt.chunks[ckpt.chunks["key"] == "model.odd"].sort_values("rank")
    assert odd["sizes"].tolist() == [(19, 19), (18, 19)]  # 37 rows, torch.chunk over 2 ranks
    assert ckpt.read_object("train.rank") == 0 and ckpt.read_object("train.rank", rank=1) == 1
    groups = ckpt.read_object("optim.param_groups.0.betas")
    assert groups == full["optim"]["param_groups"][0]["betas"] == (0.85, 0.97)

    out = tmp_path / "out"
    ckptkit.unshard(ckpt, str(out), progress=False)
    model = torch.load(out / "model.pt", weights_only=True)
    for key, tensor in full["model"].items():
        assert_bit_equal(model[key], tensor, key)


def test_fsdp2_dtensor_rank_files_equal_the_gathered_state(fsdp2):
    ckpt = ckptkit.open(str(fsdp2 / "ckpt"))
    assert ckpt.format == "rank_files" and ckpt.catalog.facts.sharding == "DTensor"
    full = torch.load(fsdp2 / "full.pt", weights_only=False)
    n_model = len(full["model"])
    assert _assert_reads_match(ckpt, full) == len(ckpt.catalog.tensors()) > n_model
    chunks = ckpt.chunks.set_index(["key", "rank"])
    assert chunks.loc[("train.extra.columns", 1), "offsets"] == (0, 3)  # Shard(1): 5 = 3 + 2
    assert chunks.loc[("train.extra.hsdp", 1), "offsets"] == (5, 0)  # (Replicate, Shard(0))
    assert ckpt.entry("train.extra.replicated").n_chunks == 1  # both ranks hold the same box
    assert ckpt.read_object("optim.param_groups.0.lr") == 2e-3
    assert ckpt.read_object("train.rank", rank=1) == 1


def test_bare_state_dicts_group_as_model_or_train(fsdp2):
    """Per-rank files of a bare ``model.state_dict()`` (DTensors) are the model; a bare dict
    without sharded tensors (OLMo's ``train/rank{N}.pt`` on its own) is trainer state."""
    ckpt = ckptkit.open(str(fsdp2 / "bare"))
    full = torch.load(fsdp2 / "full.pt", weights_only=False)
    assert set(ckpt.keys()) == {f"model.{k}" for k in full["model"]}
    assert _assert_reads_match(ckpt, full) == len(full["model"])

    ckpt = ckptkit.open(str(TORCH_NEW / "step3" / "train"))
    assert ckpt.format == "rank_files" and ckpt.catalog.facts.world_size == 2
    assert {e.group for e in ckpt.catalog.entries.values()} == {"train"}
    assert ckpt.read_object("train.global_step") == 3


# --------------------------------------------------------------------------------------------
# Hostile rank files: nothing runs.


class _Payload:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _hostile_set(directory: Path, evil) -> Path:
    directory.mkdir()
    for rank in (0, 1):
        state = {"model": {"w": torch.arange(4.0) + rank}, "step": 3}
        if rank == 0:
            state["evil"] = evil
        torch.save(state, directory / f"rank{rank}.pt")
    return directory


def test_hostile_object_in_trainer_state_is_a_named_placeholder(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = ckptkit.open(
        str(_hostile_set(tmp_path / "ckpt", _Payload(os.system, f"touch {marker}")))
    )
    value = ckpt.read_object("train.evil")
    assert is_opaque(value) and type(value).global_name == "posix.system"
    assert torch.equal(ckpt.read("model.w", rank=1), torch.arange(4.0) + 1)
    with pytest.raises(ckptkit.UnsafePickleError, match="posix.system"):
        ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False, objects="error")
    # by default written back as pickled, never run; torch's safe loader refuses it still
    result = ckptkit.unshard(ckpt, str(tmp_path / "kept"), progress=False)
    assert result.opaque == {"train.evil": ["posix.system"]}
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        torch.load(tmp_path / "kept" / "train.pt", weights_only=True)
    assert not marker.exists()


@pytest.mark.parametrize("how", ["rebuild_from_type", "getattr_import", "getattr_sharded"])
def test_hostile_tensor_machinery_is_refused(tmp_path, how):
    """Globals that would build a tensor are checked strictly: UnsafePickleError naming the
    rank file, nothing imported or run."""
    from torch._tensor import _rebuild_from_type_v2
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    marker = tmp_path / "pwned"
    command = f"touch {marker}"
    evil = {
        "rebuild_from_type": _Payload(_rebuild_from_type_v2, os.system, dict, (command,), None),
        "getattr_import": _Payload(getattr, _Payload(__import__, "os"), "system"),
        "getattr_sharded": _Payload(getattr, ShardedTensor, "__init__"),
    }[how]
    directory = _hostile_set(tmp_path / "ckpt", evil)
    with pytest.raises(ckptkit.UnsafePickleError) as info:
        ckptkit.open(str(directory))
    assert str(directory / "rank0.pt") in str(info.value)
    assert info.value.global_name in {"posix.system", "builtins.getattr"}
    assert not marker.exists()


def test_rank_file_pickle_is_really_what_torch_writes():
    """Guard for the stand-ins: the legacy fixture's pickle uses getattr exactly once, on
    ShardedTensor, for 'ProcessGroupState' (what the allowlist permits)."""
    import pickletools

    with zipfile.ZipFile(LEGACY / "step3" / "rank0.pt") as archive:
        data = archive.read("rank0/data.pkl")
    ops = list(pickletools.genops(data))
    getattrs = [i for i, (op, arg, _) in enumerate(ops) if arg == "__builtin__ getattr"]
    assert len(getattrs) == 1
    following = [arg for _, arg, _ in ops[getattrs[0] + 1 : getattrs[0] + 6] if arg is not None]
    assert "ProcessGroupState" in following


# --------------------------------------------------------------------------------------------
# Detection verdicts.


def test_detection_verdicts(tmp_path, fsdp1, fsdp2):
    cases = {
        FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint": "dcp",
        TORCH_NEW / "step3": olmo_dcp.NAME,
        TORCH_NEW / "step3" / "model_and_optim": "dcp",
        TORCH_NEW / "step3" / "train": rank_files.NAME,
        TORCH_NEW / "step3" / "train" / "rank1.pt": rank_files.NAME,
        OLMO_CORE / "step3": olmo_dcp.NAME,
        LEGACY / "step3": rank_files.NAME,
        LEGACY / "step3" / "rank0.pt": rank_files.NAME,
        LEGACY / "reference" / "train.pt": "torch_save",
        FIXTURES / "olmo_local_ws2" / "step3": olmo_local.NAME,
        FIXTURES / "olmo_core_v010_ws2" / "step3": olmo_core_v0.NAME,
        FIXTURES / "olmo_unsharded" / "step3-unsharded-safetensors": "safetensors",
        fsdp1 / "ckpt": rank_files.NAME,
        fsdp2 / "ckpt": rank_files.NAME,
    }
    for path, expected in cases.items():
        found = ckptkit.detect(str(path))
        assert found.format == expected, (path, found)
        assert found.evidence, path
    detection = ckptkit.detect(str(LEGACY / "step3" / "rank0.pt"))
    assert detection.storage.url.endswith("step3")  # one rank's file opens the whole set
    assert ckptkit.detect(str(OLMO_CORE / "step3")).evidence[-1].startswith(".metadata.json")

    # format= forces an adapter: the step directory as plain DCP
    forced = ckptkit.open(str(TORCH_NEW / "step3"), format="dcp")
    assert forced.format == "dcp" and not any(k.startswith("train.") for k in forced)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ckptkit.FormatError, match=r"rank<N>\.pt.*notes\.txt"):
        ckptkit.detect(str(tmp_path))


TORCH_FREE = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

for path in sys.argv[1:]:
    ckpt = ckptkit.open(path)
    assert len(ckpt.tensors) and len(ckpt.chunks) and len(ckpt.files), path
    ckpt.summary()
    for key in ckpt.tensors["key"]:
        assert ckpt.read_numpy(key).size == ckpt.entry(key).numel, key
    assert ckpt.read_object("train.global_step") == 3, path
    assert len(ckpt.objects) and len(ckpt.config_table), path
print("torch-free ok")
"""


def test_rank_files_and_step_directories_open_without_torch():
    paths = [LEGACY / "step3", TORCH_NEW / "step3", OLMO_CORE / "step3"]
    assert "torch-free ok" in run_script(TORCH_FREE, *paths)
