"""Pre-1.6 (non-zip) torch.save files, each written here by ``torch.save(...,
_use_new_zipfile_serialization=False)`` (or DeepSpeed's fixture), read back against
``torch.load``; checkpoint-suffix group names; hostile edits of real legacy files."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import pickletools
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.decoding.unpickler import TensorRef, is_opaque
from ckptkit.formats.parts.torch_save_files import group_of, load_pickles, tensor_record
from ckptkit.storage import Storage

from conformance_cases import flatten_tensors
from oracle import assert_bit_equal, raw_bytes

FIXTURES = Path(__file__).parent / "fixtures"
DEEPSPEED = FIXTURES / "deepspeed_zero2_legacy_serialization_ws2"
CLI = Path(__file__).parent.parent / ".venv" / "bin" / "ckptkit"

DTYPES = [
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def save_legacy(obj, path: Path) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    assert not path.read_bytes().startswith(b"PK"), "torch wrote a zip"
    return path


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_state() -> dict:
    gen = torch.Generator().manual_seed(11)
    state = {}
    for dt in DTYPES:
        values = torch.randn(3, 5, generator=gen) * 50
        if dt.is_complex:
            state[_name(dt)] = torch.complex(values, -values).to(dt)
        else:
            state[_name(dt)] = values.to(dt)
    return state


def rich_state() -> dict:
    """Shared storages, views, strides, nesting, 0-d and empty tensors, objects beside them."""
    gen = torch.Generator().manual_seed(5)
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    shared = torch.randn(10, generator=gen)
    return {
        "model": collections.OrderedDict(
            base=base,
            transposed=base.t(),  # same storage, non-contiguous
            window=base[1:4, 2:7],  # offset into the storage, strided rows
            every_other=base[:, ::2],  # stride 2 in the last dimension
            row=base[5],
            channels_last=torch.randn(2, 3, 2, 2, generator=gen).to(
                memory_format=torch.channels_last
            ),
            scalar=torch.tensor(2.5, dtype=torch.float64),
            empty=torch.empty(0, 4),
            bf16=torch.randn(4, 3, generator=gen).to(torch.bfloat16),
        ),
        "pair": [shared, shared[3:]],  # a tensor and its tail: one storage, written once
        "nested": {"list": [torch.ones(2), {"deep": torch.zeros(3, dtype=torch.int32)}]},
        "tuple": (torch.full((2,), 7, dtype=torch.int16), 3),
        "step": 17,
        "lr": 1e-3,
        "name": "run-1",
        "betas": (0.9, 0.95),
        "losses": [2.5, 2.25],
    }


def lookup(value, path: list[str]):
    for part in path:
        value = value[int(part)] if isinstance(value, (list, tuple)) else value[part]
    return value


def assert_matches_torch(path: Path, group: str) -> int:
    """Every tensor ckptkit reads equals torch.load's (weights_only True and False), and
    ckptkit lists exactly torch's tensors; returns how many were compared."""
    ckpt = ckptkit.open(str(path))
    safe = torch.load(path, weights_only=True)
    full = torch.load(path, weights_only=False)
    expected = flatten_tensors(safe, walk_tuples=True, prefix=(group,))
    assert set(ckpt.tensors["key"]) == set(expected)
    for key in expected:
        actual = ckpt.read(key)
        inner = key.split(".")[1:]
        assert_bit_equal(actual, lookup(safe, inner), key)
        assert_bit_equal(actual, lookup(full, inner), key)
    return len(expected)


def storage_header_offset(data: bytes) -> int:
    """Where the first storage's 8-byte header is: after the five pickles (read with
    ``pickletools``, independently of ckptkit)."""
    stream = io.BytesIO(data)
    for _ in range(5):
        for op, _, _ in pickletools.genops(stream):
            if op.name == "STOP":
                break
    return stream.tell()


# --------------------------------------------------------------------------------------------
# Reading, against torch.load.


def test_every_dtype_reads_bit_equal(tmp_path):
    path = save_legacy(dtype_state(), tmp_path / "dtypes.pt")
    assert assert_matches_torch(path, "dtypes") == len(DTYPES)
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "torch_save"
    assert set(ckpt.tensors["dtype"]) == {_name(dt) for dt in DTYPES}


