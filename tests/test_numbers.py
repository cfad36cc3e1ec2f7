"""One set of numbers: files and bytes on disk, counted per stored record, on every conformance
case (checked-in fixtures written by the real libraries and checkpoints torch writes here).

Sizes are never negative (each storage counted once however many entries view it: shared
storages, tensor views, tied weights, DeepSpeed's fp32 groups, Megatron's ``stacked.*``
alternates); the byte counts fit what the files really hold (their zip storages, their
safetensors data); and the five renderings (``inspect`` text and ``--json``, the HTML repr,
``summary()``, ``compare_sizes``) report the same files and bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from test_conformance import Subjects

import ckptkit
from ckptkit.cli import main
from ckptkit.ops.sizes import CATEGORIES
from ckptkit.units import human_bytes, plural

from conformance_cases import CASES, FIXTURES, MEGATRON_ITEMS, Case, Workspace, size_on_disk

#: Formats whose data files are whole torch.save zips (DCP ``.distcp`` files concatenate many).
ZIP_FORMATS = {"torch_save", "rank_files", "deepspeed_zero", "olmo_local", "torchscript"}
#: Cases whose files are torch.save's pre-1.6 format (no zip to look into).
PRE16 = {"torch-save-pre16-file", "fixture-deepspeed-zero2-legacy-serialization-ws2"}
#: Cases every storage of which some entry views whole: their tensor bytes are the storages'.
EVERY_STORAGE_VIEWED = {"torch-save-file", "torch-save-dir", "fixture-olmo-legacy"}
#: Megatron cases: their ``stacked`` group re-exposes the per-layer tensors' bytes.
MEGATRON_CASES = [
    c for c in CASES if c.id in {f"fixture-{i.replace('_', '-')}" for i in MEGATRON_ITEMS}
]


@pytest.fixture(scope="module")
def subjects(written, tmp_path_factory) -> Subjects:
    return Subjects(Workspace(written, tmp_path_factory.mktemp("numbers")))


def _params(cases: list[Case]) -> list:
    return [pytest.param(case, id=case.id) for case in cases]


def _root(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def _counted_on_disk(ckpt: ckptkit.Checkpoint, location: Path) -> dict[str, int]:
    """Size on disk (``stat``) of every file the catalog read: data files, then metadata."""
    names = [*ckpt.catalog.files]
    names += [m for m in dict.fromkeys(ckpt.catalog.facts.metadata_files) if m not in names]
    return {name: size_on_disk(location, name) for name in names}


@pytest.mark.parametrize("case", _params(CASES))
def test_sizes_are_never_negative_and_add_up_to_the_files(case, subjects):
    subject = subjects[case]
    ckpt = subject.ckpt
    on_disk = _counted_on_disk(ckpt, subject.path)
    row = ckptkit.compare_sizes(ckpt).iloc[0]
    assert (row["files"], row["size"]) == (len(on_disk), sum(on_disk.values()))
    assert row["overhead_bytes"] >= 0, row
    assert 0 < row["tensor_bytes"] <= row["size"], row
    assert (
        row["tensor_bytes"] + row["object_bytes"] + row["overhead_bytes"] + row["metadata_bytes"]
        == row["size"]
    )
    parts = [*CATEGORIES, "overhead_bytes", "metadata_bytes"]
    assert row[parts].sum() == row["size"], row
    assert row[ckptkit.compare_sizes(ckpt).attrs["dtype_columns"]].sum() == row["tensor_bytes"]
    # per data file too: no file holds more tensor and object bytes than its size
    files = ckpt.files
    assert dict(zip(files["file"], files["size"], strict=True)) == {
        name: size for name, size in on_disk.items() if name in ckpt.catalog.files
    }
    assert (files["overhead_bytes"] >= 0).all(), files
    assert files["tensor_bytes"].sum() == row["tensor_bytes"]
    assert files["object_bytes"].sum() == row["object_bytes"]
    assert files["records"].sum() == row["records"]


@pytest.mark.parametrize("case", _params(CASES))
def test_stored_bytes_fit_what_the_files_hold(case, subjects):
    """Tensor bytes of a torch.save zip are at most its storages' bytes (all of them when every
    storage is viewed), object bytes at most its pickles'; a safetensors file's records at
    most its bytes after the header (all of them in a plain safetensors checkpoint)."""
    subject = subjects[case]
    root = _root(subject.path)
    per_file = subject.ckpt.files.set_index("file")
    checked = 0
    for name, counts in per_file.iterrows():
        path = root / name
        if name.endswith(".safetensors"):
            with path.open("rb") as f:
                (header,) = struct.unpack("<Q", f.read(8))
            stored = counts["tensor_bytes"] + counts["object_bytes"]
            data = path.stat().st_size - 8 - header
            # OLMo-core 0.x and HF DCP shards also store bookkeeping tensors the catalog leaves out
            assert stored == data if case.format == "safetensors" else stored <= data, name
            checked += 1
        elif case.format in ZIP_FORMATS and zipfile.is_zipfile(path):
            members = zipfile.ZipFile(path).infolist()
            storages = sum(m.file_size for m in members if "/data/" in m.filename)
            pickles = sum(m.file_size for m in members if m.filename.endswith(".pkl"))
            assert counts["tensor_bytes"] <= storages, (name, counts["tensor_bytes"], storages)
            assert counts["object_bytes"] <= pickles, name
            if case.id in EVERY_STORAGE_VIEWED:
                assert counts["tensor_bytes"] == storages, name
            checked += 1
    if case.format in ZIP_FORMATS | {"safetensors", "olmo_core_v0"} and case.id not in PRE16:
        assert checked, f"{case.id}: no file checked"


@pytest.mark.parametrize("case", _params(CASES))
def test_every_rendering_reports_the_same_files_and_bytes(case, subjects, capsys):
    path = str(subjects.path(case))
    ckpt = ckptkit.open(path)
    row = ckptkit.compare_sizes(ckpt).iloc[0]
    names = ("files", "size", "tensor_bytes", "object_bytes", "overhead_bytes", "metadata_bytes")
    expected = tuple(int(row[name]) for name in names)
    files, size = expected[:2]
    said = f"{plural(files, 'file')}, {human_bytes(size)} on disk"
    where = (
        f"tensors {human_bytes(row['tensor_bytes'])}, objects {human_bytes(row['object_bytes'])}, "
        f"framing {human_bytes(row['overhead_bytes'])}, "
        f"metadata {human_bytes(row['metadata_bytes'])}"
    )

    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert said in text and where in text, text

    assert main(["inspect", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = doc["summary"]
    json_names = ("files", "bytes_on_disk", *names[2:])
    assert tuple(summary[name] for name in json_names) == expected
    assert len(doc["files"]) == files and sum(f["size"] for f in doc["files"]) == size

    result = ckpt.summary()
    assert (
        result.files,
        result.total_bytes,
        result.tensor_bytes,
        result.object_bytes,
        result.overhead_bytes,
        result.metadata_bytes,
    ) == expected
    assert said in str(result) and said in result._repr_html_()
    assert result.by_group["stored_bytes"].sum() == row["tensor_bytes"]
    assert result.by_group["object_bytes"].sum() == row["object_bytes"]

    html = ckpt._repr_html_()
    assert said in html and where in html, html
    assert repr(ckpt).endswith(f", {plural(files, 'file')}>"), repr(ckpt)


@pytest.mark.parametrize("case", _params(MEGATRON_CASES))
def test_megatron_stacked_views_are_named_not_added(case, subjects, capsys):
    subject = subjects[case]
    ckpt, path = subject.ckpt, str(subject.path)
    stacked = [e for e in ckpt.catalog.tensors() if e.group == "stacked"]
    assert stacked and ckpt.catalog.facts.alternate_groups == ("stacked",)
    row = ckptkit.compare_sizes(ckpt).iloc[0]
    assert row["alternate_bytes"] == sum(e.nbytes for e in stacked)
    assert row["other"] < row["alternate_bytes"]  # stacked (category "other") is not added
    summary = ckpt.summary()
    assert summary.by_group.loc["stacked", "stored_bytes"] == 0
    assert summary.by_group.loc["stacked", "nbytes"] == row["alternate_bytes"]

    stored = sorted(
        (e.nbytes for e in ckpt.catalog.tensors() if e.group != "stacked"), reverse=True
    )

    assert main(["inspect", path, "--top", "20"]) == 0
    text = capsys.readouterr().out
    largest = text.split("largest 20 tensors:\n")[1].splitlines()[1:]
    keys = [line.split()[0] for line in largest]
    assert len(keys) == 20 and not [key for key in keys if key.startswith("stacked.")], keys
    assert "'stacked': alternate view of bytes other groups hold" in text
    assert main(["inspect", path, "--json", "--top", "20"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not [t["key"] for t in doc["tensors"] if t["key"].startswith("stacked.")]
    assert [t["nbytes"] for t in doc["tensors"]] == stored[:20]
    assert doc["summary"]["alternate_groups"] == ["stacked"]
    html = ckpt._repr_html_().split("largest tensors:")[1]
    listed = re.findall(r"<tr>\s*<td>([^<]*)</td>", html)  # each row's first cell: its key
    assert len(listed) == 5 and not [key for key in listed if key.startswith("stacked.")], listed


def test_a_stacked_tensor_without_per_layer_views_keeps_its_bytes(tmp_path):
    """A stacked record whose per-layer views could not be made (its archive damaged) holds
    bytes no other group reaches: they count under ``stacked``, so the stored total is the
    intact checkpoint's."""
    intact = FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint"
    copy = tmp_path / "ckpt"
    shutil.copytree(intact, copy)
    entry = ckptkit.open(str(copy)).catalog.entries["stacked.decoder.layers.mlp.linear_fc1.weight"]
    record = entry.chunks[0].record
    data = bytearray((copy / record.file).read_bytes())
    at = data.rfind(b"PK\x05\x06", record.offset, record.offset + record.length)
    data[at : at + 4] = b"XXXX"  # the record's end-of-directory: no per-layer views from it
    (copy / record.file).write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="no per-layer views"):
        damaged = ckptkit.open(str(copy))
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" not in damaged.catalog.entries
    before, after = ckptkit.compare_sizes(str(intact), damaged).to_dict("records")
    assert after["tensor_bytes"] == before["tensor_bytes"] and after["overhead_bytes"] >= 0
    assert after["alternate_bytes"] == before["alternate_bytes"] - entry.nbytes
    stacked = damaged.summary().by_group.loc["stacked", "stored_bytes"]
    assert stacked == entry.nbytes
