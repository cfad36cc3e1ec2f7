"""What training libraries write, opened as a user would (issue 26): Accelerate's FSDP
``save_state`` folder as ONE checkpoint, a folder whose only checkpoint is one sub-folder, the
``model`` group wherever a layout keeps its model (a flat-key DCP, Lightning's ``state_dict``,
Composer's ``state.model``, HF's ``pytorch_model``), and transformers' own output names.

Fixtures: tests/fixtures/{accelerate_fsdp2_sharded_ws2, torchtitan_flat_dcp_ws2, lightning_ckpt,
composer_mono, composer_sharded_ws2, hf_save_pretrained_v4, hf_save_pretrained_v5}, written by
the libraries (tests/fixtures/generators/), each with its library's own load hashed in
``reference/tensors.sha256.json``. ``from_pretrained`` itself is not installed here: the
transformers names are checked against ``save_pretrained``'s own files for the same tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import KeyNotFoundError, NotACheckpointError, UsageError

from oracle import raw_bytes

FIXTURES = Path(__file__).parent / "fixtures"
ACCELERATE = FIXTURES / "accelerate_fsdp2_sharded_ws2" / "checkpoint"
TORCHTITAN = FIXTURES / "torchtitan_flat_dcp_ws2"
HF4 = FIXTURES / "hf_save_pretrained_v4"
HF5 = FIXTURES / "hf_save_pretrained_v5"


def reference(item: str, file: str, prefix: str = "") -> dict[str, dict]:
    """The hashed reference of ``item`` for ``file``, by the model's own key (``prefix``, where
    the layout stores the model, dropped)."""
    listed = json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())
    return {key.removeprefix(prefix): spec for key, spec in listed[file].items()}


def assert_matches(tensors: dict[str, torch.Tensor], expected: dict[str, dict]) -> None:
    """``tensors`` are exactly ``expected``'s keys, each bit-equal to its hash."""
    assert set(tensors) == set(expected), sorted(set(tensors) ^ set(expected))[:10]
    for key, spec in expected.items():
        tensor = tensors[key]
        assert list(tensor.shape) == spec["shape"], key
        assert str(tensor.dtype).removeprefix("torch.") == spec["dtype"], key
        assert hashlib.sha256(raw_bytes(tensor)).hexdigest() == spec["sha256"], key


# The layouts whose model ckptkit must find as group ``model``: (path, item, reference file,
# where the reference keys keep the model).
MODEL_LAYOUTS = {
    "accelerate-fsdp2": (ACCELERATE, "accelerate_fsdp2_sharded_ws2", "model.safetensors", ""),
    "torchtitan-flat-dcp": (
        TORCHTITAN / "step-20", "torchtitan_flat_dcp_ws2", "model.safetensors", ""
    ),
    "lightning": (
        FIXTURES / "lightning_ckpt" / "last.ckpt", "lightning_ckpt", "last.ckpt", "state_dict."
    ),
    "composer-mono": (
        FIXTURES / "composer_mono" / "ep0-ba10-rank0.pt",
        "composer_mono",
        "ep0-ba10-rank0.pt",
        "state.model.",
    ),
    "composer-sharded": (
        FIXTURES / "composer_sharded_ws2" / "ep0-ba10", "composer_sharded_ws2", "state.pt", "model."
    ),
    "hf4-bin-shards": (
        HF4 / "bin_sharded", "hf_save_pretrained_v4", "bin_sharded/pytorch_model.bin", ""
    ),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Accelerate's FSDP save_state folder: one checkpoint.


def test_accelerate_fsdp_folder_opens_as_one_checkpoint():
    ckpt = ckptkit.open(str(ACCELERATE))
    assert ckpt.format == "accelerate"
    groups = {e.group for e in ckpt.catalog.entries.values()}
    assert groups == {"model", "optim", "scheduler", "random_states_0", "random_states_1"}
    model = {e.key.removeprefix("model."): e for e in ckpt.catalog.select(groups="model")}
    assert set(model) == set(reference("accelerate_fsdp2_sharded_ws2", "model.safetensors"))
    # the optimizer as torch's get_optimizer_state_dict keys it, under optim
    optim = {e.key for e in ckpt.catalog.select(groups="optim")}
    assert "optim.state.transformer.wte.weight.exp_avg" in optim
    assert "optim.param_groups.0.lr" in optim
    assert not any(key.startswith("optimizer.") for key in ckpt.catalog.entries)
    # records point into the sub-folders; the metadata of both is the checkpoint's
    assert {f.split("/")[0] for f in ckpt.catalog.files} >= {"pytorch_model_fsdp_0", "optimizer_0"}
    assert set(ckpt.catalog.facts.metadata_files) == {
        "pytorch_model_fsdp_0/.metadata",
        "optimizer_0/.metadata",
    }
    # the scheduler and RNG states are objects (the CPU generator's state a uint8 tensor)
    assert ckpt.read_object("scheduler.step_size") == 7
    assert ckpt.read_object("random_states_1.step") == 2
    assert ckpt.entry("random_states_0.torch_manual_seed").dtype.name == "uint8"
    assert not ckpt.catalog.facts.skipped_files


def test_accelerate_parts_equal_their_folders_opened_alone():
    """Each DCP sub-folder still opens by itself; the composite reads the same bytes."""
    whole = ckptkit.open(str(ACCELERATE))
    model = ckptkit.open(str(ACCELERATE / "pytorch_model_fsdp_0"))
    optimizer = ckptkit.open(str(ACCELERATE / "optimizer_0"))
    assert model.format == optimizer.format == "dcp"
    for key in ("model.transformer.wte.weight", "model.transformer.h.2.mlp.c_proj.bias"):
        assert torch.equal(whole.read(key), model.read(key))
    stat = "state.transformer.h.0.attn.c_attn.weight.exp_avg_sq"
    assert torch.equal(whole.read(f"optim.{stat}"), optimizer.read(f"optimizer.{stat}"))
    assert len(whole.catalog.select(groups="optim")) == len(optimizer.catalog.entries)


# --------------------------------------------------------------------------------------------
# Every layout: verify exits 0 and unshard's model.safetensors is the library's own load.


@pytest.mark.parametrize("layout", list(MODEL_LAYOUTS))
def test_cli_verify_and_unshard_model(layout, tmp_path, capsys):
    path, item, file, prefix = MODEL_LAYOUTS[layout]
    assert main(["verify", str(path)]) == 0, capsys.readouterr()
    assert "no problems found" in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["unshard", str(path), str(out), "--to", "safetensors", "--quiet"]) == 0
    assert_matches(load_file(out / "model.safetensors"), reference(item, file, prefix))


