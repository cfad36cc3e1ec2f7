"""``inspect`` needs only the metadata, and every file ckptkit does not read is named with why.

A DCP with a data file deleted still opens, summarises and inspects (text and ``--json``), saying
one file is missing; reading what that file held raises :class:`MissingFileError` naming file
and key, and ``verify`` reports it. Files beside a checkpoint (per-rank trainer state, Lightning's
``meta.pt``, Accelerate's RNG states, the ``sharded/`` folder of torch's HF writer) are listed in
``facts.skipped_files`` with a reason, shown by ``inspect`` and counted by ``sizes``; a remote DCP
is still opened without a listing. Every checkpoint here is written by torch or is a fixture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import ckptkit
from ckptkit.errors import MissingFileError
from ckptkit.storage import Storage
from ckptkit.views.reports import inspect_text

from oracle import assert_bit_equal

FIXTURES = Path(__file__).parent / "fixtures"
#: torch 2.2.2 FSDP1 ``save_state_dict`` at 2 ranks: the DCP alone (``.metadata`` + 2 files).
TORCH22 = FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint"
#: OLMo's per-rank trainer state written on torch 2.2 (``train/rank{0,1}.pt``), which trainers
#: save beside their DCP.
TRAIN_STATE = FIXTURES / "olmo_local_ws2" / "step3" / "train"
TRAIN_REASON = "per-rank trainer state beside a DCP: open train/ to read it"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *args], capture_output=True, text=True, timeout=120
    )


def _state() -> dict:
    """Tensors and plain objects, as a trainer's state dict holds them."""
    gen = torch.Generator().manual_seed(25)
    model = {f"layer{i}.weight": torch.randn(6, 4, generator=gen) for i in range(4)}
    model["bias"] = torch.randn(5, generator=gen).to(torch.bfloat16)
    train = {"step": 25, "losses": [2.5, 1.25], "name": "issue-25", "lr": 1e-3}
    return {"model": model, "train": train}


@pytest.fixture
def two_files(tmp_path) -> Path:
    """A DCP torch saves in one process on two writer threads: two data files, each holding
    tensors and objects."""
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=FileSystemWriter(path, thread_count=2))
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    return path


def _file_of(ckpt: ckptkit.Checkpoint, key: str) -> str:
    return ckpt.entry(key).chunks[0].record.file


def _deleted_holder_of_step(path: Path) -> tuple[str, set[str]]:
    """Delete the data file holding ``train.step`` (what inspect used to fail on): its name and
    the keys it held."""
    ckpt = ckptkit.open(str(path))
    holder = _file_of(ckpt, "train.step")
    held = {
        e.key
        for e in ckpt.catalog.entries.values()
        if any(c.record.file == holder for c in e.chunks)
    }
    (path / holder).unlink()
    return holder, held


def test_a_missing_data_file_is_a_line_of_the_summary_not_an_error(two_files):
    holder, held = _deleted_holder_of_step(two_files)
    state = _state()
    ckpt = ckptkit.open(str(two_files))
    assert len(ckpt) == 9  # every entry still described: the metadata names them all
    summary = ckpt.summary()
    assert summary.missing_files == (holder,)
    assert f"1 file missing ({holder}) — run `ckptkit verify`" in str(summary)
    assert summary.by_group["objects"].to_dict() == {"model": 0, "train": 4}
    assert f"1 file missing ({holder})" in inspect_text(ckpt)
    for key in held:  # what the file held: an error naming the file and the key
        read = ckpt.read_object if ckpt.entry(key).kind == "object" else ckpt.read
        with pytest.raises(MissingFileError, match=rf"{holder}: no such file.*{key}"):
            read(key)
    others = [e.key for e in ckpt.catalog.tensors() if e.key not in held]
    assert others  # the other file's tensors read as torch held them
    for key in others:
        assert_bit_equal(ckpt.read(key), state["model"][key.removeprefix("model.")], key)
    problems = ckpt.verify()
    assert problems[["file", "problem"]].drop_duplicates().values.tolist() == [
        [holder, "missing file"]
    ]


def test_inspect_cli_text_and_json_say_a_file_is_missing(two_files):
    holder, _ = _deleted_holder_of_step(two_files)
    text = run("inspect", str(two_files), "--wide")
    assert text.returncode == 0, text.stderr
    assert f"  1 file missing ({holder}) — run `ckptkit verify`" in text.stdout.splitlines()
    doc = run("inspect", str(two_files), "--json")
    assert doc.returncode == 0, doc.stderr
    summary = json.loads(doc.stdout)["summary"]
    assert summary["missing_files"] == [holder]
    assert summary["skipped_files"] == {}
    assert summary["objects"] == 4
    verify = run("verify", str(two_files))
    assert verify.returncode != 0
    assert f"missing file: {holder}" in verify.stdout


