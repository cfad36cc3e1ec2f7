"""Damaged checkpoints: each damage, made from a real torch-written checkpoint, raises its own
error class naming the file and the key, and ``verify`` lists it."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

import ckptkit
from ckptkit.decoding.records import zip_members

LEGACY = Path(__file__).parent / "fixtures" / "olmo_torch_legacy_ws2" / "step3"


@pytest.fixture
def ckpt_dir(written, tmp_path) -> Path:
    """A private copy of the FSDP2 world-size-2 sample, free to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(written("fsdp2_ws2").path, target)
    return target


def _tensor_on(path: Path, file: str) -> tuple[str, ckptkit.catalog.Record]:
    """The largest tensor with a chunk stored in ``file``, and that chunk's record."""
    ckpt = ckptkit.open(str(path))
    found = [
        (e.nbytes, e.key, c.record)
        for e in ckpt.catalog.tensors()
        for c in e.chunks
        if c.record is not None and c.record.file == file
    ]
    _, key, record = max(found, key=lambda item: item[0])
    return key, record


def _storage_member(path: Path, record) -> tuple[int, int]:
    """Absolute offset and size of the ``data/0`` storage member inside a DCP record."""
    blob = (path / record.file).read_bytes()[record.offset : record.offset + record.length]
    members = zip_members(memoryview(blob), "test")
    name = next(n for n in members if n.endswith("/data/0"))
    return record.offset + members[name].offset, members[name].size


