"""DeepSpeed ZeRO checkpoints (``deepspeed_zero``), against the checked-in fixtures written by
deepspeed 0.19.8: fp32 weights bit-equal to DeepSpeed's own ``zero_to_fp32`` output, module
weights to the model-state file's tensors, Adam moments and fp32 masters to the live optimizer
at save time; partial reads, unshard, diff, verify, CLI, torch-free inspection, and hostile or
unsupported variants made by editing the real files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import CheckpointError, CorruptRecordError, FormatError, MissingFileError
from ckptkit.formats.deepspeed_zero.geometry import partitioned_layout, stage3_layout
from ckptkit.storage import Storage

from conformance_cases import DEEPSPEED_ITEMS, FIXTURES, deepspeed_oracle, expected_matches
from isolated import run_script
from oracle import raw_bytes

TAG = "global_step2"
#: What each fixture's ``ds_config`` and engine report (from its reference/engine_info.json).
STAGES = {
    "deepspeed_zero1_ws2": (1, 2, "DeepSpeed ZeRO stage 1"),
    "deepspeed_zero2_ws2": (2, 2, "DeepSpeed ZeRO stage 2"),
    "deepspeed_zero3_ws2": (3, 2, "DeepSpeed ZeRO stage 3"),
    "deepspeed_zero3_ws4": (3, 4, "DeepSpeed ZeRO stage 3"),
    "deepspeed_zero2_bf16_ws2": (2, 2, "DeepSpeed ZeRO stage 2"),
    "deepspeed_zero3_bf16_ws2": (3, 2, "DeepSpeed ZeRO stage 3"),
    "deepspeed_zero1_bf16_fp32accum_ws2": (1, 2, "DeepSpeed BF16_Optimizer (ZeRO stage 1)"),
    "deepspeed_zero2_legacy_serialization_ws2": (2, 2, "DeepSpeed ZeRO stage 2"),
}


def run_dir(item: str) -> Path:
    return FIXTURES / item / "checkpoint"


def reference(item: str) -> dict:
    return json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())


def engine(item: str) -> dict:
    return json.loads((FIXTURES / item / "reference" / "engine_info.json").read_text())


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


def test_items_cover_every_fixture():
    on_disk = {p.name for p in FIXTURES.iterdir() if p.name.startswith("deepspeed_zero")}
    assert on_disk == set(DEEPSPEED_ITEMS) == set(STAGES)


# --------------------------------------------------------------------------------------------
# Detection.


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_detects_run_dir_and_tag_dir(item):
    run = ckptkit.detect(str(run_dir(item)))
    assert run.format == "deepspeed_zero"
    assert run.evidence[0] == f"latest names tag '{TAG}': reading {TAG}/"
    optim = [n for n in os.listdir(run_dir(item) / TAG) if n.endswith("_optim_states.pt")]
    world = engine(item)["world_size"]
    assert len(optim) == world
    assert any(f"({world} optimizer partitions)" in line for line in run.evidence), run.evidence
    assert any("bf16_ prefix" in line for line in run.evidence) == engine(item)["bf16"]
    tag = ckptkit.detect(str(run_dir(item) / TAG))
    assert tag.format == "deepspeed_zero"
    assert not any("latest" in line for line in tag.evidence)


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_facts(item):
    stage, world, layout = STAGES[item]
    info = engine(item)
    assert (info.get("zero_stage", 1), info["world_size"]) == (stage, world)
    facts = ckptkit.open(str(run_dir(item))).catalog.facts
    assert (facts.world_size, facts.layout, facts.version) == (world, layout, "0.19.8")
    assert facts.checkpoint_id == TAG and facts.metadata_files == ("latest",)
    # DeepSpeed copies its converter scripts into every checkpoint folder; the fixtures keep
    # them once (zero2_ws2): listed as skipped, never read
    scripts = {p.name for p in run_dir(item).glob("zero_to_*.py")}
    assert scripts == (
        {"zero_to_fp32.py", "zero_to_torch.py"} if item == "deepspeed_zero2_ws2" else set()
    )
    assert set(facts.skipped_files) == scripts
    tag = ckptkit.open(str(run_dir(item) / TAG)).catalog
    assert tag.facts.metadata_files == () and tag.facts.checkpoint_id is None
    run_files = ckptkit.open(str(run_dir(item))).catalog.files
    assert [f"{TAG}/{f}" for f in tag.files] == list(run_files)


# --------------------------------------------------------------------------------------------
# Tensors against DeepSpeed's own outputs.


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_every_tensor_matches_deepspeed(item):
    """model.* = zero_to_fp32 (keys, order, dtypes, bits), module.* = the saved module,
    optim.state.* = the live Adam state: the whole oracle, nothing more in those groups."""
    ckpt = ckptkit.open(str(run_dir(item)))
    oracle = deepspeed_oracle(item)
    ours = {e.key for e in ckpt.catalog.tensors() if e.group in oracle.groups}
    assert ours == set(oracle.tensors)
    bad = {k: p for k, e in oracle.tensors.items() if (p := expected_matches(ckpt.read(k), e))}
    assert not bad, bad


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_model_group_is_zero_to_fp32_output_in_order(item):
    info = json.loads((FIXTURES / item / "reference" / "item.json").read_text())
    catalog = ckptkit.open(str(run_dir(item))).catalog
    keys = [e.key.removeprefix("model.") for e in catalog.tensors() if e.group == "model"]
    if info["zero_to_fp32_cli"]["ok"]:  # DeepSpeed's converter ran: its keys, in its order
        assert keys == info["fp32_model_keys"]
    else:  # BF16_Optimizer: the reference came from memory; stage 1 saves no frozen params
        frozen = engine(item)["frozen"]
        assert sorted(keys) == sorted(k for k in info["fp32_model_keys"] if k not in frozen)


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_fp32_masters_equal_the_live_optimizer(item):
    """Every trainable parameter's fp32 master as the engine held it in memory at save time."""
    live = reference(item)["reference/live_state.pt"]
    ckpt = ckptkit.open(str(run_dir(item)))
    masters = {
        k.removeprefix("fp32_master_weights."): v
        for k, v in live.items()
        if k.startswith("fp32_master_weights.")
    }
    assert len(masters) == 9
    for name, spec in masters.items():
        tensor = ckpt.read(f"model.{name}")
        assert (list(tensor.shape), sha(tensor)) == (spec["shape"], spec["sha256"]), name