def test_per_rank_trainer_state_beside_a_torch22_dcp_is_listed(tmp_path):
    path = tmp_path / "checkpoint"
    shutil.copytree(TORCH22, path)
    assert ckptkit.open(str(path)).catalog.facts.skipped_files == {}  # the DCP alone
    shutil.copytree(TRAIN_STATE, path / "train")
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "dcp"
    assert ckpt.catalog.facts.skipped_files == {
        "train/rank0.pt": TRAIN_REASON,
        "train/rank1.pt": TRAIN_REASON,
    }
    line = f"  skipped: train/rank0.pt, train/rank1.pt ({TRAIN_REASON})"
    assert line in inspect_text(ckpt, wide=True).splitlines()
    assert line in run("inspect", str(path), "--wide").stdout.splitlines()
    doc = json.loads(run("inspect", str(path), "--json").stdout)
    assert doc["summary"]["skipped_files"] == dict(ckpt.catalog.facts.skipped_files)
    on_disk = sum(p.stat().st_size for p in (path / "train").iterdir())
    row = ckptkit.compare_sizes(ckpt).iloc[0]
    assert row["skipped_bytes"] == on_disk
    assert row["size"] == sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    # the advice holds: train/ opens as the per-rank trainer state it is
    train = ckptkit.open(str(path / "train"))
    assert train.catalog.facts.rank_files == ("rank0.pt", "rank1.pt")


def test_files_dropped_beside_a_dcp_are_listed_hidden_ones_not(two_files):
    torch.save({"epoch": 3, "global_step": 25}, two_files / "meta.pt")  # as Lightning does
    rng = {"step": 25, "torch_manual_seed": torch.get_rng_state()}
    torch.save(rng, two_files / "random_states_0.pkl")  # as Accelerate does
    (two_files / "logs").mkdir()
    (two_files / "logs" / "events.txt").write_text("loss 2.5\n")
    (two_files / ".ckptkit-tmp-abc").mkdir()  # a staging folder of ckptkit's own
    (two_files / ".ckptkit-tmp-abc" / "model.pt").write_bytes(b"")
    (two_files / ".gitignore").write_text("*\n")
    ckpt = ckptkit.open(str(two_files))
    skipped = dict(ckpt.catalog.facts.skipped_files)
    assert sorted(skipped) == ["logs/", "meta.pt", "random_states_0.pkl"]
    assert skipped["meta.pt"].startswith("Lightning's metadata")
    assert skipped["random_states_0.pkl"].startswith("Accelerate's RNG states")
    text = inspect_text(ckpt, wide=True)
    assert f"  skipped: meta.pt ({skipped['meta.pt']})" in text.splitlines()
    assert len(ckpt.summary().notes) == 3
    # the files named are what they are said to be, and open by their path
    meta = ckptkit.open(str(two_files / "meta.pt"))
    assert meta.read_object("meta.global_step") == 25
    states = ckptkit.open(str(two_files / "random_states_0.pkl"))
    assert_bit_equal(
        states.read("random_states_0.pkl.torch_manual_seed"), rng["torch_manual_seed"], "rng"
    )
    sizes = ckptkit.compare_sizes(ckpt).iloc[0]
    dropped = ("meta.pt", "random_states_0.pkl", "logs/events.txt")
    assert sizes["skipped_bytes"] == sum((two_files / name).stat().st_size for name in dropped)


def test_hf_storage_writer_sharded_folder_is_listed(tmp_path):
    writer_class = pytest.importorskip("torch.distributed.checkpoint").__dict__.get(
        "HuggingFaceStorageWriter"
    )
    if writer_class is None:
        pytest.skip("torch has no HuggingFaceStorageWriter (torch < 2.8)")
    path = tmp_path / "hf"
    state = {"embed": torch.randn(6, 4), "head": torch.arange(5.0)}
    writer = writer_class(str(path), save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "safetensors"  # the consolidated files are read
    skipped = dict(ckpt.catalog.facts.skipped_files)
    assert list(skipped) == ["sharded/"]
    assert "HuggingFaceStorageWriter" in skipped["sharded/"]
    assert "may differ" in skipped["sharded/"]
    assert "skipped: sharded/" in inspect_text(ckpt, wide=True)
    shards = sum(p.stat().st_size for p in (path / "sharded").iterdir())
    assert ckptkit.compare_sizes(ckpt).iloc[0]["skipped_bytes"] == shards
    assert ckptkit.open(str(path / "sharded")).format == "hf_dcp_sharded"


def test_a_remote_dcp_is_described_without_a_listing(two_files, monkeypatch):
    """Files beside a remote checkpoint are not looked for: describing a DCP over fsspec lists
    nothing (its metadata names every file), and nothing is said to be skipped."""
    from ckptkit import formats

    fs = fsspec.filesystem("memory")
    root = f"/ckptkit-issue25-{id(two_files):x}"
    fs.put(str(two_files), root, recursive=True)
    fs.pipe(f"{root}/meta.pt", (two_files / "__0_0.distcp").read_bytes())
    try:
        detection = formats.detect(Storage(f"memory://{root}"))
        assert detection.format == "dcp"

        def no_listing(self, rel=""):
            raise AssertionError(f"listed {self.describe(rel)}")

        with monkeypatch.context() as patched:
            patched.setattr(Storage, "listdir", no_listing)
            catalog = formats.describe(detection)
        assert catalog.facts.skipped_files == {}
        ckpt = ckptkit.open(f"memory://{root}")
        assert ckpt.catalog.facts.skipped_files == {}
        assert not ckpt.summary().notes
    finally:
        fs.rm(root, recursive=True)
