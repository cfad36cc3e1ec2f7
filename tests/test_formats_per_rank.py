"""Named per-rank files of training libraries, written by torch's own FSDP2 in this module: verl's
``global_step_N/actor/{model,optim,extra_state}_world_size_2_rank_{r}.pt`` and Accelerate's FSDP
``use_dcp=False`` ``pytorch_model_fsdp_0_rank{r}.bin`` + ``optimizer_0_rank{r}.bin``. They are
detected by content as one sharded checkpoint, read bit-equal to what torch gathers, verified
and unsharded; and DTensors ckptkit can only keep as objects are never a silent empty result.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import (
    CheckpointError,
    CoverageError,
    TensorsLeftAsObjectsError,
)
from ckptkit.formats import megatron_dist
from ckptkit.ops.verify import LEFT_AS_OBJECTS
from ckptkit.storage import Storage
from ckptkit.views.reports import inspect_text

from conformance_cases import VERL_STEP, write_library_rank_files
from oracle import assert_bit_equal

VERL = f"verl/global_step_{VERL_STEP}/actor"
ACCELERATE = "accelerate/ckpt"
LAYOUTS = {VERL: "verl_reference.pt", ACCELERATE: "accelerate_reference.pt"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Both layouts, written once by one spawned 2-rank job (see ``conformance_cases``)."""
    return write_library_rank_files(tmp_path_factory.mktemp("per_rank") / "written")


def _reference(root: Path, layout: str) -> dict:
    return torch.load(root / LAYOUTS[layout], weights_only=False)


