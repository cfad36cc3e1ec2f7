"""OLMo "local", OLMo-core 0.x, OLMo base64-key safetensors (fixtures written by OLMo 0.6.0 /
OLMo-core 0.1.0 on torch 2.2) and torch's HuggingFaceStorageWriter output (written here)."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import pathlib
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ckptkit
from ckptkit.errors import FormatError, MissingFileError
from ckptkit.formats import olmo_local
from ckptkit.storage import Storage

from isolated import run_script
from oracle import assert_bit_equal, assert_matches_sha256, raw_bytes

FIXTURES = Path(__file__).parent / "fixtures"
LOCAL = FIXTURES / "olmo_local_ws2"
CORE = FIXTURES / "olmo_core_v010_ws2"
UNSHARDED = FIXTURES / "olmo_unsharded"
PREFIX = "_fsdp_wrapped_module."


def _sha_keys(item: Path) -> dict[str, dict]:
    """``{"model.<key>": spec, …}`` from an item's ``tensors.sha256.json``."""
    listed = json.loads((item / "reference" / "tensors.sha256.json").read_text())
    return {
        f"{file.split('.')[0]}.{key}": spec
        for file, tensors in listed.items()
        for key, spec in tensors.items()
    }


def _olmo_param_groups() -> list[dict]:
    """OLMo's own unsharded param groups of the olmo_local job: the pickled value in
    ``unshard.py --safe-tensors`` output, decoded with plain pickle (a trusted fixture)."""
    data = (UNSHARDED / "step3-unsharded-safetensors" / "optim.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for name, spec in header.items():
        if name != "__metadata__" and pickle.loads(base64.urlsafe_b64decode(name))[1]:
            begin, end = spec["data_offsets"]
            return pickle.loads(data[8 + n + begin : 8 + n + end])
    raise AssertionError("no pickled value in optim.safetensors")


def _walk(value, path=()):
    """Leaves of a loaded state dict by path (dict keys as str, as ckptkit keys them)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, str(key)))
    elif isinstance(value, (list, tuple)) and any(
        isinstance(item, (dict, torch.Tensor)) for item in value
    ):
        for i, item in enumerate(value):
            yield from _walk(item, (*path, i))
    else:
        yield path, value


def _same_value(a, b) -> bool:
    """Equal objects, paths compared as strings (ckptkit decodes ``PosixPath`` to ``str``)."""
    if isinstance(a, pathlib.PurePath) or isinstance(b, pathlib.PurePath):
        return str(a) == str(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _assert_file_matches_sha(path: Path, group: str, expected: dict[str, dict]) -> int:
    """Every tensor of an unsharded ``<group>.pt`` has the reference's dtype, shape and hash."""
    tensors = {
        f"{group}.{'.'.join(map(str, p))}": v
        for p, v in _walk(torch.load(path, weights_only=False))
        if isinstance(v, torch.Tensor)
    }
    wanted = {k: v for k, v in expected.items() if k.startswith(f"{group}.")}
    assert set(tensors) == set(wanted)
    for key, tensor in tensors.items():
        spec = wanted[key]
        assert list(tensor.shape) == spec["shape"] and str(tensor.dtype) == f"torch.{spec['dtype']}"
        assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key
    return len(tensors)


# --------------------------------------------------------------------------------------------
# OLMo "local" (LocalShardedCheckpointer): FSDP1 flat-parameter shards.


def test_olmo_local_keys_and_tensors_match_olmo_unsharder():
    ckpt = ckptkit.open(str(LOCAL / "step3"))
    assert ckpt.format == "olmo_local"
    assert ckpt.detection.evidence[0] == "metadata.yaml"
    assert ckpt.catalog.info["world_size"] == 2
    expected = _sha_keys(LOCAL)
    tensors = ckpt.tensors.set_index("key")
    assert set(tensors.index) == set(expected)  # 29 model + 87 optim + train.rng.torch
    for key, spec in expected.items():
        assert list(tensors.loc[key, "shape"]) == spec["shape"], key
        assert tensors.loc[key, "dtype"] == spec["dtype"], key
    assert assert_matches_sha256(ckpt, LOCAL / "reference" / "tensors.sha256.json") == 117

    # rank 0's root flat shard ends 18 elements into transformer.ff_out.weight (fixture README);
    # the optimizer state of that parameter (id 8) is cut at the same element
    for key in ("model.transformer.ff_out.weight", "optim.state.8.exp_avg"):
        chunks = ckpt.chunks[ckpt.chunks["key"] == key].sort_values("rank")
        assert chunks["offsets"].tolist() == [(0,), (18,)], key
        assert chunks["sizes"].tolist() == [(18,), (6270,)], key
        assert chunks["rank"].tolist() == [0, 1], key
    # a padded flat parameter: 6288+48+48+6288+131 = 12803 elements in 2 x 6402; the one
    # padding element is never part of a record
    root = ckpt.chunks[ckpt.chunks["file"] == "model/rank1.pt"]
    flat_shards = 6402 + 2 * 8328  # the root handle's shard, then each block's
    assert root["length"].sum() == (flat_shards - 1) * 4
    # step is 0-d and saved by every rank holding a piece of the parameter
    assert ckpt.entry("optim.state.8.step").shape == ()
    assert ckpt.read("optim.state.8.step", rank=1).item() == 3.0


def test_olmo_local_objects_match_olmo_reference():
    ckpt = ckptkit.open(str(LOCAL / "step3"))
    reference = _olmo_param_groups()
    groups = [{}, {}]
    for key in ckpt.catalog.entries:
        if key.startswith("optim.param_groups."):
            index, field = key.split(".")[2:4]
            groups[int(index)][field] = ckpt.read_object(key)
    # stored as written (FSDP-prefixed names); OLMo's unsharder strips the prefix
    for ours, theirs in zip(groups, reference, strict=True):
        assert set(ours) == set(theirs)
        assert [n.replace(PREFIX, "") for n in ours["param_names"]] == theirs["param_names"]
        assert all(n.startswith(PREFIX) for n in ours["param_names"])
        assert {k: v for k, v in ours.items() if k != "param_names"} == {
            k: v for k, v in theirs.items() if k != "param_names"
        }
    assert groups[0]["lr"] == 0.003 and groups[0]["betas"] == (0.88, 0.96)
    assert groups[0]["weight_decay"] == 0.05 and len(groups[0]["params"]) == 9
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 20
    # trainer state: rank 0's copy by default, every rank's on request
    assert ckpt.read_object("train.global_step") == 3
    assert ckpt.read_object("train.global_train_tokens_seen") == 144
    assert ckpt.read_object("train.checkpoints") == ["runs/ckptkit-fixture-olmo06/step3"]
    assert ckpt.read_object("train.rng.numpy", rank=1)[0] == "MT19937"


def test_olmo_local_unshard_gives_olmo_split(tmp_path):
    result = ckptkit.unshard(str(LOCAL / "step3"), str(tmp_path / "out"), progress=False)
    assert sorted(f.name for f in result.files) == ["model.pt", "optim.pt", "train.pt"]
    expected = _sha_keys(LOCAL)
    assert _assert_file_matches_sha(tmp_path / "out" / "model.pt", "model", expected) == 29
    assert _assert_file_matches_sha(tmp_path / "out" / "optim.pt", "optim", expected) == 87
    assert _assert_file_matches_sha(tmp_path / "out" / "train.pt", "train", expected) == 1

    optim = torch.load(tmp_path / "out" / "optim.pt", weights_only=False)
    assert list(optim) == ["state", "param_groups"]
    assert sorted(optim["state"], key=int) == [str(i) for i in range(29)]  # ids, as str keys
    for ours, theirs in zip(optim["param_groups"], _olmo_param_groups(), strict=True):
        ours = {**ours, "param_names": [n.replace(PREFIX, "") for n in ours["param_names"]]}
        assert ours == theirs
    # OLMo's train.pt is train/rank0.pt as saved
    ours = dict(_walk(torch.load(tmp_path / "out" / "train.pt", weights_only=False)))
    theirs = dict(_walk(torch.load(LOCAL / "step3" / "train" / "rank0.pt", weights_only=False)))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert_bit_equal(ours[key], value, str(key))
        else:
            assert _same_value(ours[key], value), key


def test_olmo_local_convert_to_dcp_reads_back_in_torch(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckptkit.convert(str(LOCAL / "step3"), str(tmp_path / "dcp"), to="dcp", progress=False)
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "all.pt"))
    state = torch.load(tmp_path / "all.pt", weights_only=False)
    expected = _sha_keys(LOCAL)
    for group in ("model", "optim", "train"):
        torch.save(state[group], tmp_path / f"{group}.pt")
        _assert_file_matches_sha(tmp_path / f"{group}.pt", group, expected)
    assert state["optim"]["param_groups"][1]["weight_decay"] == 0.0
    assert state["train"]["global_step"] == 3


