"""Unsharded files: torch.save zips and safetensors (single, directories, HF shards), each
written here by torch or the safetensors library and read back against them."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint._traverse import traverse_state_dict

import ckptkit
from ckptkit.catalog.model import Encoding
from ckptkit.decoding.unpickler import is_opaque
from ckptkit.ops.state_dict import load_state_dict

from oracle import assert_bit_equal, inspect_without_torch, raw_bytes
from writers import write_hf_safetensors

FIXTURES = Path(__file__).parent / "fixtures"


class Holder:
    """A user class torch.save pickles by reference: ckptkit keeps it as a placeholder."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Payload:
    """Pickles to a call of ``func(*args)``: what a malicious checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _state_dict() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": {
            "embed": {"weight": torch.randn(5, 3)},
            "bf16": torch.randn(4, 2).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "transposed": base.t(),  # non-contiguous
            "row": base[2],  # a view sharing base's storage, at an offset
            "base": base,
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "name": "all"}],
        },
        "train": {
            "step": 17,
            "losses": [2.5, 2.25],
            "note": "hello",
            "rng": np.arange(5, dtype=np.uint32),
            "tensors": [torch.ones(2), torch.zeros(3, dtype=torch.int32)],
        },
    }


def _torch_leaves(state: dict) -> dict[tuple, object]:
    """What torch's own DCP flattening calls the leaves of ``state``."""
    found: dict[tuple, object] = {}
    traverse_state_dict(state, lambda path, value: found.__setitem__(tuple(path), value))
    return found


def _assert_matches(
    ckpt: ckptkit.Checkpoint, expected: dict[tuple, object], group: str | None = None
) -> None:
    """Keys, paths (under ``group`` if given), kinds, dtypes and shapes as ``expected`` says;
    every value equal."""
    prefix = (group,) if group else ()
    assert {ckpt.entry(k).path for k in ckpt} == {(*prefix, *path) for path in expected}
    for key in ckpt:
        entry = ckpt.entry(key)
        value = expected[entry.path[len(prefix) :]]
        assert key == ".".join(map(str, entry.path))
        if isinstance(value, torch.Tensor):
            assert entry.kind == "tensor", key
            assert entry.dtype.name == str(value.dtype).removeprefix("torch."), key
            assert entry.shape == tuple(value.shape), key
            assert_bit_equal(ckpt.read(key), value, key)
            assert ckpt.read_numpy(key).shape == tuple(value.shape), key
        else:
            assert entry.kind == "object", key
            actual = ckpt.read_object(key)
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(actual, value)
                assert actual.dtype == value.dtype
            else:
                assert actual == value, key


def test_torch_save_single_file(tmp_path):
    state = _state_dict()
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    ckpt = ckptkit.open(str(tmp_path / "ckpt.pt"))
    assert ckpt.format == "torch_save"
    assert ckpt.detection.files == ["ckpt.pt"] and ckpt.catalog.files == ("ckpt.pt",)
    leaves = _torch_leaves(loaded)
    _assert_matches(ckpt, leaves, "ckpt")  # keys sit under the file's stem
    assert ckpt.entry("ckpt.optim.state.0.step").path == ("ckpt", "optim", "state", "0", "step")
    assert ckpt.entry("ckpt.optim.param_groups.0.lr").path == (
        "ckpt",
        "optim",
        "param_groups",
        0,
        "lr",
    )
    # tensors are read from their storages' bytes, objects from data.pkl
    assert {c.record.encoding for e in ckpt.catalog.tensors() for c in e.chunks if c.record} == {
        Encoding.RAW
    }
    assert {e.chunks[0].record.encoding for e in ckpt.catalog.objects()} == {Encoding.PICKLE_LEAF}
    # the view covers only its own row of the shared storage
    base, row = (
        ckpt.entry("ckpt.model.base").chunks[0].record,
        ckpt.entry("ckpt.model.row").chunks[0].record,
    )
    assert (row.offset, row.length) == (base.offset + 2 * 6 * 4, 6 * 4)
    assert ckpt.entry("ckpt.model.empty").chunks[0].record is None
    # tables work and nest() rebuilds the structure (int dict keys become strings, as in DCP)
    n_tensors = sum(isinstance(value, torch.Tensor) for value in leaves.values())
    assert len(ckpt.tensors) == n_tensors and len(ckpt.objects) == len(leaves) - n_tensors
    assert len(ckpt.files) == 1
    rebuilt = load_state_dict(ckpt)["ckpt"]
    assert rebuilt["train"]["note"] == "hello" and rebuilt["optim"]["param_groups"][0]["lr"] == 1e-3
    assert_bit_equal(
        rebuilt["optim"]["state"]["0"]["exp_avg"], loaded["optim"]["state"][0]["exp_avg"], "exp_avg"
    )


