"""Hostile pickles: nothing from the checkpoint runs, and the error names the global."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import ckptkit
from ckptkit.decoding.unpickler import OBJECT_GLOBALS, is_opaque, safe_loads

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


# --------------------------------------------------------------------------------------------
# Resource limits: pickles that would make the C unpickler allocate, crash or hang.


def _hostile_pickles() -> dict[str, bytes]:
    import struct

    return {
        # the C unpickler resizes its memo to twice the index and zeroes it: 8 GB from 9 bytes
        "LONG_BINPUT huge index": b"\x80\x02N" + b"r" + struct.pack("<I", 500_000_000) + b".",
        # allocated before it is read
        "BINBYTES8 huge length": b"\x80\x04\x8e" + struct.pack("<Q", 10**10) + b"abc.",
        "BINUNICODE8 huge length": b"\x80\x04\x8d" + struct.pack("<Q", 10**12) + b"abc.",
        # hashing it as a dict key recurses 200 000 levels in C: a segfault, not an exception
        "tuple 200k deep as a key": b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"K\x01s.",
        # each tuple holds the previous one twice: hashing takes 2**60 steps
        "tuples sharing halves": b"\x80\x02})"
        + b"".join(b"q\x00h\x00\x86" for _ in range(60))
        + b"K\x01s.",
        "list 5000 deep": b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".",
        # lists sharing halves: walked as a tree (repr, flattening) 2**30 steps
        "lists sharing halves": b"\x80\x02]"
        + b"".join(b"q\x00(h\x00h\x00l" for _ in range(30))
        + b".",
        "huge int": b"\x80\x02\x8b" + struct.pack("<i", 1 << 20) + b"\x01" * (1 << 20) + b".",
        "EXT opcode": b"\x80\x02\x82\x01.",
        "bytearray of 10**12": b"\x80\x02c__builtin__\nbytearray\n\x8a\x05\x00\x10\xa5\xd4\xe8\x85R.",
    }


@pytest.mark.parametrize("name", list(_hostile_pickles()))
def test_resource_attacks_are_refused_before_loading(name):
    import resource

    data = _hostile_pickles()[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ckptkit.CheckpointError) as info:
        safe_loads(data, allow=OBJECT_GLOBALS, source="evil.pkl", unknown="opaque")
    assert "evil.pkl" in str(info.value)
    assert isinstance(info.value, ckptkit.UnsafePickleError | ckptkit.CorruptRecordError)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"{name}: peak RSS grew by {grown_mib:.0f} MiB"


def test_limit_errors_are_unsafe_pickle_errors():
    data = _hostile_pickles()["LONG_BINPUT huge index"]
    with pytest.raises(ckptkit.LimitExceededError, match="memo index 500000000"):
        safe_loads(data, allow=OBJECT_GLOBALS, source="x")
    assert issubclass(ckptkit.PickleLimitError, ckptkit.LimitExceededError)
    assert issubclass(ckptkit.PickleLimitError, ckptkit.UnsafePickleError)


def test_large_pickles_with_deep_tuples_load_on_a_big_stack():
    """Beyond the simulated size the unpickler runs on a thread whose stack fits the deepest
    nesting the input could build: a 3-million-deep tuple loads instead of crashing, and the
    value check then refuses it before anything hashes or walks it."""
    from ckptkit.decoding.pickle_limits import METADATA_LIMITS

    data = b"\x80\x02]" + b")" + b"\x85" * 3_000_000 + b"a."
    value = safe_loads(data, allow={}, source="big", limits=METADATA_LIMITS)
    assert type(value) is list and len(value) == 1
    with pytest.raises(ckptkit.LimitExceededError, match="nested more than"):
        safe_loads(data, allow={}, source="big")


def test_cycles_and_lazy_ranges_are_refused():
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(ckptkit.CorruptRecordError, match="cycle"):
        safe_loads(pickle.dumps(cyclic), allow=OBJECT_GLOBALS, source="x", unknown="opaque")
    # set(range(10**10)) would build ten billion ints from 30 bytes
    lazy = b"\x80\x02cbuiltins\nset\ncbuiltins\nrange\nJ\x00\xe4\x0bT\x85R\x85R."
    with pytest.raises(ckptkit.UnsafePickleError, match="set"):
        safe_loads(lazy, allow=OBJECT_GLOBALS, source="x", unknown="opaque")


# --------------------------------------------------------------------------------------------
# Payloads nested in torch.save files and tensor records.


def _nested(payload):
    return {"config": {"layers": [{"act": (1, payload)}]}}


@pytest.mark.parametrize("name", ["os.system", "builtins.exec", "builtins.eval", "getattr chain"])
def test_payloads_in_torch_save_objects_become_placeholders(tmp_path, name):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[name]
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3), "top": payload, "nested": _nested(payload)}, path)
    ckpt = ckptkit.open(str(path))
    top = ckpt.read_object("model.top")
    assert is_opaque(top)
    nested = ckpt.read_object("model.nested.config.layers.0.act")
    assert nested[0] == 1 and is_opaque(nested[1])
    assert torch.equal(ckpt.read("model.w"), torch.ones(3))
    with pytest.raises(ckptkit.UnsafePickleError, match="model.top"):  # refused when asked
        ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False, objects="error")
    assert not (tmp_path / "out" / "model.pt").exists()
    dropped = ckptkit.unshard(ckpt, str(tmp_path / "drop"), progress=False, objects="drop")
    assert set(dropped.dropped) == {"model.top", "model.nested.config.layers.0.act"}
    assert set(torch.load(tmp_path / "drop" / "model.pt", weights_only=True)) == {"w"}
    # by default written back as pickled, never run: torch's own safe loader still refuses it
    kept = ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False)
    assert set(kept.opaque) == {"model.top", "model.nested.config.layers.0.act"}
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert not marker.exists()


def _replace_record_pickle(ckpt_dir: Path, key: str, hostile: bytes) -> None:
    """Rewrite ``key``'s first record as a new zip whose data.pkl is ``hostile``, appended to
    its file, and point the metadata at it."""
    import io
    import zipfile

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    index, info = next((k, v) for k, v in metadata.storage_data.items() if k.fqn == key)
    data_file = ckpt_dir / info.relative_path
    blob = data_file.read_bytes()[info.offset : info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            content = hostile if item.filename.endswith("data.pkl") else src.read(item)
            dst.writestr(item.filename, content)
    offset = data_file.stat().st_size
    with data_file.open("ab") as f:
        f.write(out.getvalue())
    info.offset, info.length = offset, len(out.getvalue())
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("nested", [False, True], ids=["top level", "nested"])
@pytest.mark.parametrize("name", ["os.system", "builtins.exec", "builtins.eval", "getattr chain"])
def test_hostile_tensor_record_is_refused_naming_file_and_key(tmp_path, name, nested):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[name]
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(4)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    hostile = pickle.dumps(_nested(payload) if nested else payload, protocol=2)
    _replace_record_pickle(tmp_path / "ckpt", "model.w", hostile)

    ckpt = ckptkit.open(str(tmp_path / "ckpt"))
    with pytest.raises(ckptkit.UnsafePickleError) as info:
        ckpt.read("model.w")
    assert "model.w" in str(info.value) and "__0_0.distcp" in str(info.value)
    assert info.value.global_name in str(info.value)
    frame = ckpt.verify()
    assert list(frame["problem"]) == ["unsafe pickle"] and frame["key"][0] == "model.w"
    assert torch.equal(ckpt.read("model.v"), torch.ones(4))
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# The escape hatch.


def test_trust_runs_the_real_loader_for_objects_only(tmp_path):
    marker = tmp_path / "ran"
    state = {
        "model": {"w": torch.ones(2)},
        "train": {"hook": _Payload(os.system, f"touch {marker}")},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    ckpt = ckptkit.open(str(tmp_path / "ckpt"))
    assert is_opaque(ckpt.read_object("train.hook")) and not marker.exists()
    assert ckpt.read_object("train.hook", trust=True) == 0  # os.system's exit status
    assert marker.exists()  # documented: trust=True runs the pickle's code
    import inspect

    assert "trust" not in inspect.signature(ckptkit.open).parameters  # never for metadata


@pytest.mark.parametrize(
    "module, name",
    [("torch", "FloatStorage"), ("torch._utils", "_rebuild_tensor_v2"), ("_codecs", "encode")],
)
def test_build_cannot_rewrite_allowlisted_globals(module, name):
    """GLOBAL + BUILD with slot state would otherwise change a shared stand-in for every later
    load (a storage class's dtype, a function's defaults)."""
    from ckptkit.decoding.unpickler import OBJECT_GLOBALS, TENSOR_GLOBALS

    state = {"dtype": OBJECT_GLOBALS["torch.int64"], "__defaults__": (True,)}
    crafted = (
        b"\x80\x02c"
        + f"{module}\n{name}\n".encode()  # GLOBAL
        + b"N"
        + pickle.dumps(state, protocol=2)[2:-1]  # None, then the slot-state dict
        + b"\x86b."  # TUPLE2, BUILD, STOP
    )
    with pytest.raises(ckptkit.UnsafePickleError, match="BUILD"):
        safe_loads(crafted, allow=OBJECT_GLOBALS, source="crafted", unknown="opaque")
    # nothing shared changed: a real torch-written tensor record still decodes as float32
    assert TENSOR_GLOBALS["torch.FloatStorage"].dtype.name == "float32"
    buffer = io.BytesIO()
    torch.save(torch.ones(2), buffer)
    from ckptkit.decoding.records import decode_tensor_record

    assert decode_tensor_record(buffer.getvalue(), "record").dtype.name == "float32"
