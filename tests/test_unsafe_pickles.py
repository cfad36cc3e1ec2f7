"""Hostile pickles: nothing from the checkpoint runs, and the error names the global."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import ckptkit
from ckptkit.unpickler import OBJECT_GLOBALS, is_opaque, safe_loads

FIXTURE = Path(__file__).parent / "fixtures" / "olmo_torch_new_ws2" / "step3" / "model_and_optim"


class _Payload:
    """Pickles to a call of ``func(*args)``: what a malicious checkpoint would contain."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _copy_checkpoint(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, target)
    return target


def _rewrite_metadata(ckpt: Path, mutate) -> None:
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    metadata = mutate(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _payloads(marker: Path):
    command = f"touch {marker}"
    return {
        "os.system": _Payload(os.system, command),
        "builtins.exec": _Payload(exec, f"open({str(marker)!r}, 'w').close()"),
        "builtins.eval": _Payload(eval, f"open({str(marker)!r}, 'w')"),
        "getattr chain": _Payload(getattr, _Payload(__import__, "os"), "system"),
    }


@pytest.mark.parametrize("name", ["os.system", "builtins.exec", "builtins.eval", "getattr chain"])
@pytest.mark.parametrize("where", ["top level", "planner_data", "storage_meta"])
def test_hostile_metadata_is_refused_and_never_runs(tmp_path, name, where):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[name]
    ckpt = _copy_checkpoint(tmp_path)

    def mutate(metadata):
        if where == "top level":
            return payload
        if where == "planner_data":
            metadata.planner_data["model.transformer.wte.weight"] = ("model", payload)
        else:
            metadata.storage_meta.checkpoint_id = payload
        return metadata

    _rewrite_metadata(ckpt, mutate)
    with pytest.raises(ckptkit.UnsafePickleError) as info:
        ckptkit.open(str(ckpt))
    assert info.value.global_name in {
        "posix.system",
        "builtins.exec",
        "builtins.eval",
        "builtins.getattr",
    }
    assert info.value.global_name in str(info.value)
    assert str(ckpt / ".metadata") in str(info.value)
    assert isinstance(info.value, ckptkit.CheckpointError)
    assert not marker.exists()


def test_hostile_object_entry_comes_back_as_a_named_placeholder(tmp_path):
    marker = tmp_path / "pwned"
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "train": {"evil": _Payload(os.system, f"touch {marker}"), "step": 7},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    assert not marker.exists()  # saving only pickles the reduce tuple

    ckpt = ckptkit.open(str(tmp_path / "ckpt"))
    value = ckpt.read_object("train.evil")
    assert is_opaque(value)
    assert type(value).global_name == "posix.system"
    assert value.args == (f"touch {marker}",)
    row = ckpt.objects.set_index("key").loc["train.evil"]
    assert row["type"] == "posix.system" and "posix.system" in row["preview"]
    assert ckpt.read_object("train.step") == 7
    assert torch.equal(ckpt.read("model.w"), state["model"]["w"])
    assert not marker.exists()


def test_object_allowlist_decodes_values_torch_would_load():
    import collections

    import numpy as np

    value = {
        "set": {1, 2},
        "od": collections.OrderedDict(a=1),
        "array": np.arange(5, dtype=np.int32),
        "scalar": np.float64(2.5),
        "complex": 1 + 2j,
        "bytes": b"\x00\xff",
    }
    for protocol in (2, 4):
        decoded = safe_loads(
            pickle.dumps(value, protocol=protocol),
            allow=OBJECT_GLOBALS,
            source="test",
            unknown="opaque",
        )
        assert decoded["set"] == {1, 2} and decoded["od"] == {"a": 1}
        np.testing.assert_array_equal(decoded["array"], value["array"])
        assert (
            decoded["scalar"] == 2.5
            and decoded["complex"] == 1 + 2j
            and decoded["bytes"] == b"\x00\xff"
        )


def test_numpy_object_arrays_are_refused():
    import numpy as np

    data = pickle.dumps(np.array([None, 1], dtype=object))
    with pytest.raises(ckptkit.UnsafePickleError):
        safe_loads(data, allow=OBJECT_GLOBALS, source="test", unknown="opaque")


def test_garbage_metadata_is_a_typed_error_naming_the_file(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    (ckpt / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(ckptkit.CorruptRecordError, match=r"\.metadata"):
        ckptkit.open(str(ckpt))