def _copy(root: Path, layout: str, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(root / layout, copy)
    return copy


# --------------------------------------------------------------------------------------------
# Detected by content, read as one sharded checkpoint.


@pytest.mark.parametrize(
    ("layout", "groups", "rank_files", "files"),
    [
        (VERL, {"model", "optim", "extra_state"}, 6, 6),
        (ACCELERATE, {"model", "optim", "scheduler"}, 4, 5),
    ],
)
def test_detected_as_one_sharded_checkpoint(root, layout, groups, rank_files, files):
    found = ckptkit.detect(str(root / layout))
    assert found.format == "rank_files"
    assert "holding DTensors" in found.evidence[0], found.evidence
    ckpt = ckptkit.open(str(root / layout))
    facts = ckpt.catalog.facts
    assert (facts.sharding, facts.world_size, len(facts.rank_files)) == ("DTensor", 2, rank_files)
    assert {entry.group for entry in ckpt.catalog.entries.values()} == groups
    assert len(ckpt.catalog.files) == files  # the rank files, plus Accelerate's scheduler.bin
    first = str(ckpt.summary()).splitlines()[0]  # no warning: nothing left as an object
    assert first.startswith(f"{ckpt.summary().parameters:,} parameters in 'model'"), first


def test_verl_side_files_are_metadata_and_config(root):
    ckpt = ckptkit.open(str(root / VERL))
    assert ckpt.catalog.facts.metadata_files == ("fsdp_config.json",)
    assert ckpt.config == {"model_type": "llama"}  # huggingface/config.json


@pytest.mark.parametrize("layout", [VERL, ACCELERATE])
def test_every_tensor_equals_what_torch_gathers(root, layout):
    reference = _reference(root, layout)
    ckpt = ckptkit.open(str(root / layout))
    model = {e.key.removeprefix("model."): e for e in ckpt.catalog.tensors() if e.group == "model"}
    assert set(model) == set(reference["model"])  # every model tensor, none left as an object
    for name, expected in reference["model"].items():
        assert_bit_equal(ckpt.read(f"model.{name}"), expected, name)
    sharded = [e for e in model.values() if e.n_chunks == 2]
    assert len(sharded) >= len(model) - 1  # FSDP2 shards every parameter (not the buffer)
    for param, state in reference["optim"]["state"].items():
        for name, expected in state.items():
            assert_bit_equal(ckpt.read(f"optim.state.{param}.{name}"), expected, name)
    assert not ckpt.catalog.objects() or all(e.tensor_class is None for e in ckpt.catalog.objects())


def test_per_rank_values_keep_every_rank(root):
    """verl's extra_state is not sharded: each rank's copy is kept, rank 0's read by default."""
    ckpt = ckptkit.open(str(root / VERL))
    expected = _reference(root, VERL)["extra_state"]["rng"]["cpu"]
    assert_bit_equal(ckpt.read("extra_state.rng.cpu"), expected, "rng")
    assert {c.rank for c in ckpt.entry("extra_state.rng.cpu").chunks} == {0, 1}
    assert ckpt.read_object("extra_state.lr_scheduler.last_epoch", rank=1) == 2


def test_one_named_rank_file_opens_the_whole_set(root):
    one = root / VERL / "optim_world_size_2_rank_1.pt"
    found = ckptkit.detect(str(one))
    assert found.format == "rank_files" and "one rank's file (DTensors)" in found.evidence[0]
    assert Path(found.storage.url) == root / VERL
    assert len(ckptkit.open(str(one)).catalog.facts.rank_files) == 6


def test_detection_reads_one_pickle(root, monkeypatch):
    """Sniffing reads the pickle of one rank file, never all of them."""
    read: list[str] = []
    original = Storage.read_ranges

    def recording(self, ranges):
        read.extend(Path(name).name for name, _, _ in ranges)
        return original(self, ranges)

    monkeypatch.setattr(Storage, "read_ranges", recording)
    assert ckptkit.detect(str(root / VERL)).format == "rank_files"
    assert set(read) == {"model_world_size_2_rank_0.pt"}


# --------------------------------------------------------------------------------------------
# verify, unshard (CLI).


@pytest.mark.parametrize("layout", [VERL, ACCELERATE])
def test_verify_is_clean(root, layout, capsys):
    assert main(["verify", str(root / layout)]) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.parametrize("layout", [VERL, ACCELERATE])
def test_unshard_to_safetensors_is_bit_equal(root, layout, tmp_path):
    out = tmp_path / "out"
    assert main(["unshard", str(root / layout), str(out), "--to", "safetensors", "--quiet"]) == 0
    model = load_file(out / "model.safetensors")
    reference = _reference(root, layout)["model"]
    assert set(model) == set(reference)
    for name, expected in reference.items():
        assert_bit_equal(model[name], expected, name)
    optim = load_file(out / "optim.safetensors")
    moments = _reference(root, layout)["optim"]["state"]  # verl: by index; Accelerate: by name
    expected = {f"state.{p}.{n}": t for p, state in moments.items() for n, t in state.items()}
    assert set(optim) == set(expected)
    for key, tensor in expected.items():
        assert_bit_equal(optim[key], tensor, key)


# --------------------------------------------------------------------------------------------
# The run folder around verl's checkpoint, and Megatron's tracker file.


def test_verl_run_folder_opens_its_only_checkpoint_not_megatron(root, capsys):
    """The run folder holds one checkpoint, ``global_step_7/actor``: it opens that, saying so."""
    top = root / "verl"
    assert (top / "latest_checkpointed_iteration.txt").exists()
    assert megatron_dist.detect(Storage(str(top))) is None
    ckpt = ckptkit.open(str(top))
    assert ckpt.format == "rank_files"
    assert ckpt.url == str(top / f"global_step_{VERL_STEP}" / "actor")
    note = f"opened global_step_{VERL_STEP}/actor/, the only checkpoint in {top}"
    assert ckpt.catalog.facts.notes == (note,)
    assert main(["inspect", str(top)]) == 0
    out = capsys.readouterr().out
    assert note in " ".join(out.split()) and "Megatron" not in out  # wrapped to the width


def test_a_tracker_and_an_iteration_without_megatron_content_is_not_megatron(root, tmp_path):
    """The tracker names an ``iter_`` folder that holds verl's files, not Megatron's."""
    run = tmp_path / "run"
    shutil.copytree(root / VERL, run / "iter_0000003")
    (run / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert megatron_dist.detect(Storage(str(run))) is None
    ckpt = ckptkit.open(str(run))  # the one checkpoint below it, verl's rank files
    assert ckpt.format == "rank_files"
    assert ckpt.catalog.facts.notes == (f"opened iter_0000003/, the only checkpoint in {run}",)


# --------------------------------------------------------------------------------------------
# The rank set is checked: missing, surplus and duplicated ranks, names against contents.


def test_a_missing_rank_file_is_named(root, tmp_path):
    copy = _copy(root, VERL, tmp_path)
    (copy / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(CoverageError, match="model_world_size_2_rank_1.pt: missing; the names say"):
        ckptkit.open(str(copy))
    assert main(["verify", str(copy)]) == 1


def test_a_missing_rank_file_without_a_world_size_in_its_name_is_named(root, tmp_path):
    """Accelerate's names state no world size: the DTensor device mesh says 2."""
    copy = _copy(root, ACCELERATE, tmp_path)
    (copy / "optimizer_0_rank1.bin").unlink()
    with pytest.raises(CoverageError, match=r"optimizer_0_rank1\.bin: missing; world size 2"):
        ckptkit.open(str(copy))


def test_the_world_size_in_the_names_must_match(root, tmp_path):
    copy = _copy(root, VERL, tmp_path)
    for path in copy.glob("*_world_size_2_rank_*.pt"):
        path.rename(path.with_name(path.name.replace("_world_size_2_", "_world_size_4_")))
    with pytest.raises(CoverageError, match="model_world_size_4_rank_2.pt, .*rank_3.pt: missing"):
        ckptkit.open(str(copy))
    # one rank kept under a world size of 1: the names are complete, the device mesh says 2
    for path in copy.glob("*_rank_1.pt"):
        path.unlink()
    for path in copy.glob("*_world_size_4_rank_0.pt"):
        path.rename(path.with_name(path.name.replace("_world_size_4_", "_world_size_1_")))
    with pytest.raises(CoverageError, match="the names say world size 1, but the DTensor device"):
        ckptkit.open(str(copy))


def test_a_duplicated_rank_is_caught_by_content(root, tmp_path):
    copy = _copy(root, VERL, tmp_path)
    shutil.copy(copy / "model_world_size_2_rank_0.pt", copy / "model_world_size_2_rank_1.pt")
    with pytest.raises(CoverageError, match="holds rank 0's DTensors, not rank 1's"):
        ckptkit.open(str(copy))


def test_named_files_without_sharded_tensors_stay_torch_save(tmp_path):
    """The names match, the contents are plain tensors: not a sharded checkpoint."""
    gen = torch.Generator().manual_seed(9)
    states = [{"w": torch.randn(3, 2, generator=gen)} for _ in range(2)]
    for rank, state in enumerate(states):
        torch.save(state, tmp_path / f"model_rank{rank}.pt")
    ckpt = ckptkit.open(str(tmp_path))
    assert ckpt.format == "torch_save"
    for rank, state in enumerate(states):
        assert_bit_equal(ckpt.read(f"model_rank{rank}.w"), state["w"], "w")
    assert not str(ckpt.summary()).startswith("⚠")


# --------------------------------------------------------------------------------------------
# Never a silent empty result: DTensors left as objects.


@pytest.fixture
def as_objects(root) -> ckptkit.Checkpoint:
    """Accelerate's files opened as plain torch.save files: every DTensor is an object."""
    return ckptkit.open(str(root / ACCELERATE), format="torch_save")


def test_summary_and_inspect_warn_first(as_objects):
    dtensors = [e for e in as_objects.catalog.objects() if e.tensor_class == "DTensor"]
    assert len(dtensors) > 20
    first = str(as_objects.summary()).splitlines()[0]
    assert first.startswith(f"⚠ {len(dtensors)} tensors left as objects (DTensor)"), first
    assert inspect_text(as_objects).splitlines()[0] == first


def test_verify_reports_them(as_objects):
    problems = as_objects.verify()
    rows = problems[problems["problem"] == LEFT_AS_OBJECTS]
    assert set(rows["file"]) == {
        f"{stem}_rank{rank}.bin"
        for stem in ("pytorch_model_fsdp_0", "optimizer_0")
        for rank in (0, 1)
    }
    assert rows["detail"].str.contains("DTensor").all()


def test_unshard_and_convert_refuse_unless_kept(as_objects, tmp_path):
    with pytest.raises(TensorsLeftAsObjectsError, match="left as objects") as error:
        ckptkit.unshard(as_objects, str(tmp_path / "out"), progress=False)
    assert "pytorch_model_fsdp_0_rank0.wte.weight" in error.value.keys
    assert not (tmp_path / "out").exists()
    with pytest.raises(TensorsLeftAsObjectsError):
        ckptkit.convert(as_objects, str(tmp_path / "dcp"), progress=False)
    with pytest.raises(TensorsLeftAsObjectsError):
        ckptkit.unshard(as_objects, str(tmp_path / "out"), objects="drop", progress=False)
    result = ckptkit.unshard(as_objects, str(tmp_path / "kept"), objects="keep", progress=False)
    assert "pytorch_model_fsdp_0_rank0.wte.weight" in result.opaque


def test_one_rank_file_alone_is_never_silently_empty(root, tmp_path, capsys):
    """One rank's file copied on its own opens as torch.save: every command says what is wrong."""
    alone = tmp_path / "shard.pt"
    shutil.copy(root / VERL / "model_world_size_2_rank_0.pt", alone)
    assert main(["inspect", str(alone)]) == 0
    assert capsys.readouterr().out.startswith("⚠ ")
    assert main(["verify", str(alone)]) == 1
    assert LEFT_AS_OBJECTS in capsys.readouterr().out
    assert main(["unshard", str(alone), str(tmp_path / "out"), "--quiet"]) == 2
    assert "left as objects (DTensor)" in capsys.readouterr().err
    kept = ["unshard", str(alone), str(tmp_path / "kept"), "--quiet", "--objects", "keep"]
    assert main(kept) == 0


def test_checkpoint_errors_stay_typed(root, tmp_path):
    """A truncated rank file of a detected set is a damage error, not a wrong format."""
    copy = _copy(root, VERL, tmp_path)
    victim = copy / "optim_world_size_2_rank_1.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    assert ckptkit.detect(str(copy)).format == "rank_files"
    with pytest.raises(CheckpointError):
        ckptkit.open(str(copy))
