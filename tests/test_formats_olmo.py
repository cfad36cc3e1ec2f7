"""OLMo "local", OLMo-core 0.x, OLMo base64-key safetensors (fixtures written by OLMo 0.6.0 /
OLMo-core 0.1.0 on torch 2.2); torch's HuggingFaceStorageWriter is in test_formats_hf_dcp.py."""

from __future__ import annotations

import base64
import hashlib
import json
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
from ckptkit.errors import MissingFileError
from ckptkit.formats import olmo_local
from ckptkit.storage import Storage

from oracle import assert_bit_equal, assert_matches_sha256, inspect_without_torch, raw_bytes

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


def _olmo_split_counts() -> dict[str, int]:
    """Tensors per file of OLMo's own unsharder output (``scripts/unshard.py``) for the same job,
    ``{"model": …, "optim": …, "train": …}``, from that output's reference hashes."""
    listed = json.loads((UNSHARDED / "reference" / "tensors.sha256.json").read_text())
    return {
        Path(file).stem: len(tensors)
        for file, tensors in listed.items()
        if file.startswith("step3-unsharded/")
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
    assert ckpt.catalog.facts.world_size == 2
    expected = _sha_keys(LOCAL)
    tensors = ckpt.tensors.set_index("key")
    assert set(tensors.index) == set(expected)  # 29 model + 87 optim + train.rng.torch
    for key, spec in expected.items():
        assert list(tensors.loc[key, "shape"]) == spec["shape"], key
        assert tensors.loc[key, "dtype"] == spec["dtype"], key
    assert assert_matches_sha256(ckpt, LOCAL / "reference" / "tensors.sha256.json") == len(
        ckpt.tensors
    )

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
    for group, count in _olmo_split_counts().items():  # as many tensors per file as OLMo's
        assert _assert_file_matches_sha(tmp_path / "out" / f"{group}.pt", group, expected) == count

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
    pickled = ckptkit.formats.parts.torch_save_files.load_pickles(
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
    assert "config.yaml" in ckpt.catalog.facts.unfinished
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
    assert assert_matches_sha256(ckpt, CORE / "reference" / "tensors.sha256.json") == len(
        ckpt.tensors
    )
    # num_param_groups / state_keys are OLMo-core bookkeeping, not state
    assert ckpt.catalog.facts.bookkeeping_keys == ("num_param_groups", "state_keys")
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
    assert ckpt.read_object("optim.param_groups.0.params") == _olmo_param_groups()[0]["params"]
    assert ckpt.read_object("optim.param_groups.1.betas") == (0.88, 0.96)
    names = ckpt.read_object("optim.param_groups.1.param_names")
    assert [n.replace(PREFIX, "") for n in names] == _olmo_param_groups()[1]["param_names"]


def test_olmo_core_v0_unshard_and_same_state_as_olmo_local(tmp_path):
    ckptkit.unshard(str(CORE / "step3"), str(tmp_path / "out"), progress=False)
    expected = _sha_keys(CORE)
    for group, count in _olmo_split_counts().items():
        assert _assert_file_matches_sha(tmp_path / "out" / f"{group}.pt", group, expected) == count
    groups = torch.load(tmp_path / "out" / "optim.pt", weights_only=False)["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in _olmo_param_groups()]
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
    assert ckpt.catalog.facts.base64_key_files == ("model.safetensors", "optim.safetensors")
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
    assert count == len(ckpt.catalog.tensors()) == sum(_olmo_split_counts().values())
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
    assert ckpt.catalog.facts.base64_key_files == ()

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (tmp_path / "pwned",))

    hostile = base64.urlsafe_b64encode(pickle.dumps(((Payload(),), False))).decode()
    save_file({hostile: torch.ones(1)}, tmp_path / "b.safetensors")
    ckpt = ckptkit.open(str(tmp_path / "b.safetensors"))
    assert ckpt.keys() == [f"b.{hostile}"]  # kept as stored, never unpickled beyond the refusal
    assert not (tmp_path / "pwned").exists()


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
    """With torch blocked (oracle.TORCH_FREE_INSPECTION): every tensor's bytes hash as OLMo's
    reference says, and every object is what ckptkit reads with torch (checked against OLMo's
    values above)."""
    folder = UNSHARDED / "step3-unsharded-safetensors"
    listed = json.loads((UNSHARDED / "reference" / "tensors.sha256.json").read_text())
    unsharded = {
        f"{Path(file).stem}.{key}": spec
        for file, tensors in listed.items()
        if file.startswith(f"{folder.name}/")
        for key, spec in tensors.items()
    }
    cases = [
        (LOCAL / "step3", _sha_keys(LOCAL)),
        (CORE / "step3", _sha_keys(CORE)),
        (folder, unsharded),
    ]
    seen = inspect_without_torch(*(path for path, _ in cases))
    for (path, expected), read in zip(cases, seen, strict=True):
        assert read["tensors"] == {key: spec["sha256"] for key, spec in expected.items()}, path
        ckpt = ckptkit.open(str(path))
        assert read["objects"].keys() == {entry.key for entry in ckpt.catalog.objects()}, path
        for key, value in read["objects"].items():
            assert _same_value(value, ckpt.read_object(key)), key


def test_fixture_sizes_stay_small():
    total = sum(
        p.stat().st_size
        for item in (LOCAL, CORE, UNSHARDED)
        for p in item.rglob("*")
        if p.is_file()
    )
    assert total < 2.1e6