@pytest.mark.parametrize("item", DEEPSPEED_ITEMS)
def test_geometry_details(item):
    """Tied head shares the embedding's chunks; the 0-d parameter is one element of one rank;
    chunks hold exactly the parameter's bytes (no padding); frozen params per stage."""
    stage, world, _ = STAGES[item]
    catalog = ckptkit.open(str(run_dir(item))).catalog
    embed, head = catalog.entries["model.embed.weight"], catalog.entries["model.head.weight"]
    assert head.chunks == embed.chunks and head.shape == embed.shape
    (scale,) = catalog.entries["model.scale"].chunks
    assert (scale.offsets, scale.sizes, scale.record.length) == ((), (), 4)
    for entry in catalog.tensors():
        if entry.group in ("model", "optim") and entry.key != "model.head.weight":
            held = sum(c.record.length for c in entry.chunks if c.record is not None)
            copies = len({c.rank for c in entry.chunks}) if entry.shape == () else 1
            assert held == entry.nbytes * copies, entry.key
    assert ("model.frozen_bias" in catalog.entries) == (stage > 1)
    assert "module.frozen_bias" in catalog.entries or stage == 3
    if stage == 3:  # each rank's padded fragment: ceil(160 / world) elements, the last cut
        chunks = catalog.entries["model.frozen_bias"].chunks
        size = -(-160 // world)
        assert [(c.rank, c.offsets, c.sizes) for c in chunks] == [
            (r, (r * size,), (min(size, 160 - r * size),)) for r in range(world)
        ]
        assert {e.key for e in catalog.tensors() if e.group == "module"} == {"module.position_ids"}
    fc1 = catalog.entries["model.fc1.weight"]
    assert len({c.rank for c in fc1.chunks}) > 1  # cut between ranks (mid-row in stages 1/2)


# --------------------------------------------------------------------------------------------
# Objects.


@pytest.mark.parametrize("item", ["deepspeed_zero2_ws2", "deepspeed_zero3_ws4"])
def test_trainer_state_and_optimizer_fields_as_objects(item):
    stage, world, _ = STAGES[item]
    ckpt = ckptkit.open(str(run_dir(item)))
    assert ckpt.read_object("train.global_steps") == 2
    assert ckpt.read_object("train.dp_world_size") == world
    assert ckpt.read_object("train.lr_scheduler") is None
    assert ckpt.read_object("train.ds_config.zero_optimization.stage") == stage
    assert ckpt.read_object("train.buffer_names") == ["position_ids"]
    assert ckpt.read_object("optim.zero_stage") == stage  # ZeroStageEnum → int
    assert ckpt.read_object("optim.param_groups.0.lr") == 0.001
    assert ckpt.read_object("optim.param_groups.0.betas") == (0.9, 0.999)
    scaler = ckpt.read_object("optim.loss_scaler")  # a class ckptkit does not decode
    assert type(scaler).__name__ == "Opaque" and scaler.state == {
        "cur_scale": 1.0,
        "dynamic": False,
    }
    assert not any(key.startswith("optim.single_partition") for key in ckpt.keys())  # noqa: SIM118


# --------------------------------------------------------------------------------------------
# Reading one parameter touches only its slices.


@pytest.mark.parametrize("item", ["deepspeed_zero2_ws2", "deepspeed_zero3_ws4"])
def test_reading_one_parameter_reads_only_its_slices(item, monkeypatch):
    ckpt = ckptkit.open(str(run_dir(item)))
    seen: list[tuple[str, int, int]] = []
    read_ranges = Storage.read_ranges

    def spy(self, ranges):
        seen.extend(ranges)
        return read_ranges(self, ranges)

    monkeypatch.setattr(Storage, "read_ranges", spy)
    for key in ("model.fc1.weight", "optim.state.fc2.weight.exp_avg"):
        seen.clear()
        tensor = ckpt.read(key)
        chunks = ckpt.entry(key).chunks
        expected = sorted(
            (c.record.file, c.record.offset, c.record.offset + c.record.length) for c in chunks
        )
        assert sorted(seen) == expected
        assert sum(end - start for _, start, end in seen) == tensor.numel() * 4
        assert all("optim_states" in file for file, _, _ in seen)


# --------------------------------------------------------------------------------------------
# Unshard, diff, verify, CLI, torch-free inspection.


@pytest.mark.parametrize(
    "item", ["deepspeed_zero2_ws2", "deepspeed_zero3_ws4", "deepspeed_zero1_bf16_fp32accum_ws2"]
)
def test_unshard_model_is_zero_to_fp32_output(item, tmp_path):
    """``model.pt`` holds what zero_to_fp32 returns: same keys in the same order, same dtypes
    and bits (BF16_Optimizer: the live reference, less the frozen parameter stage 1 drops)."""
    info = json.loads((FIXTURES / item / "reference" / "item.json").read_text())
    (fp32,) = [v for k, v in reference(item).items() if k.startswith("reference/fp32_model")]
    frozen = [] if info["zero_to_fp32_cli"]["ok"] else engine(item)["frozen"]
    ckptkit.unshard(str(run_dir(item)), str(tmp_path / "pt"), groups="model", progress=False)
    state = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    expected = [k for k in info["fp32_model_keys"] if k not in frozen]
    if info["zero_to_fp32_cli"]["ok"]:
        assert list(state) == expected
    else:
        assert sorted(state) == sorted(expected)
    for key, tensor in state.items():
        spec = fp32[key]
        assert (sha(tensor), str(tensor.dtype)) == (spec["sha256"], f"torch.{spec['dtype']}")


@pytest.mark.parametrize("item", ["deepspeed_zero2_bf16_ws2", "deepspeed_zero3_ws2"])
def test_unshard_safetensors_shards_with_moments(item, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "st"
    ckptkit.unshard(
        str(run_dir(item)),
        str(out),
        to="safetensors",
        groups=["model", "optim"],
        max_shard_size="8KB",
        progress=False,
    )
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    model = {k: v for shard in shards for k, v in load_file(out / shard).items()}
    oracle = deepspeed_oracle(item)
    for key, tensor in model.items():
        assert expected_matches(tensor, oracle.tensors[f"model.{key}"]) is None, key
    optim = {k: v for p in out.glob("optim*.safetensors") for k, v in load_file(p).items()}
    moments = {k: v for k, v in optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) == 18
    for key, tensor in moments.items():
        assert expected_matches(tensor, oracle.tensors[f"optim.{key}"]) is None, key
    back = ckptkit.open(str(out))
    assert back.read("model.fc1.weight").equal(
        ckptkit.open(str(run_dir(item))).read("model.fc1.weight")
    )


def test_diff_run_dir_with_tag_dir_and_across_stages():
    same = ckptkit.diff(
        str(run_dir("deepspeed_zero3_ws2")), str(run_dir("deepspeed_zero3_ws2") / TAG)
    )
    assert (same["status"] == "equal").all(), same[same["status"] != "equal"].head()
    # the same model and data trained under stage 2 and stage 3: same keys in model/optim
    two = ckptkit.open(str(run_dir("deepspeed_zero2_ws2")))
    three = ckptkit.open(str(run_dir("deepspeed_zero3_ws2")))
    keys = lambda c: {e.key for e in c.catalog.tensors() if e.group in ("model", "optim")}  # noqa: E731
    assert keys(two) == keys(three)
    frame = ckptkit.diff(two, three, keys=["model.*", "optim.state.*"])
    assert set(frame["key"]) == keys(two)
    assert not frame["status"].isin(["only_a", "only_b"]).any()


@pytest.mark.parametrize(
    "item", ["deepspeed_zero1_ws2", "deepspeed_zero2_legacy_serialization_ws2"]
)
def test_verify_clean_then_damaged(item, tmp_path):
    """Clean as written; a flipped byte in a storage the zip's CRC-32 covers whole (the buffer)
    is a checksum problem naming its keys; a truncated rank file is named."""
    assert ckptkit.verify(str(run_dir(item))).empty
    copy = _copy(item, tmp_path)
    record = ckptkit.open(str(copy)).entry("model.position_ids").chunks[0].record
    path = copy / record.file
    data = bytearray(path.read_bytes())
    data[record.offset + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = ckptkit.verify(str(copy))
    if record.crc32 is not None:  # zips store one; pre-1.6 files store none
        assert {"model.position_ids", "module.position_ids"} <= set(problems["key"])
    rank1 = copy / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    problems = ckptkit.verify(str(copy))
    assert problems["detail"].str.contains("zero_pp_rank_1_mp_rank_00_optim_states.pt").any()


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_cli_inspect_json():
    result = cli("inspect", run_dir("deepspeed_zero3_ws4"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "deepspeed_zero"
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model.fc1.weight"]["shape"] == [85, 32]
    assert tensors["model.fc1.weight"]["n_chunks"] == 4
    assert tensors["model.scale"]["shape"] == []
    assert set(tensors) == {
        e.key for e in ckptkit.open(str(run_dir("deepspeed_zero3_ws4"))).catalog.tensors()
    }


@pytest.mark.parametrize(
    "item",
    [
        "deepspeed_zero1_bf16_fp32accum_ws2",
        "deepspeed_zero2_legacy_serialization_ws2",
    ],
)
def test_cli_unshard_diff_verify(item, tmp_path):
    """The command line end to end: unshard (safetensors shards), then the output diffs equal
    with the checkpoint and both verify clean; the shards hold zero_to_fp32's bits."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    done = cli("unshard", run_dir(item), out, "--to", "safetensors", "--max-shard-size", "16KB")
    assert done.returncode == 0, done.stderr
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model = {k: v for p in out.glob("model-*.safetensors") for k, v in load_file(p).items()}
    oracle = deepspeed_oracle(item)
    assert {f"model.{k}" for k in model} == {k for k in oracle.tensors if k.startswith("model.")}
    for key, tensor in model.items():
        assert expected_matches(tensor, oracle.tensors[f"model.{key}"]) is None, key
    same = cli("diff", run_dir(item), out)
    assert same.returncode == 0, same.stdout + same.stderr
    for path in (run_dir(item), out):
        checked = cli("verify", path)
        assert checked.returncode == 0, checked.stdout + checked.stderr


TORCH_BLOCKED = r"""
import hashlib, json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

ckpt = ckptkit.open(sys.argv[1])
tensors = {
    e.key: hashlib.sha256(ckpt.read_numpy(e.key).tobytes()).hexdigest()
    for e in ckpt.catalog.tensors()
}
objects = {e.key: repr(ckpt.read_object(e.key)) for e in ckpt.catalog.objects()}
assert sys.modules["torch"] is None
print(json.dumps({"format": ckpt.format, "tensors": tensors, "objects": objects}))
"""


@pytest.mark.parametrize("item", ["deepspeed_zero2_bf16_ws2", "deepspeed_zero3_ws4"])
def test_inspection_and_reads_without_torch(item):
    seen = json.loads(run_script(TORCH_BLOCKED, run_dir(item), timeout=300))
    assert seen["format"] == "deepspeed_zero"
    oracle = deepspeed_oracle(item)
    for key, expected in oracle.tensors.items():
        assert seen["tensors"][key] == expected.sha256, key
    assert seen["objects"]["train.global_steps"] == "2"
    assert seen["objects"]["optim.loss_scaler"] == "<deepspeed.runtime.fp16.loss_scaler.LossScaler>"


# --------------------------------------------------------------------------------------------
# Hostile and unsupported variants, made by editing the real files.


def _copy(item: str, tmp_path: Path) -> Path:
    copy = tmp_path / item
    shutil.copytree(run_dir(item), copy)
    return copy


def _replace_member(path: Path, suffix: str, data: bytes) -> None:
    """Rewrite a torch.save zip with the member ending in ``suffix`` replaced."""
    with zipfile.ZipFile(path) as old:
        members = [(info, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for info, content in members:
            new.writestr(info, data if info.filename.endswith(suffix) else content)


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize(
    "file", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
)
def test_pickle_naming_os_system_is_refused_and_never_run(file, tmp_path):
    copy = _copy("deepspeed_zero2_ws2", tmp_path)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(
        {
            "optimizer_state_dict": _RunsCommand(f"touch {marker}"),
            "module": _RunsCommand(f"touch {marker}"),
        },
        protocol=2,
    )
    _replace_member(copy / TAG / file, "/data.pkl", payload)
    with pytest.raises(FormatError, match=file) as caught:
        ckptkit.open(str(copy))
    assert "posix.system" in str(caught.value) or "os.system" in str(caught.value)
    assert not marker.exists()
    problems = ckptkit.verify(str(copy))
    assert not problems.empty and not marker.exists()


def test_param_shapes_claiming_more_elements_is_a_typed_error(tmp_path):
    copy = _copy("deepspeed_zero2_ws2", tmp_path)
    path = copy / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["param_shapes"][0]["fc1.bias"] = torch.Size([90])  # 85 saved
    torch.save(state, path)
    with pytest.raises(CorruptRecordError) as caught:
        ckptkit.open(str(copy))
    message = str(caught.value)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in message
    assert "'optimizer_state_dict.single_partition_of_fp32_groups.0'" in message
    assert "param_shapes" in message and "mp_rank_00_model_states.pt" in message


def test_param_shapes_disagreeing_with_fragment_mappings_is_refused(tmp_path):
    """Same total, two shapes swapped: DeepSpeed's own param_slice_mappings catch it."""
    copy = _copy("deepspeed_zero2_ws2", tmp_path)
    path = copy / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    shapes = state["param_shapes"][0]
    shapes["fc1.bias"], shapes["fc2.bias"] = torch.Size([32]), torch.Size([85])
    torch.save(state, path)
    with pytest.raises(CorruptRecordError, match="param_slice_mappings.0.fc1.bias"):
        ckptkit.open(str(copy))


def test_stage3_flat_groups_shorter_than_param_shapes(tmp_path):
    copy = _copy("deepspeed_zero3_ws2", tmp_path)
    path = copy / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["param_shapes"][0]["odd"] = torch.Size([38, 19])
    torch.save(state, path)
    with pytest.raises(CorruptRecordError, match="param_shapes") as caught:
        ckptkit.open(str(copy))
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in str(caught.value)


@pytest.mark.parametrize(
    ("rename", "expected"),
    [
        ("zero_pp_rank_1_mp_rank_01_optim_states.pt", "model-parallel rank 1"),
        ("layer_01-model_00-model_states.pt", "pipeline layer files lie beside it"),
        ("expp_rank_1_mp_rank_00_optim_states.pt", r"MoE \(expert-parallel\)"),
        ("layer_0_expert_1_mp_rank_00_model_states.pt", r"MoE \(expert-parallel\)"),
        ("offloaded_tensors/rank1.swp", "NVMe-offloaded"),
    ],
)
def test_unsupported_layouts_are_named(rename, expected, tmp_path):
    copy = _copy("deepspeed_zero2_ws2", tmp_path)
    tag = copy / TAG
    (tag / rename).parent.mkdir(exist_ok=True)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(tag / rename)
    with pytest.raises(FormatError, match=expected):
        ckptkit.open(str(copy))


def test_missing_rank_and_bad_latest(tmp_path):
    copy = _copy("deepspeed_zero3_ws4", tmp_path)
    (copy / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="rank"):
        ckptkit.open(str(copy))


@pytest.mark.parametrize(
    ("latest", "error", "says"),
    [
        ("../../etc", FormatError, r"latest: does not name a tag directory: b'\.\./\.\./etc'"),
        ("", FormatError, "latest: does not name a tag directory: b''"),
        ("global_step9", MissingFileError, r"global_step9: missing \(latest names it\)"),
        ("empty_step", FormatError, r"empty_step: not a ZeRO tag directory \(latest names it\)"),
    ],
)
def test_a_stale_or_damaged_latest_is_an_error_naming_the_tags_there(tmp_path, latest, error, says):
    """DeepSpeed's loader fails on a ``latest`` naming no tag directory; so does ckptkit, never
    opening another step in its stead, and it names the tags the run holds (the latest last)."""
    run = _copy("deepspeed_zero1_ws2", tmp_path)
    (run / "empty_step").mkdir()
    shutil.copytree(run / TAG, run / "global_step10")  # natural order: after TAG (global_step2)
    (run / "latest").write_text(latest)  # "../../etc": never followed, not a tag name
    tags = f"tag directories here: {TAG}, global_step10 \\(open one: ckptkit inspect "
    for forced in (None, "deepspeed_zero"):
        with pytest.raises(error, match=f"{says}; {tags}{re.escape(str(run / 'global_step10'))}"):
            ckptkit.open(str(run), format=forced)
    done = subprocess.run(
        [sys.executable, "-m", "ckptkit", "inspect", str(run)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "global_step10" in done.stderr
    (run / "latest").write_text("global_step10")
    assert ckptkit.open(str(run)).catalog.facts.checkpoint_id == "global_step10"


# --------------------------------------------------------------------------------------------
# The partition arithmetic on its own, over layouts the fixtures do not have.


@given(
    groups=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=3),
    world=st.integers(1, 9),
)
@settings(max_examples=200, deadline=None)
def test_partitioned_layout_tiles_each_group(groups, world):
    """Stages 1/2: every element of every parameter on exactly one rank, at the place the
    group's flat index ``rank·P + offset`` says, and no rank holding more than ``P``."""
    named = [[(f"g{g}p{i}", n) for i, n in enumerate(group)] for g, group in enumerate(groups)]
    layout = partitioned_layout(named, world)
    for g, group in enumerate(named):
        size = layout.capacity[0][g]
        assert size * world >= sum(n for _, n in group) and (size * world) % (2 * world) == 0
        first = 0
        for name, numel in group:
            held = []
            for piece in layout.pieces[name]:
                assert piece.group == g and piece.offset + piece.numel <= size
                assert piece.offset + piece.numel <= layout.needed[piece.rank][g]
                assert piece.rank * size + piece.offset == first + piece.start
                held += range(piece.start, piece.start + piece.numel)
            assert held == list(range(numel))
            first += numel


@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    world=st.integers(1, 6),
    cuts=st.lists(st.integers(0, 100), max_size=3),
)
@settings(max_examples=200, deadline=None)
def test_stage3_layout_tiles_each_parameter(numels, world, cuts):
    """Stage 3: each parameter's ranks' slices, wherever the flat groups are cut, give its
    elements in order exactly once (the padding never)."""
    per_rank = sum(-(-n // world) for n in numels)
    bounds = sorted({0, per_rank, *(c % (per_rank + 1) for c in cuts)})
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)] or [0]
    params = [(f"p{i}", n) for i, n in enumerate(numels)]
    layout = stage3_layout(params, world, sizes)
    for name, numel in params:
        held = []
        for piece in sorted(layout.pieces[name], key=lambda p: p.start):
            assert piece.offset + piece.numel <= sizes[piece.group]
            held += range(piece.start, piece.start + piece.numel)
        assert held == list(range(numel))
    with pytest.raises(CorruptRecordError):
        stage3_layout([*params, ("extra", world * 3)], world, sizes)


@pytest.mark.parametrize("item", ["deepspeed_zero2_bf16_ws2", "deepspeed_zero3_bf16_ws2"])
def test_unshard_float32_is_zero_to_fp32_cli_output(item, tmp_path):
    """DeepSpeed's CLI (``zero_to_fp32.py dir out``) also casts bf16 frozen parameters to fp32;
    ``unshard(dtype="float32")`` writes exactly its ``pytorch_model.bin``."""
    cli_out = reference(item)["reference/zero_to_fp32_out/pytorch_model.bin"]
    assert cli_out["frozen_bias"]["dtype"] == "float32"  # the API's fp32_model.pt keeps bf16
    out = tmp_path / "pt"
    ckptkit.unshard(str(run_dir(item)), str(out), groups="model", dtype="float32", progress=False)
    state = torch.load(out / "model.pt", weights_only=True)
    assert sorted(state) == sorted(cli_out)
    for key, tensor in state.items():
        assert (sha(tensor), str(tensor.dtype)) == (
            cli_out[key]["sha256"],
            f"torch.{cli_out[key]['dtype']}",
        ), key
