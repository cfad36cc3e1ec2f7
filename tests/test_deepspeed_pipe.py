"""DeepSpeed pipeline-parallel checkpoints (``PipelineModule``, read by the ``deepspeed_zero``
adapter), against ``deepspeed_pipe_ws2``: DeepSpeed 0.19.8's own save of a 2-stage pipeline
(layers 0-3 | 4-5, a tied embedding, a frozen parameter, a 0-d int64 buffer) with ZeRO stage 1,
its reference DeepSpeed's own ``load_checkpoint`` into a fresh engine. Layer files keep
``PipelineModule.state_dict()`` names; ``verify`` is clean and ``unshard`` bit-equal; variants
made by renaming, copying or editing the real files check the refusals (exit 2, unsupported) and
the damage reports (exit 1).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import (
    CorruptRecordError,
    FormatError,
    MissingFileError,
    UnsupportedLayoutError,
)

from conformance_cases import FIXTURES, deepspeed_pipe_oracle, expected_matches
from oracle import raw_bytes

ITEM = "deepspeed_pipe_ws2"
RUN = FIXTURES / ITEM / "checkpoint"
TAG = "global_step2"


def _reference() -> dict[str, dict]:
    listed = json.loads((FIXTURES / ITEM / "reference" / "tensors.sha256.json").read_text())
    return listed["reference/module_state_dict.pt"]


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(RUN, copy)
    return copy


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


# --------------------------------------------------------------------------------------------
# Reading: names, values, facts.


def test_layer_files_keep_pipeline_module_names():
    """``model.*`` are the keys of DeepSpeed's ``PipelineModule.state_dict()`` (merged over the
    stages), each from its layer file; layer 0, a TiedLayerSpec, is ``tied_modules.embed``."""
    ckpt = ckptkit.open(str(RUN))
    model = {e.key.removeprefix("model."): e for e in ckpt.catalog.select(groups="model")}
    assert sorted(model) == sorted(_reference())
    files = {name: entry.chunks[0].record.file.rsplit("/", 1)[-1] for name, entry in model.items()}
    assert files["tied_modules.embed.weight"] == "layer_00-model_states.pt"
    assert files["1.weight"] == files["1.bias"] == "layer_01-model_states.pt"
    assert files["3.steps_seen"] == files["3.frozen_bias"] == "layer_03-model_states.pt"
    assert files["4.weight"] == "layer_04-model_states.pt"
    assert ckpt.catalog.facts.layout == (
        "DeepSpeed pipeline parallel (2 stages × 1 data-parallel rank), ZeRO stage 1"
    )
    assert ckpt.catalog.facts.world_size == 2
    assert ckpt.catalog.facts.checkpoint_id == TAG


def test_every_tensor_equals_deepspeeds_own_load():
    ckpt = ckptkit.open(str(RUN))
    oracle = deepspeed_pipe_oracle(ITEM)
    ours = {e.key for e in ckpt.catalog.tensors() if e.group in oracle.groups}
    assert ours == set(oracle.tensors)
    for key, expected in oracle.tensors.items():
        assert expected_matches(ckpt.read(key), expected) is None, key
    # fp32 training: the masters in the optimizer partitions are the layer files' weights
    for name in ("tied_modules.embed.weight", "1.weight", "3.norm.bias", "4.bias"):
        assert torch.equal(ckpt.read(f"model.{name}"), ckpt.read(f"optim.fp32.{name}"))


def test_each_stage_optimizer_comes_from_its_own_partitions():
    """Stage 0's parameters from ``mp_rank_00``'s partition, stage 1's from ``mp_rank_01``'s
    (chunks on global rank 1); the tied embedding, in both, from stage 0's."""
    ckpt = ckptkit.open(str(RUN))

    def source(key: str) -> tuple[str, int | None]:
        chunk = ckpt.entry(key).chunks[0]
        return chunk.record.file.rsplit("/", 1)[-1], chunk.rank

    assert source("optim.state.1.weight.exp_avg") == (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        0,
    )
    assert source("optim.fp32.4.weight") == ("zero_pp_rank_0_mp_rank_01_optim_states.pt", 1)
    assert source("optim.state.tied_modules.embed.weight.exp_avg_sq")[1] == 0
    assert "optim.state.3.frozen_bias.exp_avg" not in ckpt.catalog.entries  # frozen: no state
    assert ckpt.read_object("train.global_steps") == 2