def test_olmo_local_pre_2_1_shard_metadata_gives_the_same_ranges():
    """torch <= 2.0 saved ``_shard_indices`` + ``_shard_param_offsets`` (inclusive, no padding
    between parameters) instead of ``_shard_param_infos``; derived from the real handles (whose
    pieces are contiguous here), both describe the same pieces."""
    pickled = ckptkit.formats.torch_save.load_pickles(
        Storage(str(LOCAL / "step3")),
        ["model/rank0.pt", "model/rank1.pt"],
        allow=olmo_local.MODEL_GLOBALS,
    )
    checked = 0
    for file in pickled.values():
        for module in file.value["modules"]:
            for handle in module["handles"]:
                infos = handle["flat_param._shard_param_infos"]
                new = olmo_local._shard_ranges(handle, len(infos), file.source)
                inside = [i for i, info in enumerate(infos) if info.in_shard]
                old_handle = {
                    "flat_param._shard_indices": (inside[0], inside[-1]),
                    "flat_param._shard_param_offsets": [
                        (infos[i].intra_param_start_idx, infos[i].intra_param_end_idx)
                        for i in inside
                    ],
                }
                assert olmo_local._shard_ranges(old_handle, len(infos), file.source) == new
                checked += 1
    assert checked == 6


def test_olmo_local_missing_rank_file_is_named(tmp_path):
    for missing in ("optim/rank1.pt", "model/rank1.pt", "train/rank1.pt"):
        step = tmp_path / missing.replace("/", "_")
        shutil.copytree(LOCAL / "step3", step)
        (step / missing).unlink()
        with pytest.raises(MissingFileError, match=missing):
            ckptkit.open(str(step))