def test_dtypes_torch_cannot_reload_are_still_read(tmp_path):
    """uint16 / float8 go through an untyped byte storage, which torch's own legacy loader
    rejects; ckptkit reads them against the saved values."""
    state = {
        "u16": (torch.arange(6) * 1000).to(torch.uint16),
        "f8": torch.tensor([0.5, -2.0, 3.0]).to(torch.float8_e4m3fn),
    }
    path = save_legacy(state, tmp_path / "odd.pt")
    ckpt = ckptkit.open(str(path))
    for key, tensor in state.items():
        assert_bit_equal(ckpt.read(f"odd.{key}"), tensor, key)


def test_shared_storages_views_and_containers(tmp_path):
    state = rich_state()
    path = save_legacy(state, tmp_path / "rich.pt")
    assert assert_matches_torch(path, "rich") == 14
    ckpt = ckptkit.open(str(path))
    entries = ckpt.catalog.entries
    # views of one storage point into the same bytes: the window lies inside base's record
    base, window = entries["rich.model.base"].chunks[0].record, entries["rich.model.window"]
    inner = window.chunks[0].record
    assert inner.file == base.file
    assert base.offset < inner.offset < base.offset + base.length
    assert inner.stride == (8, 1)
    assert entries["rich.model.transposed"].chunks[0].record.stride == (1, 8)
    # a storage shared by two tensors is written once: the file is smaller than their sum
    pair = [entries[f"rich.pair.{i}"].chunks[0].record for i in (0, 1)]
    assert pair[1].offset == pair[0].offset + 3 * 4
    assert entries["rich.model.empty"].chunks == () or all(
        c.record is None for c in entries["rich.model.empty"].chunks
    )
    # objects beside tensors come back as torch.load gives them
    full = torch.load(path, weights_only=False)
    for key in ("step", "lr", "name", "betas", "losses", "tuple.1"):
        assert ckpt.read_object(f"rich.{key}") == lookup(full, key.split(".")), key


def test_load_pickles_gives_zips_and_legacy_files_alike(tmp_path):
    """The shared entry point other adapters build on: same decoded value and tensor bytes."""
    state = rich_state()
    torch.save(state, tmp_path / "new.pt")
    save_legacy(state, tmp_path / "old.pt")
    storage = Storage(str(tmp_path))
    pickled = load_pickles(storage, ["new.pt", "old.pt"])
    new, old = pickled["new.pt"], pickled["old.pt"]
    assert old.crc32 is None and new.crc32 is not None
    for key, ref in _tensor_refs(new.value).items():
        other = _tensor_refs(old.value)[key]
        assert (ref.shape, ref.stride, ref.dtype) == (other.shape, other.stride, other.dtype)
        a = tensor_record(key, ref, new.index, new.source)
        b = tensor_record(key, other, old.index, old.source)
        if a is None:
            assert b is None
            continue
        assert a.length == b.length
        (bytes_new,) = storage.read_ranges([(a.file, a.offset, a.offset + a.length)])
        (bytes_old,) = storage.read_ranges([(b.file, b.offset, b.offset + b.length)])
        assert bytes_new == bytes_old, key