def test_tag_directory_and_tp_rank_00_names_read_the_same(tmp_path):
    """With a tensor-parallel axis of size 1 DeepSpeed names layers ``layer_XX-model_00-…``."""
    copy = _copy(tmp_path)
    for path in (copy / TAG).glob("layer_*-model_states.pt"):
        path.rename(path.with_name(path.name.replace("-model_states", "-model_00-model_states")))
    renamed = ckptkit.open(str(copy / TAG))
    original = ckptkit.open(str(RUN))
    assert [e.key for e in renamed.catalog.tensors()] == [e.key for e in original.catalog.tensors()]
    for entry in renamed.catalog.select(groups="model"):
        assert torch.equal(renamed.read(entry.key), original.read(entry.key)), entry.key


def test_a_tied_module_saved_by_two_layers_is_one_tensor(tmp_path):
    """A TiedLayerSpec without ``forward_fn`` is saved at each of its layers (the same state
    dict): one ``model.tied_modules.*`` entry whose replica chunks come from both files."""
    copy = _copy(tmp_path)
    shutil.copy(copy / TAG / "layer_00-model_states.pt", copy / TAG / "layer_05-model_states.pt")
    ckpt = ckptkit.open(str(copy))
    entry = ckpt.entry("model.tied_modules.embed.weight")
    files = [c.record.file.rsplit("/", 1)[-1] for c in entry.chunks]
    assert files == ["layer_00-model_states.pt", "layer_05-model_states.pt"]
    assert not [k for k in ckpt.catalog.entries if k.startswith("model.5.")]
    expected = _reference()["tied_modules.embed.weight"]["sha256"]
    assert _sha(ckpt.read("model.tied_modules.embed.weight")) == expected
    assert ckptkit.verify(str(copy)).empty


# --------------------------------------------------------------------------------------------
# The command line: verify and unshard as a user runs them.


def test_cli_verify_is_clean_and_unshard_is_bit_equal(tmp_path, capsys):
    assert main(["verify", str(RUN)]) == 0
    out = tmp_path / "out"
    assert main(["unshard", str(RUN), str(out), "--to", "safetensors"]) == 0
    capsys.readouterr()
    reference = _reference()
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        assert sorted(written.keys()) == sorted(reference)
        for key, spec in reference.items():
            tensor = written.get_tensor(key)
            assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [
                spec["shape"],
                spec["dtype"],
            ], key
            assert _sha(tensor) == spec["sha256"], key
    oracle = deepspeed_pipe_oracle(ITEM)
    with safe_open(str(out / "optim.safetensors"), "pt") as written:
        optim = {f"optim.{key}": written.get_tensor(key) for key in written.keys()}  # noqa: SIM118
    expected = {k: v for k, v in oracle.tensors.items() if k.startswith("optim.")}
    assert sorted(optim) == sorted(expected)
    for key, tensor in optim.items():
        assert expected_matches(tensor, expected[key]) is None, key


# --------------------------------------------------------------------------------------------
# Unsupported layouts: named, and exit status 2 from inspect and verify alike.


def _exit_codes(path: Path, capsys) -> tuple[int, int, str]:
    inspected = main(["inspect", str(path)])
    verified = main(["verify", str(path)])
    return inspected, verified, capsys.readouterr().err


def test_pipeline_with_tensor_parallel_layer_files_is_refused_by_name(tmp_path, capsys):
    copy = _copy(tmp_path)
    tag = copy / TAG
    for path in tag.glob("layer_*-model_states.pt"):
        path.rename(path.with_name(path.name.replace("-model_states", "-model_00-model_states")))
    shutil.copy(
        tag / "layer_01-model_00-model_states.pt", tag / "layer_01-model_01-model_states.pt"
    )
    with pytest.raises(UnsupportedLayoutError, match="tensor-parallel rank 1's slice") as caught:
        ckptkit.open(str(copy))
    assert "layer_01-model_01-model_states.pt" in str(caught.value)
    assert "pipeline + tensor parallel" in str(caught.value)
    with pytest.raises(UnsupportedLayoutError):  # raised, not a "damage" row
        ckptkit.verify(str(copy))
    inspected, verified, err = _exit_codes(copy, capsys)
    assert (inspected, verified) == (2, 2), err
    assert err.count("pipeline + tensor parallel") == 2