def test_olmo_local_without_config_is_reported_unfinished(tmp_path):
    step = tmp_path / "step3"
    shutil.copytree(LOCAL / "step3", step)
    (step / "config.yaml").unlink()
    with pytest.warns(UserWarning, match="unfinished"):
        ckpt = ckptkit.open(str(step))
    assert "config.yaml" in ckpt.catalog.info["unfinished"]
    assert any("config.yaml" in line for line in ckpt.detection.evidence)


# --------------------------------------------------------------------------------------------
# OLMo-core 0.x: metadata.json + rank_N.safetensors, flattened offsets.


def test_olmo_core_v0_keys_and_tensors_match_olmo_unsharder():
    ckpt = ckptkit.open(str(CORE / "step3"))
    assert ckpt.format == "olmo_core_v0"
    assert ckpt.detection.evidence[:1] == ["model/metadata.json"]
    expected = _sha_keys(CORE)
    tensors = ckpt.tensors.set_index("key")
    assert set(tensors.index) == set(expected)
    for key, spec in expected.items():
        assert list(tensors.loc[key, "shape"]) == spec["shape"], key
    assert assert_matches_sha256(ckpt, CORE / "reference" / "tensors.sha256.json") == 117
    # num_param_groups / state_keys are OLMo-core bookkeeping, not state
    assert ckpt.catalog.info["bookkeeping"] == ["num_param_groups", "state_keys"]
    assert not any("__" in key or "num_param_groups" in key for key in ckpt)
    # transformer.wte.weight lives wholly in rank_0 (rank_1 has an empty range)
    wte = ckpt.chunks[ckpt.chunks["key"] == "model.transformer.wte.weight"]
    assert wte["file"].tolist() == ["model/rank_0.safetensors"]
    # 0-d step: shape [] in metadata.json, [1] in the file
    assert ckpt.entry("optim.state.0.step").shape == ()
    assert ckpt.read("optim.state.0.step").item() == 3.0
    # param groups from the pickles in uint8 tensors, without OLMo-core's _param_names
    groups = [k for k in ckpt if k.startswith("optim.param_groups.0.")]
    assert "optim.param_groups.0._param_names" not in groups
    assert ckpt.read_object("optim.param_groups.0.params") == list(range(9))
    assert ckpt.read_object("optim.param_groups.1.betas") == (0.88, 0.96)
    names = ckpt.read_object("optim.param_groups.1.param_names")
    assert [n.replace(PREFIX, "") for n in names] == _olmo_param_groups()[1]["param_names"]