def test_torch_save_leaves_beyond_dcp(tmp_path):
    """Tuples holding tensors are walked like lists; empty dicts are kept, not dropped."""
    state = {"pair": (torch.ones(2), 5), "empty": {}, "nested": {"none": None}}
    torch.save(state, tmp_path / "x.pt")
    ckpt = ckptkit.open(str(tmp_path / "x.pt"))
    assert sorted(ckpt) == ["x.empty", "x.nested.none", "x.pair.0", "x.pair.1"]
    assert_bit_equal(ckpt.read("x.pair.0"), state["pair"][0], "pair.0")
    assert ckpt.read_object("x.pair.1") == 5
    assert ckpt.read_object("x.empty") == {}
    assert ckpt.read_object("x.nested.none") is None
    rebuilt = load_state_dict(ckpt)["x"]
    assert (
        rebuilt["pair"][1] == 5 and rebuilt["empty"] == {} and rebuilt["nested"] == {"none": None}
    )


def test_torch_save_top_level_not_a_dict(tmp_path):
    tensor = torch.randn(3, 2)
    torch.save(tensor, tmp_path / "weights.pt")
    ckpt = ckptkit.open(str(tmp_path / "weights.pt"))
    assert ckpt.keys() == ["weights"] and ckpt.entry("weights").path == ("weights",)
    assert_bit_equal(ckpt.read("weights"), tensor, "weights")

    torch.save([torch.ones(1), 7], tmp_path / "items.pt")
    ckpt = ckptkit.open(str(tmp_path / "items.pt"))
    assert ckpt.keys() == ["items.0", "items.1"] and ckpt.read_object("items.1") == 7


def test_torch_save_directory(tmp_path):
    state = _state_dict()
    for group, value in state.items():
        torch.save(value, tmp_path / f"{group}.pt")
    torch.save(42, tmp_path / "other.pt")
    (tmp_path / "config.yaml").write_text("model: {}\n")
    (tmp_path / "notes.bin").write_bytes(b"not a zip")  # ignored: not a torch.save zip
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "torch_save"
    assert sorted(ckpt.catalog.files) == ["model.pt", "optim.pt", "other.pt", "train.pt"]
    loaded = {
        group: torch.load(tmp_path / f"{group}.pt", weights_only=False)
        for group in ("model", "optim", "train")
    }
    expected = _torch_leaves(loaded)
    expected[("other",)] = 42
    _assert_matches(ckpt, expected)
    assert ckpt.entry("model.embed.weight").path == ("model", "embed", "weight")
    assert set(ckpt.tensors["group"]) == {"model", "optim", "train"}


def test_tensor_inside_an_object_and_hostile_pickle(tmp_path):
    marker = tmp_path / "pwned"
    held = torch.randn(4, 2).to(torch.bfloat16)
    state = {
        "model": {"w": torch.randn(2, 2)},
        "holder": Holder(held),
        "evil": _Payload(os.system, f"touch {marker}"),
    }
    torch.save(state, tmp_path / "ckpt.pt")
    ckpt = ckptkit.open(str(tmp_path / "ckpt.pt"))
    assert sorted(ckpt) == ["ckpt.evil", "ckpt.holder", "ckpt.model.w"]
    evil = ckpt.read_object("ckpt.evil")
    assert is_opaque(evil) and evil.global_name in ("posix.system", "os.system")
    holder = ckpt.read_object("ckpt.holder")
    assert is_opaque(holder) and holder.global_name.endswith("Holder")
    assert_bit_equal(holder.state["tensor"], held, "holder.tensor")
    assert ckpt.objects["key"].tolist() == ["ckpt.holder", "ckpt.evil"]
    assert_bit_equal(ckpt.read("ckpt.model.w"), state["model"]["w"], "model.w")
    assert not marker.exists()