def test_tensor_parallel_degree_in_the_model_states_is_refused(tmp_path):
    copy = _copy(tmp_path)
    path = copy / TAG / "mp_rank_01_model_states.pt"
    state = torch.load(path, weights_only=False)
    state["checkpoint_parallel_dimensions"]["tp_degree"] = 2
    torch.save(state, path)
    with pytest.raises(UnsupportedLayoutError, match="tp_degree 2") as caught:
        ckptkit.open(str(copy))
    assert "mp_rank_01_model_states.pt" in str(caught.value)


def test_moe_files_are_refused_with_exit_2_everywhere(tmp_path, capsys):
    """The exit-status mapping is the error class's, whatever the layout: a MoE file beside a
    ZeRO data-parallel checkpoint is unsupported too, not damage."""
    copy = tmp_path / "zero"
    shutil.copytree(FIXTURES / "deepspeed_zero1_ws2" / "checkpoint", copy)
    tag = copy / TAG
    shutil.copy(
        tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        tag / "expp_rank_1_mp_rank_00_optim_states.pt",
    )
    with pytest.raises(UnsupportedLayoutError, match=r"MoE \(expert-parallel\)"):
        ckptkit.open(str(copy))
    inspected, verified, err = _exit_codes(copy, capsys)
    assert (inspected, verified) == (2, 2), err


def test_model_parallel_files_without_layer_files_blame_tensor_parallelism(tmp_path):
    copy = tmp_path / "zero"
    shutil.copytree(FIXTURES / "deepspeed_zero1_ws2" / "checkpoint", copy)
    tag = copy / TAG
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(
        tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    )
    with pytest.raises(UnsupportedLayoutError, match="model-parallel rank 1"):
        ckptkit.open(str(copy))


# --------------------------------------------------------------------------------------------
# Damage: a missing or disagreeing file is a problem row (exit 1), never "unsupported".


def test_a_missing_layer_file_is_damage(tmp_path, capsys):
    copy = _copy(tmp_path)
    (copy / TAG / "layer_04-model_states.pt").unlink()
    with pytest.raises(MissingFileError, match=r"layer_04-model_states\.pt is missing"):
        ckptkit.open(str(copy))
    problems = ckptkit.verify(str(copy))
    assert list(problems["problem"]) == ["missing file"]
    assert "'4.weight'" in problems["detail"][0]
    assert main(["verify", str(copy)]) == 1
    capsys.readouterr()


@pytest.mark.parametrize(
    ("remove", "expected"),
    [
        (
            ["zero_pp_rank_0_mp_rank_01_optim_states.pt"],
            "no optimizer partitions of pipeline stage 1",
        ),
        (
            [
                "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_0_mp_rank_01_optim_states.pt",
            ],
            "no optimizer partitions",
        ),
        (["mp_rank_01_model_states.pt"], r"mp_rank_01_model_states\.pt\) is missing"),
    ],
)
def test_missing_stage_files_are_named(remove, expected, tmp_path):
    copy = _copy(tmp_path)
    for name in remove:
        (copy / TAG / name).unlink()
    with pytest.raises(MissingFileError, match=expected):
        ckptkit.open(str(copy))
    assert list(ckptkit.verify(str(copy))["problem"]) == ["missing file"]


def test_layer_file_disagreeing_with_param_shapes_is_corrupt(tmp_path):
    copy = _copy(tmp_path)
    path = copy / TAG / "layer_04-model_states.pt"
    state = torch.load(path, weights_only=True)
    state["bias"] = torch.zeros(23)  # param_shapes says 24
    torch.save(state, path)
    with pytest.raises(CorruptRecordError, match="'4.bias'") as caught:
        ckptkit.open(str(copy))
    message = str(caught.value)
    assert "layer_04-model_states.pt" in message and "'param_shapes' in" in message
    assert "mp_rank_01_model_states.pt" in message  # stage 1's, which holds layer 4


def test_model_states_of_a_non_pipeline_save_beside_layer_files(tmp_path):
    """A ZeRO save's ``mp_rank_00`` holds the module: with layer files beside it, two saves
    were mixed."""
    copy = tmp_path / "zero"
    shutil.copytree(FIXTURES / "deepspeed_zero1_ws2" / "checkpoint", copy)
    shutil.copy(RUN / TAG / "layer_01-model_states.pt", copy / TAG / "layer_01-model_states.pt")
    with pytest.raises(FormatError, match="pipeline layer files lie beside it"):
        ckptkit.open(str(copy))