def test_olmo_core_v0_unshard_and_same_state_as_olmo_local(tmp_path):
    ckptkit.unshard(str(CORE / "step3"), str(tmp_path / "out"), progress=False)
    expected = _sha_keys(CORE)
    for group, count in (("model", 29), ("optim", 87), ("train", 1)):
        assert _assert_file_matches_sha(tmp_path / "out" / f"{group}.pt", group, expected) == count
    groups = torch.load(tmp_path / "out" / "optim.pt", weights_only=False)["param_groups"]
    assert [g["params"] for g in groups] == [list(range(9)), list(range(9, 29))]
    assert all("_param_names" not in g for g in groups)

    # same job and moment as olmo_local: every key and every byte agree
    core, local = ckptkit.open(str(CORE / "step3")), ckptkit.open(str(LOCAL / "step3"))
    assert set(core.keys()) == set(local.keys())
    for entry in local.catalog.tensors():
        assert_bit_equal(core.read(entry.key), local.read(entry.key), entry.key)


# --------------------------------------------------------------------------------------------
# OLMo base64-key safetensors (scripts/unshard.py --safe-tensors).


def test_olmo_base64_safetensors_decode_to_real_keys():
    folder = UNSHARDED / "step3-unsharded-safetensors"
    ckpt = ckptkit.open(str(folder))
    assert ckpt.format == "safetensors"
    assert ckpt.catalog.info["olmo_base64_keys"] == ["model.safetensors", "optim.safetensors"]
    listed = json.loads((UNSHARDED / "reference" / "tensors.sha256.json").read_text())
    count = 0
    for file, tensors in listed.items():
        if not file.startswith(folder.name + "/"):
            continue
        group = file.split("/")[1].split(".")[0]
        for key, spec in tensors.items():
            tensor = ckpt.read(f"{group}.{key}")
            assert list(tensor.shape) == spec["shape"], key
            assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key
            count += 1
    assert count == 117 and len(ckpt.catalog.tensors()) == 117
    # the pickled param_groups list is read lazily, leaf by leaf, and equals OLMo's value
    reference = _olmo_param_groups()
    for i, group in enumerate(reference):
        for field, value in group.items():
            assert ckpt.read_object(f"optim.param_groups.{i}.{field}") == value
    # keys line up with the sharded checkpoint it was unsharded from
    assert set(ckpt.keys()) == set(ckptkit.open(str(LOCAL / "step3")).keys())


def test_base64_keys_are_decoded_only_when_all_are_olmo_keys(tmp_path):
    olmo_key = base64.urlsafe_b64encode(pickle.dumps((("w",), False), protocol=4)).decode()
    save_file({olmo_key: torch.ones(2), "plain.weight": torch.zeros(3)}, tmp_path / "a.safetensors")
    ckpt = ckptkit.open(str(tmp_path / "a.safetensors"))
    assert set(ckpt.keys()) == {f"a.{olmo_key}", "a.plain.weight"}
    assert "olmo_base64_keys" not in ckpt.catalog.info

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (tmp_path / "pwned",))

    hostile = base64.urlsafe_b64encode(pickle.dumps(((Payload(),), False))).decode()
    save_file({hostile: torch.ones(1)}, tmp_path / "b.safetensors")
    ckpt = ckptkit.open(str(tmp_path / "b.safetensors"))
    assert ckpt.keys() == [f"b.{hostile}"]  # kept as stored, never unpickled beyond the refusal
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------------------------
# torch's HuggingFaceStorageWriter (torch >= 2.8).


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
    assert ckpt.catalog.files == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
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
    with pytest.raises(FormatError, match="cover"):
        ckptkit.open(str(tmp_path / "consolidated" / "sharded"))


# --------------------------------------------------------------------------------------------
# Detection verdicts.


@pytest.mark.parametrize(
    ("path", "fmt"),
    [
        ("olmo_local_ws2/step3", "olmo_local"),
        ("olmo_core_v010_ws2/step3", "olmo_core_v0"),
        ("olmo_unsharded/step3-unsharded-safetensors", "safetensors"),
        ("olmo_core_v010_ws2/step3/model/rank_0.safetensors", "safetensors"),
    ],
)
def test_detection_verdicts(path, fmt):
    assert ckptkit.formats.detect(Storage(str(FIXTURES / path))).format == fmt


def test_inspection_needs_no_torch():
    from test_torch_free import SCRIPT

    paths = [LOCAL / "step3", CORE / "step3", UNSHARDED / "step3-unsharded-safetensors"]
    assert "torch-free ok" in run_script(SCRIPT, *paths)


def test_fixture_sizes_stay_small():
    total = sum(
        p.stat().st_size
        for item in (LOCAL, CORE, UNSHARDED)
        for p in item.rglob("*")
        if p.is_file()
    )
    assert total < 2.1e6 and math.isfinite(total)