def _verify_cli(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "verify", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sound_checkpoint_verifies_clean(ckpt_dir):
    assert ckptkit.open(str(ckpt_dir)).verify().empty
    result = _verify_cli(ckpt_dir, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["problems"] == []


def test_missing_metadata(ckpt_dir):
    (ckpt_dir / ".metadata").unlink()
    with pytest.raises(ckptkit.MissingFileError, match=r"\.metadata: no such file") as info:
        ckptkit.open(str(ckpt_dir))
    assert str(ckpt_dir / ".metadata") in str(info.value)
    frame = ckptkit.verify(str(ckpt_dir))
    assert list(frame["problem"]) == ["missing file"]
    assert ".metadata" in frame["detail"][0]
    result = _verify_cli(ckpt_dir)
    assert result.returncode == 1 and "missing file" in result.stdout


def test_missing_shard_file(ckpt_dir):
    key, _ = _tensor_on(ckpt_dir, "__1_0.distcp")
    (ckpt_dir / "__1_0.distcp").unlink()
    ckpt = ckptkit.open(str(ckpt_dir))  # the metadata alone still opens
    with pytest.raises(ckptkit.MissingFileError) as info:
        ckpt.read(key)
    assert "__1_0.distcp" in str(info.value) and key in str(info.value)
    frame = ckpt.verify()
    assert list(frame["problem"]) == ["missing file"]
    assert frame["file"][0] == "__1_0.distcp" and "no such file" in frame["detail"][0]


def test_truncated_file(ckpt_dir):
    key, record = _tensor_on(ckpt_dir, "__1_0.distcp")
    data = ckpt_dir / "__1_0.distcp"
    cut = record.offset + record.length // 2
    with data.open("r+b") as f:
        f.truncate(cut)
    ckpt = ckptkit.open(str(ckpt_dir))
    with pytest.raises(ckptkit.TruncatedFileError) as info:
        ckpt.read(key)
    assert isinstance(info.value, ckptkit.CorruptRecordError)
    assert "__1_0.distcp" in str(info.value) and key in str(info.value)
    assert f"the file has {cut} bytes" in str(info.value)
    frame = ckpt.verify()
    assert set(frame["problem"]) == {"truncated"} and set(frame["file"]) == {"__1_0.distcp"}
    assert key in set(frame["key"])
    assert len(frame) == sum(  # every record past the cut, and only those
        1
        for e in ckpt.catalog.entries.values()
        for c in e.chunks
        if c.record is not None
        and c.record.file == "__1_0.distcp"
        and c.record.offset + c.record.length > cut
    )


def test_flipped_bytes_fail_the_crc(ckpt_dir, written):
    key, record = _tensor_on(ckpt_dir, "__0_0.distcp")
    start, size = _storage_member(ckpt_dir, record)
    data = bytearray((ckpt_dir / "__0_0.distcp").read_bytes())
    data[start + size // 2] ^= 0x5A
    (ckpt_dir / "__0_0.distcp").write_bytes(data)

    with pytest.raises(ckptkit.ChecksumError) as info:
        ckptkit.open(str(ckpt_dir)).read(key)
    assert "__0_0.distcp" in str(info.value) and key in str(info.value)
    # Without the check the damage goes unnoticed: the tensor silently differs from torch's.
    unchecked = ckptkit.open(str(ckpt_dir), verify_crc=False).read(key)
    reference = ckptkit.open(str(written("fsdp2_ws2").path)).read(key)
    assert not torch.equal(unchecked, reference)
    frame = ckptkit.verify(str(ckpt_dir))
    assert list(frame["problem"]) == ["checksum"]
    assert frame["file"][0] == "__0_0.distcp" and frame["key"][0] == key
    assert ckptkit.verify(str(ckpt_dir), crc=False).empty
    result = _verify_cli(ckpt_dir, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["problems"][0]["problem"] == "checksum"


def _rewrite_metadata(path: Path, mutate) -> None:
    metadata = FileSystemReader(str(path)).read_metadata()
    mutate(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def test_record_dtype_disagrees_with_metadata(ckpt_dir):
    key, _ = _tensor_on(ckpt_dir, "__0_0.distcp")

    def mutate(metadata):
        metadata.state_dict_metadata[key].properties.dtype = torch.float64

    _rewrite_metadata(ckpt_dir, mutate)
    ckpt = ckptkit.open(str(ckpt_dir))
    with pytest.raises(ckptkit.MismatchError, match="record holds float32, metadata says float64"):
        ckpt.read(key)
    frame = ckpt.verify()
    assert set(frame["problem"]) == {"mismatch"} and set(frame["key"]) == {key}


def test_record_shape_disagrees_with_metadata(ckpt_dir):
    key, _ = _tensor_on(ckpt_dir, "__0_0.distcp")

    def mutate(metadata):  # one column fewer everywhere: consistent metadata, wrong records
        item = metadata.state_dict_metadata[key]
        item.size = torch.Size([*item.size[:-1], item.size[-1] - 1])
        for chunk in item.chunks:
            chunk.sizes = torch.Size([*chunk.sizes[:-1], chunk.sizes[-1] - 1])

    _rewrite_metadata(ckpt_dir, mutate)
    ckpt = ckptkit.open(str(ckpt_dir))
    with pytest.raises(ckptkit.MismatchError) as info:
        ckpt.read(key)
    assert key in str(info.value) and "distcp" in str(info.value)
    assert set(ckpt.verify()["problem"]) == {"mismatch"}


def test_chunks_that_overlap_or_leave_holes(ckpt_dir):
    ckpt = ckptkit.open(str(ckpt_dir))
    key = next(e.key for e in ckpt.catalog.tensors() if e.n_chunks == 2 and e.shape[0] >= 4)

    def shift(which: int, rows: int):
        def mutate(metadata):
            item = metadata.state_dict_metadata[key]
            chunk = item.chunks[which]
            old = tuple(chunk.offsets)
            info = next(
                v
                for k, v in metadata.storage_data.items()
                if k.fqn == key and tuple(k.offset) == old
            )
            metadata.storage_data = {
                k: v
                for k, v in metadata.storage_data.items()
                if not (k.fqn == key and tuple(k.offset) == old)
            }
            chunk.offsets = torch.Size([chunk.offsets[0] + rows, *chunk.offsets[1:]])
            metadata.storage_data[MetadataIndex(key, chunk.offsets, which)] = info

        return mutate

    # the second chunk one row up overlaps the first; the first one row down leaves row 0 empty
    for which, rows, what in ((1, -1, "overlap"), (0, 1, "leave a hole")):
        damaged = ckpt_dir.parent / f"shifted{which}"
        shutil.copytree(ckpt_dir, damaged)
        _rewrite_metadata(damaged, shift(which, rows))
        opened = ckptkit.open(str(damaged))
        with pytest.raises(ckptkit.CoverageError, match=what) as info:
            opened.read(key)
        assert key in str(info.value)
        assert isinstance(info.value, ckptkit.FormatError)
        frame = opened.verify()
        assert "coverage" in set(frame["problem"])
        assert key in set(frame[frame["problem"] == "coverage"]["key"])


def test_metadata_of_another_run_or_world_size(ckpt_dir, written):
    other = written("fsdp2_ws4").path  # the same model saved from 4 ranks
    shutil.copy(other / ".metadata", ckpt_dir / ".metadata")
    ckpt = ckptkit.open(str(ckpt_dir))
    frame = ckpt.verify()
    assert {"missing file"} <= set(frame["problem"])
    assert {"__2_0.distcp", "__3_0.distcp"} <= set(frame["file"])
    # Records of the 2-rank files read at the 4-rank offsets do not parse (or disagree).
    wrong = frame[frame["file"].isin(["__0_0.distcp", "__1_0.distcp"])]
    assert len(wrong) and set(wrong["problem"]) <= {
        "corrupt record",
        "mismatch",
        "truncated",
        "checksum",
    }
    present = {"__0_0.distcp", "__1_0.distcp"}
    key = next(
        k
        for k in wrong["key"].dropna()
        if all(c.record is None or c.record.file in present for c in ckpt.entry(k).chunks)
    )
    with pytest.raises(ckptkit.CorruptRecordError) as info:
        if ckpt.entry(key).kind == "tensor":
            ckpt.read(key)
        else:
            ckpt.read_object(key)
    assert key in str(info.value) and ".distcp" in str(info.value)


def test_legacy_rank_set_with_a_missing_or_duplicated_rank(tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(LEGACY, missing)
    (missing / "rank1.pt").unlink()
    with pytest.raises(ckptkit.CoverageError, match="rank1.pt: missing"):
        ckptkit.open(str(missing))
    frame = ckptkit.verify(str(missing))
    assert list(frame["problem"]) == ["coverage"] and "rank1.pt" in frame["detail"][0]

    duplicated = tmp_path / "duplicated"
    shutil.copytree(LEGACY, duplicated)
    shutil.copy(duplicated / "rank0.pt", duplicated / "rank1.pt")
    with pytest.raises(ckptkit.CoverageError, match="rank1.pt.*rank 0") as info:
        ckptkit.open(str(duplicated))
    assert "duplicated" in str(info.value)


@pytest.fixture
def safetensors_file(tmp_path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, str(path))
    return path


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_safetensors_header_too_large(safetensors_file):
    raw = bytearray(safetensors_file.read_bytes())
    raw[:8] = struct.pack("<Q", 200 << 20)
    safetensors_file.write_bytes(raw)
    with pytest.raises(ckptkit.CorruptRecordError, match="too large") as info:
        ckptkit.open(str(safetensors_file))
    assert "model.safetensors" in str(info.value)


def test_safetensors_header_not_json(safetensors_file):
    n, _, data = _header(safetensors_file)
    safetensors_file.write_bytes(struct.pack("<Q", n) + b"{" * n + data)
    with pytest.raises(ckptkit.CorruptRecordError, match="not JSON") as info:
        ckptkit.open(str(safetensors_file))
    assert "model.safetensors" in str(info.value)


def test_safetensors_offsets_outside_the_file(safetensors_file):
    n, header, data = _header(safetensors_file)
    header["w"]["data_offsets"] = [0, len(data) + 4096]
    header["w"]["shape"] = [(len(data) + 4096) // 4]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    safetensors_file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    with pytest.raises(ckptkit.CorruptRecordError, match="outside the file") as info:
        ckptkit.open(str(safetensors_file))
    assert "model.safetensors" in str(info.value) and "'w'" in str(info.value)


def test_torch_save_storage_crc(tmp_path):
    """Plain ``torch.save`` files: a flipped byte in a storage is caught on read and by verify."""
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    ckpt = ckptkit.open(str(path))
    record = ckpt.entry("model.w").chunks[0].record
    assert record.crc32 is not None
    data = bytearray(path.read_bytes())
    data[record.offset + 100] ^= 1
    path.write_bytes(data)
    with pytest.raises(ckptkit.ChecksumError) as info:
        ckptkit.open(str(path)).read("model.w")
    assert "model.pt" in str(info.value) and "model.w" in str(info.value)
    frame = ckptkit.verify(str(path))
    assert list(frame["problem"]) == ["checksum"] and frame["key"][0] == "model.w"