def _tensor_refs(value, path=()) -> dict[str, TensorRef]:
    if isinstance(value, TensorRef):
        return {".".join(map(str, path)): value}
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            found |= _tensor_refs(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found |= _tensor_refs(item, (*path, i))
    return found


def test_deepspeed_legacy_fixture_files_match_their_reference():
    reference = json.loads((DEEPSPEED / "reference" / "tensors.sha256.json").read_text())
    checked = 0
    for rel, specs in reference.items():
        if not rel.startswith("checkpoint/"):
            continue
        path = DEEPSPEED / rel
        assert path.read_bytes()[:4] == b"\x80\x02\x8a\x0a"  # the fixture is pre-1.6
        ckpt = ckptkit.open(str(path))
        group = path.name.split(".")[0]
        for key, spec in specs.items():
            tensor = ckpt.read(f"{group}.{key}")
            assert list(tensor.shape) == spec["shape"], key
            assert str(tensor.dtype).removeprefix("torch.") == spec["dtype"], key
            assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key
            checked += 1
    assert checked == sum(len(s) for r, s in reference.items() if r.startswith("checkpoint/"))
    assert checked > 0


# --------------------------------------------------------------------------------------------
# Operations through the catalog.


def test_cli_inspect_lists_the_tensors(tmp_path):
    path = save_legacy(rich_state(), tmp_path / "rich.pt")
    result = subprocess.run(
        [str(CLI), "inspect", str(path), "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "torch_save"
    expected = flatten_tensors(torch.load(path, weights_only=True), walk_tuples=True)
    assert {t["key"] for t in doc["tensors"]} == {f"rich.{k}" for k in expected}


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_unshard_round_trip(tmp_path, to):
    path = save_legacy(rich_state(), tmp_path / "rich.pth.tar")
    out = tmp_path / "out"
    ckptkit.unshard(str(path), str(out), to=to, progress=False)
    suffix = ".safetensors" if to == "safetensors" else ".pt"
    assert (out / f"rich{suffix}").exists(), sorted(os.listdir(out))
    back = ckptkit.open(str(out))
    expected = flatten_tensors(torch.load(path, weights_only=True), walk_tuples=True)
    assert set(back.tensors["key"]) == {f"rich.{k}" for k in expected}
    for key, tensor in expected.items():
        assert_bit_equal(back.read(f"rich.{key}"), tensor, key)


def test_diff_with_itself_and_verify(tmp_path):
    path = save_legacy(rich_state(), tmp_path / "rich.pt")
    frame = ckptkit.diff(str(path), str(path))
    assert len(frame) == len(ckptkit.open(str(path)).keys())
    assert (frame["status"] == "equal").all(), frame[frame["status"] != "equal"].to_string()
    problems = ckptkit.verify(str(path))
    assert problems.empty, problems.to_string()


def test_changed_storage_bytes_pass_verify_but_not_diff(tmp_path):
    """No CRC in this format: a changed element leaves a well-formed file; diff sees it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path = save_legacy({"w": torch.zeros(4)}, tmp_path / "a" / "m.pt")
    other = tmp_path / "b" / "m.pt"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the last byte of the only storage
    other.write_bytes(bytes(data))
    assert ckptkit.verify(str(other)).empty
    frame = ckptkit.diff(str(path), str(other)).set_index("key")
    assert frame.loc["m.w", "status"] != "equal"
    assert_bit_equal(ckptkit.open(str(other)).read("m.w"), torch.load(other)["w"], "w")


# --------------------------------------------------------------------------------------------
# Group names and directories.


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("mir-1k.ckpt", "mir-1k"),
        ("model.pth.tar", "model"),
        ("model.tar", "model"),
        ("model.jit", "model"),
        ("model.pt", "model"),
        ("model.pth", "model"),
        ("model.bin", "model"),
        ("model.safetensors", "model"),
        ("model-00001-of-00002.bin", "model"),
        ("v1.2.ckpt", "v1.2"),
        ("notes.txt", "notes.txt"),
    ],
)
def test_group_is_the_stem_without_checkpoint_suffix(name, group):
    assert group_of(name) == group


def test_directory_of_ckpt_and_pth_tar_files(tmp_path):
    first = {"w": torch.randn(3, 2), "step": 4}
    second = {"b": torch.arange(5), "nested": {"x": torch.ones(2, dtype=torch.float16)}}
    save_legacy(first, tmp_path / "mir-1k.ckpt")
    torch.save(second, tmp_path / "head.pth.tar")  # a zip beside a pre-1.6 file
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "torch_save"
    assert set(ckpt.tensors["key"]) == {"mir-1k.w", "head.b", "head.nested.x"}
    assert ckpt.read_object("mir-1k.step") == 4
    assert_bit_equal(ckpt.read("mir-1k.w"), first["w"], "w")
    assert_bit_equal(ckpt.read("head.nested.x"), second["nested"]["x"], "x")
    out = tmp_path.parent / f"{tmp_path.name}-out"
    ckptkit.unshard(str(tmp_path), str(out), to="safetensors", progress=False)
    assert {"mir-1k.safetensors", "head.safetensors"} <= set(os.listdir(out))
    one = ckptkit.open(str(tmp_path / "mir-1k.ckpt"))
    assert set(one.keys()) == {"mir-1k.w", "mir-1k.step"}


def test_whole_module_is_kept_opaque(tmp_path):
    """Old-style ``torch.save(module)``: the class is a persistent id, kept as a placeholder."""
    path = save_legacy({"net": torch.nn.Linear(2, 3), "w": torch.ones(2)}, tmp_path / "m.pt")
    ckpt = ckptkit.open(str(path))
    assert set(ckpt.keys()) == {"m.net", "m.w"}
    assert (
        ckpt.objects.set_index("key")
        .loc["m.net", "preview"]
        .startswith("<torch.nn.modules.linear.Linear")
    )
    (net,) = ckpt.reader.read_objects([ckpt.entry("m.net")], tensors="ref")
    assert is_opaque(net) and net.global_name == "torch.nn.modules.linear.Linear"
    assert_bit_equal(ckpt.read("m.w"), torch.ones(2), "w")


# --------------------------------------------------------------------------------------------
# Hostile edits of real legacy files: typed errors naming the file, fast, nothing run.


class _Payload:
    """Pickles to a call of ``func(*args)``: what a malicious checkpoint would contain."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_payload_in_the_main_pickle_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    state = {"w": torch.ones(2), "evil": _Payload(os.system, f"touch {marker}")}
    path = save_legacy(state, tmp_path / "evil.pt")
    ckpt = ckptkit.open(str(path))
    evil = ckpt.read_object("evil.evil")
    assert is_opaque(evil) and evil.global_name in ("posix.system", "os.system")
    assert ckptkit.verify(str(path)).empty
    assert_bit_equal(ckpt.read("evil.w"), torch.ones(2), "w")
    assert not marker.exists()


def test_payload_in_a_header_pickle_is_refused(tmp_path):
    """The sys-info pickle replaced by a payload: refused outright (no globals allowed there)."""
    marker = tmp_path / "pwned"
    path = save_legacy({"w": torch.ones(2)}, tmp_path / "evil.pt")
    data = path.read_bytes()
    stream = io.BytesIO(data)
    ends = []
    for _ in range(3):
        for op, _, _ in pickletools.genops(stream):
            if op.name == "STOP":
                break
        ends.append(stream.tell())
    payload = pickle.dumps(_Payload(os.system, f"touch {marker}"), protocol=2)
    path.write_bytes(data[: ends[1]] + payload + data[ends[2] :])
    with pytest.raises(ckptkit.UnsafePickleError, match=r"evil\.pt"):
        ckptkit.open(str(path))
    assert not marker.exists()


def test_storage_header_claiming_2_60_elements(tmp_path):
    path = save_legacy({"w": torch.ones(3)}, tmp_path / "huge.pt")
    data = bytearray(path.read_bytes())
    at = storage_header_offset(bytes(data))
    assert int.from_bytes(data[at : at + 8], "little") == 3
    data[at : at + 8] = (1 << 60).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(ckptkit.CorruptRecordError, match=r"huge\.pt.*header says"):
        ckptkit.open(str(path))
    assert time.monotonic() - start < 2


def test_pickle_claiming_a_huge_storage(tmp_path):
    """The pickle's element count (a 4-byte BININT) raised to 2**31 - 1: past the file's end."""
    numel = 70000
    path = save_legacy({"w": torch.zeros(numel, dtype=torch.uint8)}, tmp_path / "big.pt")
    data = path.read_bytes()
    needle = b"J" + numel.to_bytes(4, "little")
    assert data.count(needle) == 2  # the storage's numel in its persistent id, then the shape
    path.write_bytes(data.replace(needle, b"J" + (2**31 - 1).to_bytes(4, "little"), 1))
    start = time.monotonic()
    with pytest.raises(ckptkit.CorruptRecordError, match=r"big\.pt"):
        ckptkit.open(str(path))
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("keep", [10, 30, 150, -40, -1])
def test_truncated_file(tmp_path, keep):
    path = save_legacy({"w": torch.randn(16), "step": 3}, tmp_path / "cut.pt")
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises((ckptkit.CorruptRecordError, ckptkit.FormatError), match=r"cut\.pt"):
        ckpt = ckptkit.open(str(path))
        ckpt.read("cut.w")


def test_truncated_storage_data_is_a_truncated_file_error(tmp_path):
    path = save_legacy({"w": torch.randn(16)}, tmp_path / "cut.pt")
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ckptkit.errors.TruncatedFileError, match=r"cut\.pt.*truncated"):
        ckptkit.open(str(path))


def test_other_protocol_version_is_a_format_error(tmp_path):
    path = save_legacy({"w": torch.ones(2)}, tmp_path / "proto.pt")
    data = path.read_bytes()
    needle = b"M" + (1001).to_bytes(2, "little")
    assert data.index(needle) < 24
    path.write_bytes(data.replace(needle, b"M" + (1002).to_bytes(2, "little"), 1))
    with pytest.raises(ckptkit.FormatError, match=r"proto\.pt.*protocol version 1002"):
        ckptkit.open(str(path))


def test_big_endian_sys_info_is_refused(tmp_path):
    path = save_legacy({"w": torch.ones(2)}, tmp_path / "be.pt")
    data = bytearray(path.read_bytes())
    at = data.index(b"\x88", data.index(b"little_endian"))  # NEWTRUE → NEWFALSE
    data[at] = 0x89
    path.write_bytes(bytes(data))
    with pytest.raises(ckptkit.CorruptRecordError, match=r"be\.pt.*big-endian"):
        ckptkit.open(str(path))


def test_pre16_rank_files_read_through_the_shared_loader(tmp_path):
    """Per-rank files (``rank{N}.pt``) reach the same loader: pre-1.6 ones read like zips."""
    for rank in (0, 1):
        state = {"model": {"w": torch.arange(4.0) + rank}, "step": 3}
        save_legacy(state, tmp_path / f"rank{rank}.pt")
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "rank_files"
    for rank in (0, 1):
        expected = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["model"]["w"]
        assert_bit_equal(ckpt.read("model.w", rank=rank), expected, f"rank {rank}")
    assert ckpt.read_object("train.step") == 3


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_pickle_protocol_torch_save_accepts(tmp_path, protocol):
    state = {"w": torch.randn(3, 2), "n": 7}
    path = tmp_path / "p.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "torch_save"
    # torch's weights-only unpickler cannot read protocol 4/5 legacy files: the full loader can
    assert_bit_equal(ckpt.read("p.w"), torch.load(path, weights_only=False)["w"], "w")
    assert ckpt.read_object("p.n") == 7


def test_mutated_legacy_files_fail_with_typed_errors_quickly(tmp_path):
    """Random edits of a real pre-1.6 file (flipped bytes, huge numbers, cuts): opening and
    reading everything either works or raises a ckptkit error, each in bounded time."""
    state = {"w": torch.randn(4, 3), "i": torch.arange(5), "view": torch.arange(6.0)[2:], "n": 2}
    original = save_legacy(state, tmp_path / "seed.pt").read_bytes()
    rng = random.Random(0)
    path = tmp_path / "m.pt"
    outcomes = collections.Counter()
    for _ in range(300):
        data = bytearray(original)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            kind = rng.choice(["flip", "number", "cut"])
            if kind == "flip":
                data[at] ^= rng.randint(1, 255)
            elif kind == "number":
                data[at : at + 8] = rng.choice([1 << 60, 2**63 - 1, 0xFFFFFFFF]).to_bytes(
                    8, "little"
                )
            else:
                del data[at:]
        path.write_bytes(bytes(data))
        start = time.monotonic()
        try:
            ckpt = ckptkit.open(str(path))
            for key in list(ckpt):
                if ckpt.entry(key).kind == "tensor":
                    ckpt.read(key)
                else:
                    ckpt.reader.read_objects([ckpt.entry(key)], tensors="ref")
            outcomes["read"] += 1
        except ckptkit.CheckpointError as exc:
            assert "m.pt" in str(exc), exc  # every error names the file
            outcomes[type(exc).__name__] += 1
        assert time.monotonic() - start < 5
    assert outcomes["read"] and len(outcomes) >= 3, outcomes
