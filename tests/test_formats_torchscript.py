"""TorchScript archives (``torch.jit.save``) read without running their code: every file here is
written by torch in the test (then, for the hostile variants, edited), and every key and tensor
is compared with what ``torch.jit.load(f).state_dict()`` gives back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from byte_edits import central_entry
from torch import nn

import ckptkit
from ckptkit.errors import CorruptRecordError, FormatError, LimitExceededError, UnsafePickleError

from oracle import assert_bit_equal, inspect_without_torch, raw_bytes


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.count = nn.Buffer(torch.tensor(5, dtype=torch.int64))  # a 0-d int64 buffer
        self.ids = nn.Buffer(torch.arange(6, dtype=torch.int64) * 7)
        self.cache = nn.Buffer(torch.ones(2), persistent=False)  # TorchScript keeps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.count + self.cache.sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.inner = Inner()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
        self.head = nn.Sequential(nn.Linear(4, 2), nn.ReLU())
        self.bf16 = nn.Parameter(torch.randn(3, 2, generator=gen).to(torch.bfloat16))
        base = torch.randn(4, 6, generator=gen)
        self.base = nn.Parameter(base)
        self.view = nn.Parameter(base.t())  # a non-contiguous view of another parameter
        self.scalar = nn.Buffer(torch.tensor(2.5))
        self.tied = self.blocks[0]  # the same module twice: state_dict lists it under both names
        self.plain = torch.zeros(2)  # a tensor attribute, neither parameter nor buffer
        self.sizes = [1, 2]  # typed containers: torch.jit._pickle globals in data.pkl
        self.extra = {"a": torch.ones(2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.sizes[0] + self.plain.sum() + self.extra["a"].sum()


def _scripted(path: Path) -> None:
    torch.jit.save(torch.jit.script(Net()), path)


def _traced(path: Path) -> None:
    torch.jit.save(torch.jit.trace(Net(), torch.randn(2, 3)), path)


WRITERS: dict[str, Callable[[Path], None]] = {"scripted": _scripted, "traced": _traced}


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torchscript")
    paths = {}
    for name, write in WRITERS.items():
        (root / name).mkdir()
        paths[name] = root / name / f"{name}.pt"
        write(paths[name])
    return paths


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The oracle: the parameters and buffers torch itself loads back."""
    return dict(torch.jit.load(str(path)).state_dict())


