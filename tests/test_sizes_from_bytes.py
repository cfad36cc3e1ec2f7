"""Every size comes from bytes present, and a file gives one answer (issue 24, items 4 and 5).

Each hostile file starts as a real one (torch.save, the safetensors library, torch.jit.save, the
Megatron fixtures) and is edited here; the ckptkit call runs in a subprocess whose address
space is capped (``RLIMIT_AS``) and whose time is bounded, and must end in ckptkit's typed
error (or the right answer). The edited source is unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import pickletools
import shutil
import struct
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from byte_edits import central_entry, unframed
from safetensors.torch import save_file

import ckptkit
from ckptkit import errors

from conformance_cases import FIXTURES, MEGATRON_ITEMS
from isolated import run_script

#: Address space of the subprocess running a hostile call (numpy and pandas fit in it; the
#: allocations the attacks used to cause do not).
LIMIT = 1536 << 20

_PRELUDE = f"""
import json, resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
import ckptkit

def outcome(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = {{"value": call()}}
        except Exception as exc:  # typed or not: the test decides
            found = {{"error": type(exc).__name__, "message": str(exc)}}
    found["warnings"] = [str(w.message) for w in caught]
    return found
"""


def _bounded(body: str, *args: object, timeout: float = 120) -> Any:
    """Run ``body`` (with ``outcome`` and ``ckptkit`` in scope, printing one JSON line last)
    under :data:`LIMIT` of address space and ``timeout`` seconds; its JSON answer."""
    out = run_script(_PRELUDE + textwrap.dedent(body), *args, timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def _raised(found: dict, expected: type[Exception], *named: str) -> str:
    """Assert ``found`` is an error of class ``expected`` (or a subclass) naming ``named``."""
    assert "error" in found, found
    cls = getattr(errors, found["error"], None)
    assert cls is not None and issubclass(cls, expected), found
    for name in named:
        assert name in found["message"], (name, found["message"])
    return found["message"]


def _digest(path: Path) -> str:
    """SHA-256 over a file, or over every file below a directory (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _rewrite(src: Path, dst: Path, edit=None, twins: dict[str, bytes] | None = None) -> None:
    """Copy the zip ``src`` to ``dst`` member by member (``edit(name, data)`` giving new bytes);
    a member named in ``twins`` is preceded by another of the same name holding those bytes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename in (twins or {}):
                zout.writestr(zipfile.ZipInfo(info.filename), twins[info.filename])
            data = zin.read(info)
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.compress_type = info.compress_type
            if info.filename in (twins or {}):
                with pytest.warns(UserWarning, match="Duplicate name"):
                    zout.writestr(copy, edit(info.filename, data) if edit else data)
            else:
                zout.writestr(copy, edit(info.filename, data) if edit else data)


# --------------------------------------------------------------------------------------------
# Megatron: a stacked tensor claiming more layers than its records hold.

STACKED_KEY = "decoder.layers.mlp.linear_fc1.weight"


def _claim_layers(metadata: bytes, key: str, layers: int) -> bytes:
    """The DCP ``.metadata`` pickle with the global layer count of ``key`` set to ``layers``
    (its chunks and records untouched)."""
    data = unframed(metadata)
    ops = list(pickletools.genops(data))
    at = next(i for i, (_, arg, _) in enumerate(ops) if arg == key)
    build = next(i for i in range(at, len(ops)) if ops[i][0].name == "BUILD")  # properties
    op, count, pos = next(ops[i] for i in range(build, len(ops)) if "BININT" in ops[i][0].name)
    assert count == 2, count  # the fixtures' two layers: the size's first dimension
    width = {"BININT1": 2, "BININT2": 3, "BININT": 5}[op.name]
    return (
        data[:pos] + b"\x8a\x08" + layers.to_bytes(8, "little", signed=True) + data[pos + width :]
    )


def test_megatron_layers_beyond_the_records_are_refused_before_a_list_is_made(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint", copy)
    metadata = copy / ".metadata"
    metadata.write_bytes(_claim_layers(metadata.read_bytes(), STACKED_KEY, 10**10))
    before = _digest(copy)
    found = _bounded(
        """
        path, key = sys.argv[1], sys.argv[2]
        opened = outcome(lambda: sorted(ckptkit.open(path).catalog.entries))
        ckpt = ckptkit.open(path)
        read = outcome(lambda: ckpt.read_numpy(f"stacked.{key}").shape)
        problems = outcome(lambda: ckptkit.verify(ckpt).to_dict("records"))
        print(json.dumps({"opened": opened, "read": read, "problems": problems}))
        """,
        copy,
        STACKED_KEY,
    )
    opened = found["opened"]
    assert "value" in opened, opened
    (warning,) = [w for w in opened["warnings"] if "no per-layer views" in w]
    assert f"claims {10**10} layers" in warning and STACKED_KEY in warning
    entries = set(opened["value"])
    assert f"stacked.{STACKED_KEY}" in entries
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" not in entries
    assert "model.decoder.layers.1.mlp.linear_fc2.weight" in entries  # the rest is intact
    _raised(found["read"], errors.CoverageError, STACKED_KEY)
    (problem,) = found["problems"]["value"]
    assert problem["key"] == f"stacked.{STACKED_KEY}" and problem["problem"] == "coverage"
    assert _digest(copy) == before


def test_a_megatron_record_whose_local_header_disagrees_is_named(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint", copy)
    record = ckptkit.open(str(copy)).catalog.entries[f"stacked.{STACKED_KEY}"].chunks[0].record
    data = bytearray((copy / record.file).read_bytes())
    at = data.find(b"archive/data/0", record.offset, record.offset + record.length)
    assert data[at - 30 : at - 26] == b"PK\x03\x04"  # the local header's name, not the directory's
    data[at + len("archive/data/")] = ord("9")  # archive/data/9
    (copy / record.file).write_bytes(bytes(data))
    before = _digest(copy)
    found = _bounded(
        """
        path, key = sys.argv[1], sys.argv[2]
        opened = outcome(lambda: len(ckptkit.open(path).catalog.entries))
        ckpt = ckptkit.open(path)
        read = outcome(lambda: ckpt.read_numpy(f"stacked.{key}").shape)
        print(json.dumps({"opened": opened, "read": read}))
        """,
        copy,
        STACKED_KEY,
    )
    (warning,) = [w for w in found["opened"]["warnings"] if "no per-layer views" in w]
    assert "'archive/data/0'" in warning and "disagrees with the central directory" in warning
    _raised(found["read"], errors.CorruptRecordError, record.file, "archive/data/0", "name")
    assert _digest(copy) == before


@pytest.mark.parametrize("item", MEGATRON_ITEMS)
def test_megatron_fixtures_still_open_with_their_layer_views(item):
    ckpt = ckptkit.open(str(FIXTURES / item / "checkpoint"))
    stacked = ckpt.read_numpy(f"stacked.{STACKED_KEY}")
    for layer in range(stacked.shape[0]):
        view = ckpt.read_numpy(f"model.decoder.layers.{layer}.mlp.linear_fc1.weight")
        np.testing.assert_array_equal(view, stacked[layer])


# --------------------------------------------------------------------------------------------
# A broadcast (stride 0) tensor claiming more elements than its bytes.


def _broadcast_file(tmp_path: Path, numel: int) -> Path:
    """torch.save of ``ones(1).expand(5)`` (one stored element, stride 0) whose ``data.pkl``
    then claims ``numel`` elements."""
    original = tmp_path / "orig.pt"
    torch.save({"w": torch.ones(1).expand(5), "b": torch.arange(4.0)}, original)

    def edit(name: str, data: bytes) -> bytes:
        if not name.endswith("/data.pkl"):
            return data
        (pos,) = [p for op, arg, p in pickletools.genops(data) if op.name == "BININT1" and arg == 5]
        return data[:pos] + b"\x8a\x08" + numel.to_bytes(8, "little") + data[pos + 2 :]

    path = tmp_path / "bc.pt"
    _rewrite(original, path, edit)
    return path


_CALLS = {
    "stats": "ckptkit.stats(path)",
    "unshard": "ckptkit.unshard(path, out, progress=False)",
    "diff": "ckptkit.diff(path, path)",
    "read": "ckptkit.open(path).read_numpy('bc.w')",
}


@pytest.mark.parametrize("numel", [3 * 10**8, 10**12])
def test_a_broadcast_beyond_its_bytes_is_refused_before_allocating(tmp_path, numel):
    path = _broadcast_file(tmp_path, numel)
    assert path.stat().st_size < 2048
    before = _digest(path)
    calls = ", ".join(f"{name!r}: outcome(lambda: {call})" for name, call in _CALLS.items())
    found = _bounded(
        f"""
        path, out = sys.argv[1], sys.argv[2]
        results = {{{calls}}}
        results["verify"] = outcome(lambda: ckptkit.verify(path).to_dict("records"))
        print(json.dumps(results))
        """,
        path,
        tmp_path / "out",
    )
    for name in _CALLS:
        message = _raised(found[name], errors.LimitExceededError, "bc.w", "strides [0]")
        assert str(numel * 4) in message, (name, message)
    (problem,) = found["verify"]["value"]
    assert problem["key"] == "bc.w" and problem["problem"] == "limit"
    assert not (tmp_path / "out").exists()
    assert _digest(path) == before


def test_a_genuine_broadcast_and_contiguous_tensors_read_as_torch_loads_them(tmp_path):
    path = tmp_path / "genuine.pt"
    state = {"w": torch.ones(1).expand(5), "m": torch.arange(12.0).reshape(3, 4).t()}
    torch.save(state, path)
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(5), "m": torch.arange(12.0).reshape(3, 4).t().contiguous()}, plain)
    loaded = torch.load(path, weights_only=True)
    ckpt = ckptkit.open(str(path))
    for key, tensor in loaded.items():
        np.testing.assert_array_equal(ckpt.read_numpy(f"genuine.{key}"), tensor.numpy())
    ours, contiguous = ckptkit.stats(str(path)), ckptkit.stats(str(plain))
    assert list(ours["fingerprint"]) == list(contiguous["fingerprint"])
    assert ckptkit.verify(str(path)).empty


# --------------------------------------------------------------------------------------------
# safetensors shapes that are not sizes.


def _safetensors_with_shape(src: Path, dst: Path, name: str, shape_json: str) -> None:
    """``src`` (written by the safetensors library) with tensor ``name``'s shape replaced by
    the JSON text ``shape_json``, its data bytes untouched."""
    raw = src.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header[name]["shape"] = "@shape@"
    text = json.dumps(header).replace('"@shape@"', shape_json).encode()
    dst.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


SHAPES = ["[Infinity]", "[NaN]", "[-Infinity]", "[-3]", "[3.0]", "[1.5]", "[1e400]",
          f"[{2**63}]", f"[{10**30}]", '["3"]', "[true]", "3", "null", "[[3]]"]  # fmt: skip


def test_safetensors_shapes_that_are_not_sizes_are_format_errors(tmp_path):
    original = tmp_path / "orig.safetensors"
    save_file({"w": torch.arange(3.0), "b": torch.ones(2, 2)}, original)
    files = []
    for number, shape in enumerate(SHAPES):
        files.append(tmp_path / f"bad{number}.safetensors")
        _safetensors_with_shape(original, files[-1], "w", shape)
    before = [_digest(f) for f in files]
    found = _bounded(
        """
        paths = sys.argv[1:]
        print(json.dumps([outcome(lambda: ckptkit.open(p).read_numpy(p.rsplit("/", 1)[1].split(".")[0] + ".w").shape) for p in paths]))
        """,
        *files,
    )
    for shape, file, result in zip(SHAPES, files, found, strict=True):
        message = _raised(result, errors.FormatError, file.name, "'w'")
        assert "shape" in message, (shape, message)
    assert [_digest(f) for f in files] == before
    ckpt = ckptkit.open(str(original))  # the real file still reads
    np.testing.assert_array_equal(ckpt.read_numpy("orig.w"), np.arange(3.0, dtype="<f4"))


# --------------------------------------------------------------------------------------------
# TorchScript code parsed only within bounds.


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "orig.pt"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    torch.jit.save(torch.jit.script(model), path)
    return path


def _with_code(src: Path, dst: Path, added: dict[str, bytes]) -> None:
    """``src`` with ``added[module]`` appended to the code member ``…/code/__torch__/<module>``
    (or, when this process scripted the class before, its mangled ``<module>/___torch_mangle_N.py``)."""

    def edit(name: str, data: bytes) -> bytes:
        for module, extra in added.items():
            stem = f"/code/__torch__/{module.removesuffix('.py')}"
            if name.endswith(f"{stem}.py") or (stem + "/___torch_mangle_") in name:
                return data + extra
        return data

    _rewrite(src, dst, edit)


LINEAR = "torch/nn/modules/linear.py"
CONTAINER = "torch/nn/modules/container.py"


@pytest.mark.parametrize(
    ("lines", "refused"),
    [(786432, "declares"), (200000, "tokens")],  # 1.5 MiB of code; 400 KB of one-token lines
)
def test_torchscript_code_past_the_bounds_is_refused_unparsed(tmp_path, lines, refused):
    path = tmp_path / "big.pt"
    _with_code(_script(tmp_path), path, {LINEAR: b"a\n" * lines})
    assert path.stat().st_size < 16384  # a few KB on disk, compressed
    before = _digest(path)
    found = _bounded(
        """
        print(json.dumps(outcome(lambda: len(ckptkit.open(sys.argv[1]).catalog.entries))))
        """,
        path,
        timeout=60,
    )
    module = (
        f"code/__torch__/{LINEAR.removesuffix('.py')}"  # linear.py, or linear/___torch_mangle_N.py
    )
    _raised(found, errors.LimitExceededError, "big.pt", module, refused)
    assert _digest(path) == before


def test_torchscript_code_of_an_archive_is_bounded_in_all(tmp_path):
    path, original = tmp_path / "many.pt", _script(tmp_path)
    _with_code(original, path, {LINEAR: b"a\n" * 300, CONTAINER: b"a\n" * 300})
    found = _bounded(
        """
        import ckptkit.formats.torchscript as torchscript
        path = sys.argv[1]
        whole = outcome(lambda: sorted(ckptkit.open(path).catalog.entries))
        torchscript.MAX_ARCHIVE_CODE_TOKENS = 1000
        bounded = outcome(lambda: sorted(ckptkit.open(path).catalog.entries))
        print(json.dumps({"whole": whole, "bounded": bounded}))
        """,
        path,
    )
    # within the bounds: the keys torch loads from the archive before the (unrun) lines were added
    expected = sorted(f"many.{k}" for k in torch.jit.load(str(original)).state_dict())
    assert found["whole"]["value"] == expected
    _raised(found["bounded"], errors.LimitExceededError, "many.pt", "1000")


# --------------------------------------------------------------------------------------------
# One answer per file: duplicate members, local headers disagreeing, overlapping members.


def _torch_file(tmp_path: Path) -> Path:
    path = tmp_path / "orig.pt"
    torch.save({"w": torch.arange(4.0), "b": torch.full((3,), 2.0)}, path)
    return path


def _checked_everywhere(path: Path, tmp_path: Path) -> dict:
    """What open, stats, diff, unshard and verify make of ``path``, under the bounds."""
    return _bounded(
        """
        path, out = sys.argv[1], sys.argv[2]
        found = {
            "open": outcome(lambda: len(ckptkit.open(path).catalog.entries)),
            "stats": outcome(lambda: len(ckptkit.stats(path))),
            "diff": outcome(lambda: len(ckptkit.diff(path, path))),
            "unshard": outcome(lambda: ckptkit.unshard(path, out, progress=False) and None),
            "verify": outcome(lambda: ckptkit.verify(path).to_dict("records")),
        }
        print(json.dumps(found))
        """,
        path,
        tmp_path / "out",
    )


def _refused_everywhere(found: dict, *named: str) -> None:
    for call in ("open", "stats", "diff", "unshard"):
        _raised(found[call], errors.CorruptRecordError, *named)
    (problem,) = found["verify"]["value"]
    assert all(name in problem["detail"] for name in named), problem


def test_a_member_listed_twice_is_refused_though_torch_loads_the_first(tmp_path):
    original = _torch_file(tmp_path)
    path = tmp_path / "dup.pt"
    other = np.full(4, 7.0, "<f4").tobytes()
    _rewrite(original, path, twins={"orig/data/0": other})
    # the two answers: torch.load takes the first copy, zipfile (and ckptkit, before) the last
    assert torch.load(path, weights_only=True)["w"].tolist() == [7.0] * 4
    with zipfile.ZipFile(path) as archive:
        assert archive.read("orig/data/0") == np.arange(4.0, dtype="<f4").tobytes()
    before = _digest(path)
    _refused_everywhere(_checked_everywhere(path, tmp_path), "dup.pt", "'orig/data/0'", "twice")
    assert not (tmp_path / "out").exists()
    assert _digest(path) == before


def test_a_torchscript_storage_listed_twice_is_refused(tmp_path):
    original = _script(tmp_path)
    with zipfile.ZipFile(original) as archive:
        storage = next(n for n in archive.namelist() if "/data/" in n)
        size = archive.getinfo(storage).file_size
    path = tmp_path / "dup.pt"
    _rewrite(original, path, twins={storage: bytes(size)})
    before = _digest(path)
    found = _bounded(
        "print(json.dumps(outcome(lambda: len(ckptkit.open(sys.argv[1]).catalog.entries))))",
        path,
    )
    _raised(found, errors.CorruptRecordError, "dup.pt", repr(storage), "twice")
    assert _digest(path) == before


def _disagreeing(path: Path, how: str) -> tuple[bytes, str]:
    """The torch.save file ``path`` with member ``orig/data/0`` edited ``how``; the words the
    refusal must name."""
    blob = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        infos = {i.filename: i for i in archive.infolist()}
    member = infos["orig/data/0"]
    local = member.header_offset
    central = central_entry(blob, b"orig/data/0")
    assert blob[local + 6] & 0x08  # torch writes CRC-32 and sizes after the data (0 here)
    if how == "name":
        blob[local + 30 + len("orig/data/0") - 1] = ord("9")
    elif how == "compression":
        blob[local + 8 : local + 10] = (8).to_bytes(2, "little")
    elif how == "size":
        blob[local + 22 : local + 26] = (member.file_size + 1).to_bytes(4, "little")
    elif how == "crc":
        blob[local + 14 : local + 18] = ((member.CRC + 1) & 0xFFFFFFFF).to_bytes(4, "little")
    elif how == "offset":  # the directory points at another member's local header
        blob[central + 42 : central + 46] = infos["orig/data.pkl"].header_offset.to_bytes(
            4, "little"
        )
    elif how == "overlap":  # sizes reaching over the next member's local header
        start = local + 30 + int.from_bytes(blob[local + 26 : local + 28], "little")
        start += int.from_bytes(blob[local + 28 : local + 30], "little")
        following = min(i.header_offset for i in infos.values() if i.header_offset > local)
        size = (following - start + 8).to_bytes(4, "little")
        blob[central + 20 : central + 28] = size + size
    words = {"offset": "name", "overlap": "overlaps", "compression": "compression method"}
    words["crc"] = "CRC-32"
    return bytes(blob), words.get(how, how)


@pytest.mark.parametrize("how", ["name", "compression", "size", "crc", "offset", "overlap"])
def test_a_local_header_disagreeing_with_the_directory_is_refused(tmp_path, how):
    path = tmp_path / "edited.pt"
    blob, word = _disagreeing(_torch_file(tmp_path), how)
    path.write_bytes(blob)
    before = _digest(path)
    found = _checked_everywhere(path, tmp_path)
    _refused_everywhere(found, "edited.pt", "'orig/data/0'", word)
    assert _digest(path) == before


def test_torch_written_archives_still_open(tmp_path):
    path = _torch_file(tmp_path)
    ckpt = ckptkit.open(str(path))
    np.testing.assert_array_equal(ckpt.read_numpy("orig.w"), np.arange(4.0, dtype="<f4"))
    assert ckptkit.verify(str(path)).empty
    (tmp_path / "script").mkdir()
    script = _script(tmp_path / "script")
    expected = sorted(f"orig.{k}" for k in torch.jit.load(str(script)).state_dict())
    assert sorted(ckptkit.open(str(script)).catalog.entries) == expected