@pytest.mark.parametrize("layout", list(MODEL_LAYOUTS))
def test_model_group_is_found_wherever_the_layout_keeps_it(layout, tmp_path):
    """``groups=["model"]`` selects the model, reports count it, and the output is
    ``model.safetensors`` with the model's own keys, alone."""
    path, item, file, prefix = MODEL_LAYOUTS[layout]
    ckpt = ckptkit.open(str(path))
    model = ckpt.catalog.select(groups="model")
    expected = reference(item, file, prefix)
    assert {".".join(map(str, e.inner_path)) for e in model if e.kind == "tensor"} == set(expected)
    summary = ckpt.summary()
    assert summary.counted == "model"
    assert summary.parameters == sum(
        torch.Size(spec["shape"]).numel() for spec in expected.values()
    )
    result = ckptkit.unshard(
        ckpt, str(tmp_path), to="safetensors", groups=["model"], progress=False
    )
    assert [f.name for f in result.files] == ["model.safetensors"]


def test_flat_key_dcp_is_one_model_group_with_its_keys_unchanged(tmp_path):
    ckpt = ckptkit.open(str(TORCHTITAN / "step-20"))
    assert {e.group for e in ckpt.catalog.entries.values()} == {"model"}
    assert "tok_embeddings.weight" in ckpt.catalog.entries  # the stored key, as before
    assert list(ckpt.tensors["group"].unique()) == ["model"]
    result = ckptkit.unshard(ckpt, str(tmp_path), to="torch", progress=False)
    assert [f.name for f in result.files] == ["model.pt"]
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_matches(saved, reference("torchtitan_flat_dcp_ws2", "model.safetensors"))


def test_the_rest_of_a_lightning_checkpoint_keeps_its_group(tmp_path):
    ckpt = ckptkit.open(str(FIXTURES / "lightning_ckpt" / "last.ckpt"))
    assert {e.group for e in ckpt.catalog.entries.values()} == {"model", "last"}
    assert ckpt.entry("last.state_dict.embed.weight").group == "model"  # keys unchanged
    assert ckpt.entry("last.optimizer_states.0.state.0.exp_avg").group == "last"
    result = ckptkit.unshard(ckpt, str(tmp_path), to="safetensors", progress=False)
    assert sorted(f.name for f in result.files) == [
        "last.objects.pt",
        "last.safetensors",
        "model.safetensors",
    ]
    assert not any(k.startswith("state_dict.") for k in load_file(tmp_path / "last.safetensors"))


# --------------------------------------------------------------------------------------------
# A folder whose only checkpoint is one sub-folder.