def _rewrite(src: Path, dst: Path, edit: Callable[[zipfile.ZipInfo, bytes], tuple[bytes, int]]):
    """Copy the real archive ``src`` to ``dst`` member by member, ``edit`` giving each member's
    new bytes and compression method."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data, method = edit(info, zin.read(info))
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.compress_type = method
            zout.writestr(copy, data)


# --------------------------------------------------------------------------------------------
# What torch writes, read back.


def test_the_archives_hold_what_the_issue_describes(archives):
    """The fixtures exercise the cases: DEFLATE-compressed code members, a strided view, tied
    weights sharing storage, a 0-d int64 buffer, a bf16 parameter, typed-container globals."""
    for path in archives.values():
        with zipfile.ZipFile(path) as archive:
            methods = {i.filename: i.compress_type for i in archive.infolist()}
            pickled = archive.read(f"{path.stem}/data.pkl")
        code = [name for name in methods if "/code/" in name and name.endswith(".py")]
        assert code and any(methods[name] == zipfile.ZIP_DEFLATED for name in code), methods
        assert all(methods[n] == zipfile.ZIP_STORED for n in methods if "/data/" in n)
        state = _state_dict(path)
        assert not state["view"].is_contiguous()
        assert state["view"].data_ptr() == state["base"].data_ptr()
        assert state["tied.weight"].data_ptr() == state["blocks.0.weight"].data_ptr()
        assert state["inner.count"].dtype == torch.int64 and state["inner.count"].dim() == 0
        assert state["bf16"].dtype == torch.bfloat16
        assert "plain" not in state and "blocks.1.bias" not in state
        if path.stem == "scripted":
            assert b"torch.jit._pickle\nrestore_type_tag" in pickled
            assert b"torch.jit._pickle\nbuild_intlist" in pickled


@pytest.mark.parametrize("name", list(WRITERS))
def test_state_dict_keys_order_and_bytes_match_jit_load(archives, name):
    path = archives[name]
    expected = _state_dict(path)
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "torchscript"
    keys = [entry.key for entry in ckpt.catalog.tensors()]
    assert keys == [f"{name}.{key}" for key in expected]  # same names, same order
    assert not list(ckpt.catalog.objects())
    for key, tensor in expected.items():
        assert_bit_equal(ckpt.read(f"{name}.{key}"), tensor, key)


def test_detection_names_the_format_and_its_evidence(archives):
    found = ckptkit.detect(str(archives["scripted"]))
    assert found.format == "torchscript"
    (line,) = found.evidence
    assert "scripted.pt" in line and "TorchScript" in line
    assert "scripted/constants.pkl" in line and "scripted/code/" in line


def test_a_plain_torch_save_file_is_not_torchscript(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    assert ckptkit.detect(str(tmp_path / "plain.pt")).format == "torch_save"
    assert ckptkit.detect(str(tmp_path)).format == "torch_save"


def test_a_directory_of_archives_groups_keys_by_file(archives, tmp_path):
    for path in archives.values():
        shutil.copy(path, tmp_path / path.name)
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "torchscript"
    expected = {
        f"{name}.{key}": tensor
        for name in archives
        for key, tensor in _state_dict(tmp_path / f"{name}.pt").items()
    }
    assert {e.key for e in ckpt.catalog.tensors()} == expected.keys()
    for key, tensor in expected.items():
        assert_bit_equal(ckpt.read(key), tensor, key)


def test_cli_inspect(archives):
    path = archives["traced"]
    result = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "torchscript"
    listed = {item["key"]: item for item in doc["tensors"]}
    expected = _state_dict(path)
    assert listed.keys() == {f"traced.{key}" for key in expected}
    for key, tensor in expected.items():
        item = listed[f"traced.{key}"]
        assert item["shape"] == list(tensor.shape), key
        assert item["dtype"] == str(tensor.dtype).removeprefix("torch."), key


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_unshard_with_default_arguments_reloads_equal(archives, to, tmp_path):
    path = archives["scripted"]
    ckptkit.unshard(str(path), str(tmp_path / "out"), to=to, progress=False)
    expected = _state_dict(path)
    if to == "torch":
        loaded = torch.load(tmp_path / "out" / "scripted.pt", weights_only=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(tmp_path / "out" / "scripted.safetensors")
    flat = _flatten(loaded)
    assert list(flat) == list(expected) if to == "torch" else set(flat) == set(expected)
    for key, tensor in expected.items():
        assert_bit_equal(flat[key], tensor, key)


def _flatten(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Dotted keys of a nested dict of tensors (torch output nests, safetensors is flat)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    found = {}
    for key, item in value.items():
        found.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return found


def test_diff_with_itself_and_verify_clean(archives):
    path = str(archives["traced"])
    frame = ckptkit.diff(path, path)
    assert len(frame) == len(_state_dict(archives["traced"]))
    assert (frame["status"] == "equal").all(), frame
    assert ckptkit.verify(path).empty


def test_inspection_without_torch(archives):
    paths = list(archives.values())
    for path, read in zip(paths, inspect_without_torch(*paths), strict=True):
        group = path.stem
        expected = {f"{group}.{k}": v for k, v in _state_dict(path).items()}
        assert read["tensors"].keys() == expected.keys(), path
        assert read["objects"] == {}
        for key, digest in read["tensors"].items():
            import hashlib

            assert digest == hashlib.sha256(raw_bytes(expected[key])).hexdigest(), key


# --------------------------------------------------------------------------------------------
# Hostile and damaged archives: real archives, then edited.


def test_a_pickle_naming_os_system_is_refused_and_nothing_runs(archives, tmp_path):
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    hostile = b"cos\nsystem\nq\x00X" + len(command).to_bytes(4, "little") + command + b"\x85R"

    def edit(info: zipfile.ZipInfo, data: bytes) -> tuple[bytes, int]:
        if info.filename.endswith("/data.pkl"):
            # the root module: GLOBAL '__torch__.… Net', BINPUT 0, EMPTY_TUPLE, NEWOBJ
            end = data.index(b"q\x00)\x81") + 4
            assert data.startswith(b"\x80\x02c__torch__.") and b"\nNet\n" in data[:end]
            data = b"\x80\x02" + hostile + data[end:]
        return data, info.compress_type

    path = tmp_path / "hostile.pt"
    _rewrite(archives["scripted"], path, edit)
    assert ckptkit.detect(str(path)).format == "torchscript"  # the members look right
    with pytest.raises((UnsafePickleError, FormatError), match="os.system") as raised:
        ckptkit.open(str(path))  # kept as an opaque placeholder: not a module
    assert "hostile.pt" in str(raised.value)
    assert not marker.exists()


def test_a_code_member_declaring_a_huge_size_is_refused_fast(archives, tmp_path):
    path = tmp_path / "huge.pt"
    blob = bytearray(archives["scripted"].read_bytes())
    name = _deflated_code_member(archives["scripted"])
    at = central_entry(blob, name.encode())
    blob[at + 24 : at + 28] = (0xFFFFFFF0).to_bytes(4, "little")  # uncompressed size: ~4 GiB
    path.write_bytes(bytes(blob))
    start = time.monotonic()
    with pytest.raises(LimitExceededError, match=name):
        ckptkit.open(str(path))
    assert time.monotonic() - start < 5


def test_a_code_member_inflating_past_its_declared_size_is_corrupt(archives, tmp_path):
    def edit(info: zipfile.ZipInfo, data: bytes) -> tuple[bytes, int]:
        return data, info.compress_type

    path = tmp_path / "short.pt"
    _rewrite(archives["scripted"], path, edit)
    blob = bytearray(path.read_bytes())
    name = _deflated_code_member(path)
    at = central_entry(blob, name.encode())
    size = int.from_bytes(blob[at + 24 : at + 28], "little")
    blob[at + 24 : at + 28] = (size - 10).to_bytes(4, "little")
    local = int.from_bytes(blob[at + 42 : at + 46], "little")  # the member's local header
    blob[local + 22 : local + 26] = (size - 10).to_bytes(4, "little")  # both headers agree
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptRecordError, match=f"{name}.*inflates to more than"):
        ckptkit.open(str(path))


def _deflated_code_member(path: Path) -> str:
    """The name of a DEFLATE-compressed code member ckptkit needs (the root module's class)."""
    with zipfile.ZipFile(path) as archive:
        (name,) = [
            i.filename
            for i in archive.infolist()
            if i.filename.endswith("code/__torch__/test_formats_torchscript.py")
        ]
        assert archive.getinfo(name).compress_type == zipfile.ZIP_DEFLATED
    return name


def test_a_compressed_storage_is_refused_naming_file_and_member(archives, tmp_path):
    def edit(info: zipfile.ZipInfo, data: bytes) -> tuple[bytes, int]:
        deflate = info.filename.endswith("/data/1")  # ``base``, 24 floats
        return data, zipfile.ZIP_DEFLATED if deflate else info.compress_type

    path = tmp_path / "deflated.pt"
    _rewrite(archives["scripted"], path, edit)
    with pytest.raises(CorruptRecordError, match=r"deflated\.pt.*scripted/data/1.*compressed"):
        ckptkit.open(str(path))


def test_torch_save_ignores_compressed_members_it_does_not_need(tmp_path):
    """A plain torch.save zip whose ``version`` member was DEFLATE-compressed (by a zip tool)
    still reads: only data.pkl and the storages must be stored."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(4)}
    torch.save(state, tmp_path / "orig.pt")

    def edit(info: zipfile.ZipInfo, data: bytes) -> tuple[bytes, int]:
        deflate = info.filename.endswith(("/version", "/.data/serialization_id"))
        return data, zipfile.ZIP_DEFLATED if deflate else info.compress_type

    (tmp_path / "copy").mkdir()
    path = tmp_path / "copy" / "ckpt.pt"
    _rewrite(tmp_path / "orig.pt", path, edit)
    with zipfile.ZipFile(path) as archive:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in archive.infolist())
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "torch_save"
    for key, tensor in state.items():
        assert_bit_equal(ckpt.read(f"ckpt.{key}"), tensor, key)
    assert ckptkit.verify(str(path)).empty


def test_a_module_restored_by_setstate_is_refused(tmp_path):
    """A module whose state comes back through its TorchScript ``__setstate__`` cannot be listed
    without running that code: a clear FormatError, not a guess."""

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))

        @torch.jit.export
        def __getstate__(self) -> tuple[torch.Tensor, bool]:
            return (self.weight, self.training)

        @torch.jit.export
        def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
            self.weight = state[0]
            self.training = state[1]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    path = tmp_path / "packed.pt"
    torch.jit.save(torch.jit.script(Packed()), path)
    with pytest.raises(FormatError, match="__setstate__"):
        ckptkit.open(str(path))


def test_mutated_archives_raise_only_typed_errors(archives, tmp_path):
    """Random byte edits of a real archive (its zip directory, pickle, code members, storages):
    whatever happens, only ckptkit's typed errors come out, and quickly."""
    import random

    source = archives["traced"].read_bytes()
    rng = random.Random(13)
    path = tmp_path / "m.pt"
    outcomes: set[str] = set()
    start = time.monotonic()
    for _ in range(150):
        blob = bytearray(source)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(blob))
            blob[at : at + rng.randint(0, 2)] = bytes(rng.randrange(256) for _ in range(2))
        path.write_bytes(bytes(blob))
        try:
            ckpt = ckptkit.open(str(path), format="torchscript")
            for entry in ckpt.catalog.tensors():
                ckpt.read(entry.key)
            outcomes.add("read")
        except ckptkit.CheckpointError as exc:
            outcomes.add(type(exc).__name__)
    assert "read" in outcomes and len(outcomes) > 2, outcomes
    assert time.monotonic() - start < 120