def _handmade_zip(path: Path, numel: int, offset: int, shape, stride, data: bytes) -> None:
    """A torch.save-style zip (written by ``zipfile``) whose pickle describes one float32 view."""

    class _Storage:
        pass

    storage = _Storage()

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if obj is storage else None

    class _View:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (
                storage,
                offset,
                torch.Size(shape),
                stride,
                False,
                collections.OrderedDict(),
            )

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({"w": _View()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", buf.getvalue())
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", data)


def test_handmade_zip_and_views_that_do_not_fit(tmp_path):
    values = np.arange(10, dtype="<f4")
    _handmade_zip(tmp_path / "ok.pt", 10, 2, (2, 3), (1, 2), values.tobytes())
    ckpt = ckptkit.open(str(tmp_path / "ok.pt"))
    expected = [[values[2 + i + 2 * j] for j in range(3)] for i in range(2)]
    np.testing.assert_array_equal(ckpt.read_numpy("ok.w"), np.array(expected))

    _handmade_zip(tmp_path / "past.pt", 10, 5, (2, 3), (1, 2), values.tobytes())
    with pytest.raises(ckptkit.CorruptRecordError, match=r"past\.pt.*'past.w'.*does not fit"):
        ckptkit.open(str(tmp_path / "past.pt"))

    _handmade_zip(tmp_path / "short.pt", 10, 0, (2,), (1,), values[:4].tobytes())
    with pytest.raises(ckptkit.CorruptRecordError, match=r"short\.pt.*'short.w'.*storage 0"):
        ckptkit.open(str(tmp_path / "short.pt"))


def test_zip64_records(tmp_path, monkeypatch):
    """zip64 central-directory fields and end records, forced by lowering zipfile's limits."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 16)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)
    values = np.arange(10, dtype="<f4")
    _handmade_zip(tmp_path / "big.pt", 10, 0, (10,), (1,), values.tobytes())
    with zipfile.ZipFile(tmp_path / "big.pt") as archive:
        assert archive.getinfo("archive/data/0").header_offset > 16  # really stored as zip64
    # zipfile keeps the real values in the classic end record when they fit; mark them as
    # overflowed, as a writer with 65535+ members or 4 GiB+ offsets must, so the zip64 one is used
    data = bytearray((tmp_path / "big.pt").read_bytes())
    end = data.rfind(b"PK\x05\x06")
    assert data.rfind(b"PK\x06\x06") < end
    data[end + 8 : end + 20] = b"\xff" * 12
    (tmp_path / "big.pt").write_bytes(bytes(data))
    np.testing.assert_array_equal(
        ckptkit.open(str(tmp_path / "big.pt")).read_numpy("big.w"), values
    )


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(6, 4),
        "layers.0.attn.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "layers.0.ids": torch.arange(9, dtype=torch.int64),
        "layers.1.mask": torch.tensor([True, False]),
        "scalar": torch.tensor(2.0, dtype=torch.float16),
        "empty": torch.empty(0, 3),
    }


def test_safetensors_single_file(tmp_path):
    save_file(_tensors(), tmp_path / "weights.safetensors", metadata={"format": "pt"})
    expected = load_file(tmp_path / "weights.safetensors")
    ckpt = ckptkit.open(str(tmp_path / "weights.safetensors"))
    assert ckpt.format == "safetensors"
    assert set(ckpt) == {f"weights.{name}" for name in expected}
    assert ckpt.catalog.facts.header_metadata == {"weights.safetensors": {"format": "pt"}}
    for name, tensor in expected.items():
        key = f"weights.{name}"  # under the file's stem, as when its directory is opened
        assert ckpt.entry(key).path == ("weights", name)
        assert ckpt.entry(key).dtype.name == str(tensor.dtype).removeprefix("torch.")
        assert_bit_equal(ckpt.read(key), tensor, key)
    rebuilt = load_state_dict(ckpt)["weights"]  # flat, like load_file
    assert set(rebuilt) == set(expected)


def test_safetensors_hf_shards(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    index = write_hf_safetensors(tmp_path, tensors, split=3)
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))

    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "safetensors"
    assert sorted(ckpt.catalog.files) == sorted(shards)
    assert set(ckpt) == {f"model.{name}" for name in names}
    for shard in shards:
        for name, tensor in load_file(tmp_path / shard).items():
            assert ckpt.entry(f"model.{name}").path == ("model", name)
            assert_bit_equal(ckpt.read(f"model.{name}"), tensor, name)

    # naming the index opens just that set, with the same keys
    direct = ckptkit.open(str(tmp_path / "model.safetensors.index.json"))
    assert set(direct) == set(ckpt)
    assert_bit_equal(direct.read("model.embed.weight"), tensors["embed.weight"], "embed.weight")

    # an index that lists a tensor no shard holds is an error
    weight_map["missing.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ckptkit.FormatError, match="missing.weight"):
        ckptkit.open(str(tmp_path))


def test_safetensors_preferred_over_torch_save(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    torch.save({k: v.clone() for k, v in tensors.items()}, tmp_path / "model.pt")
    torch.save({"step": 3, "rng": torch.arange(4)}, tmp_path / "train.pt")
    torch.save({"param_groups": [{"lr": 0.1}]}, tmp_path / "model.objects.pt")
    with pytest.warns(UserWarning, match=r"not read: model\.pt: model is read from safetensors"):
        ckpt = ckptkit.open(str(tmp_path))  # the choice is said, never silent
    assert ckpt.format == "safetensors"
    assert ckpt.catalog.facts.skipped_files == {"model.pt": "model is read from safetensors"}
    assert "model.pt" not in ckpt.catalog.files
    assert set(ckpt) == {f"model.{k}" for k in tensors} | {
        "train.step",
        "train.rng",
        "model.param_groups.0.lr",
    }
    assert ckpt.entry("model.embed.weight").chunks[0].record.file == "model.safetensors"
    assert ckpt.read_object("train.step") == 3
    assert ckpt.read_object("model.param_groups.0.lr") == 0.1
    assert_bit_equal(ckpt.read("train.rng"), torch.arange(4), "train.rng")


def test_safetensors_bad_offsets(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}
    raw = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(16))
    with pytest.raises(ckptkit.CorruptRecordError, match=r"bad\.safetensors.*'w'"):
        ckptkit.open(str(tmp_path / "bad.safetensors"))
    header["w"]["data_offsets"] = [0, 16]
    raw = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8))
    with pytest.raises(ckptkit.CorruptRecordError, match=r"bad\.safetensors.*'w'.*outside"):
        ckptkit.open(str(tmp_path / "bad.safetensors"))


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_unshard_output_reads_back(tmp_path, to):
    """ckptkit's own unshard output (``<group>.pt``, or ``.safetensors`` + ``.objects.pt``)."""
    source = ckptkit.open(str(FIXTURES / "olmo_core3_trainer_ws2" / "step3" / "model_and_optim"))
    ckptkit.unshard(source, str(tmp_path / "out"), to=to, progress=False)
    ckpt = ckptkit.open(str(tmp_path / "out"))
    assert ckpt.format == ("torch_save" if to == "torch" else "safetensors")
    assert set(ckpt) == set(source)
    objects = source.catalog.objects()
    for entry, value in zip(objects, source.reader.read_objects(objects), strict=True):
        assert ckpt.entry(entry.key).path == entry.path
        assert ckpt.read_object(entry.key) == value, entry.key
    for entry in source.catalog.tensors():
        assert ckpt.entry(entry.key).shape == entry.shape
        assert_bit_equal(ckpt.read(entry.key), source.read(entry.key), entry.key)


def test_unsharded_without_torch(tmp_path):
    """With torch blocked (oracle.TORCH_FREE_INSPECTION): every tensor's bytes and every object
    equal what torch.load / safetensors' load_file give for the files written here."""
    torch.save(_state_dict(), tmp_path / "ckpt.pt")
    save_file(_tensors(), tmp_path / "weights.safetensors")
    (tmp_path / "dir").mkdir()
    torch.save(_state_dict()["model"], tmp_path / "dir" / "model.pt")
    torch.save({"step": 3}, tmp_path / "dir" / "train.pt")
    leaves = {  # per path: (key path, value) as torch reads it back
        "ckpt.pt": {
            ("ckpt", *path): value
            for path, value in _torch_leaves(
                torch.load(tmp_path / "ckpt.pt", weights_only=False)
            ).items()
        },
        "weights.safetensors": {
            ("weights", name): tensor
            for name, tensor in load_file(tmp_path / "weights.safetensors").items()
        },
        "dir": {
            (group, *path): value
            for group in ("model", "train")
            for path, value in _torch_leaves(
                torch.load(tmp_path / "dir" / f"{group}.pt", weights_only=False)
            ).items()
        },
    }
    paths = [tmp_path / name for name in leaves]
    for path, read in zip(paths, inspect_without_torch(*paths), strict=True):
        expected = {".".join(map(str, p)): value for p, value in leaves[path.name].items()}
        tensors = {key for key, value in expected.items() if isinstance(value, torch.Tensor)}
        assert read["tensors"].keys() == tensors, path
        assert read["objects"].keys() == expected.keys() - tensors, path
        for key, digest in read["tensors"].items():
            assert digest == hashlib.sha256(raw_bytes(expected[key])).hexdigest(), key
        for key, value in read["objects"].items():
            if isinstance(expected[key], np.ndarray):
                np.testing.assert_array_equal(value, expected[key])
                assert value.dtype == expected[key].dtype, key
            else:
                assert type(value) is type(expected[key]) and value == expected[key], key