def test_the_only_checkpoint_in_a_folder_opens_with_a_note(capsys):
    """``torchtitan_flat_dcp_ws2/`` holds ``step-20/`` (a DCP) and ``reference/`` (JSON)."""
    found = ckptkit.detect(str(TORCHTITAN))
    note = f"opened step-20/, the only checkpoint in {TORCHTITAN}"
    assert found.format == "dcp" and found.evidence[0] == note
    ckpt = ckptkit.open(str(TORCHTITAN))
    assert ckpt.url == str(TORCHTITAN / "step-20")
    assert ckpt.catalog.facts.notes == (note,)
    assert main(["inspect", str(TORCHTITAN)]) == 0
    first_lines = capsys.readouterr().out.splitlines()[:6]
    assert note in " ".join(" ".join(first_lines).split())  # wrapped to the terminal's width
    assert main(["inspect", "--json", str(TORCHTITAN)]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == [note]


def test_a_folder_of_two_checkpoints_is_still_refused(tmp_path):
    for name in ("step-10", "step-20"):
        (tmp_path / name).symlink_to(TORCHTITAN / "step-20", target_is_directory=True)
    with pytest.raises(NotACheckpointError, match=r"a folder of 2 checkpoint\(s\)"):
        ckptkit.open(str(tmp_path))


# --------------------------------------------------------------------------------------------
# transformers' names: what save_pretrained writes for the same tensors.


def _shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


@pytest.mark.parametrize("library", [HF4, HF5], ids=["transformers4", "transformers5"])
def test_transformers_names_equal_save_pretrained_output(library, tmp_path):
    """From the ``.bin`` shards (the state dict's order), sharded at the same size: the same
    files, byte for byte, and the same index; the tied ``lm_head.weight`` is stored once."""
    theirs = library / "st_sharded"
    out = tmp_path / "out"
    result = ckptkit.unshard(
        str(HF4 / "bin_sharded"),
        str(out),
        to="safetensors",
        names="transformers",
        max_shard_size="40KB",
        progress=False,
    )
    assert (
        _shards(out)
        == _shards(theirs)
        == [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json",
        ]
    )
    for name in _shards(theirs)[:-1]:
        assert (out / name).read_bytes() == (theirs / name).read_bytes(), name
    ours = json.loads((out / "model.safetensors.index.json").read_text())
    index = json.loads((theirs / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == index["weight_map"]
    assert list(ours["weight_map"]) == sorted(ours["weight_map"])
    assert ours["metadata"] == {"total_size": index["metadata"]["total_size"]}
    assert list(result.dropped) == ["pytorch_model.lm_head.weight"]
    assert "transformer.wte.weight" in result.dropped["pytorch_model.lm_head.weight"]


def test_transformers_names_one_file_is_what_save_file_writes(tmp_path):
    """Unsharded: ``model.safetensors`` alone, byte-equal to ``safetensors.torch.save_file`` of
    the same tensors."""
    theirs = HF5 / "st_sharded"
    ckptkit.unshard(
        str(theirs), str(tmp_path / "out"), to="safetensors", names="transformers", progress=False
    )
    assert _shards(tmp_path / "out") == ["model.safetensors"]
    tensors = {}
    for name in _shards(theirs)[:-1]:
        tensors.update(load_file(theirs / name))
    save_file(tensors, tmp_path / "library.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "library.safetensors").read_bytes()


def test_transformers_names_order_tensors_as_the_library_does(tmp_path):
    """The safetensors library stores a file's tensors by dtype (its enum order, last first),
    then by name; a ``pytorch_model.bin`` in another order comes out as it would."""
    gen = torch.Generator().manual_seed(26)
    state = {
        "z.weight": torch.randn(3, 2, generator=gen),
        "a.ids": torch.arange(5, dtype=torch.int64),
        "m.half": torch.randn(4, generator=gen).to(torch.bfloat16),
        "b.mask": torch.tensor([True, False, True]),
        "c.bytes": torch.arange(3, dtype=torch.uint8),
        "k.f16": torch.randn(2, 2, generator=gen).to(torch.float16),
        "y.i32": torch.arange(4, dtype=torch.int32),
        "d.f64": torch.randn(2, generator=gen).to(torch.float64),
        "a.weight": torch.randn(2, 3, generator=gen),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    out = tmp_path / "out"
    ckptkit.unshard(
        str(tmp_path / "pytorch_model.bin"), str(out), to="safetensors", names="transformers",
        progress=False,
    )  # fmt: skip
    save_file(state, tmp_path / "library.safetensors", metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (
        tmp_path / "library.safetensors"
    ).read_bytes()


def test_transformers_names_cli_and_refusals(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["unshard", str(ACCELERATE), str(out), "--to", "safetensors", "--names", "transformers"]
    assert main([*argv, "--quiet"]) == 0
    assert _shards(out) == ["model.safetensors"]
    assert_matches(load_file(out / "model.safetensors"), reference(
        "accelerate_fsdp2_sharded_ws2", "model.safetensors"
    ))  # fmt: skip
    with pytest.raises(UsageError, match="writes safetensors"):
        ckptkit.unshard(str(ACCELERATE), str(tmp_path / "a"), to="torch", names="transformers")
    with pytest.raises(UsageError, match="'model' group alone"):
        ckptkit.unshard(
            str(ACCELERATE), str(tmp_path / "b"), to="safetensors", names="transformers",
            groups=["optim"],
        )  # fmt: skip
    with pytest.raises(UsageError, match="writes safetensors"):
        ckptkit.convert(str(ACCELERATE), str(tmp_path / "c"), to="dcp", names="transformers")
    weights = tmp_path / "weights.pt"
    torch.save({"a": torch.ones(2)}, weights)  # group "weights": no model in it
    with pytest.raises(KeyNotFoundError, match="no group 'model'"):
        ckptkit.unshard(str(weights), str(tmp_path / "d"), to="safetensors", names="transformers")
    capsys.readouterr()
    assert main(["unshard", str(ACCELERATE), str(tmp_path / "e"), "--names", "transformers"]) == 2
    assert "writes safetensors" in capsys.readouterr().err
