"""Megatron-LM legacy ``--ckpt-format torch`` checkpoints (the ``megatron_legacy_*`` fixtures,
tests/fixtures/generators/megatron_legacy.py): TP and PP rank files merged by Megatron's naming
rules, against the TP=1, PP=1 model they were split from; Megatron's own converter's SwiGLU
handling; per-rank state; and refusals (unknown names, shapes disagreeing with ``args``…) on
copies re-saved by torch with one thing changed."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import CoverageError, FormatError
from ckptkit.formats import ADAPTERS
from ckptkit.formats.megatron_legacy import MegatronLegacyError

from conformance_cases import FIXTURES
from oracle import inspect_without_torch, raw_bytes

ITEMS = ("megatron_legacy_tp2_ws2", "megatron_legacy_tp2_pp2_ws4", "megatron_legacy_swiglu_tp2_ws2")
ITERATION = "iter_0000010"
GENERATOR = FIXTURES / "generators" / "megatron_legacy.py"


def _run(item: str) -> Path:
    return FIXTURES / item / "run"


def _reference(item: str) -> dict[str, dict]:
    listed = json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())
    return listed["model.pt"]


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


@contextlib.contextmanager
def _megatron_enums() -> Iterator[None]:
    """The generator's stand-in for Megatron's enum module while torch loads or saves a rank
    file (its args name ``megatron.core.transformer.enums.AttnBackend``; Megatron is not
    installed); ``sys.modules`` as it was afterwards."""
    names = ["megatron", "megatron.core", "megatron.core.transformer"]
    names.append("megatron.core.transformer.enums")
    before = {name: sys.modules.get(name) for name in names}
    spec = importlib.util.spec_from_file_location("_megatron_legacy_generator", GENERATOR)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generator._megatron_enums()
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _rank_state(item: str, label: str) -> dict:
    """A rank file as torch loads it (our own fixture: a trusted oracle)."""
    path = _run(item) / ITERATION / label / "model_optim_rng.pt"
    with _megatron_enums():
        return torch.load(path, weights_only=False)


def _matches(tensor: torch.Tensor, spec: dict) -> bool:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return (list(tensor.shape), dtype, _sha(tensor)) == (
        spec["shape"],
        spec["dtype"],
        spec["sha256"],
    )


# --------------------------------------------------------------------------------------------
# Detection.


def test_run_and_iteration_folders_are_detected_before_megatron_dist():
    order = list(ADAPTERS)
    assert order.index("megatron_legacy") < order.index("megatron_dist")
    run = ckptkit.detect(str(_run("megatron_legacy_tp2_ws2")))
    assert run.format == "megatron_legacy"
    assert "latest_checkpointed_iteration.txt naming iter_0000010/" in run.evidence[0]
    inner = ckptkit.detect(str(_run("megatron_legacy_tp2_pp2_ws4") / ITERATION))
    assert inner.format == "megatron_legacy"
    assert "4 rank folder(s) mp_rank_00_000 … mp_rank_01_001" in inner.evidence[0]
    # one TP rank holds parts of tensors: its folder or file opens the whole set
    folder = _run("megatron_legacy_tp2_ws2") / ITERATION / "mp_rank_01"
    for one in (folder, folder / "model_optim_rng.pt"):
        found = ckptkit.detect(str(one))
        assert (found.format, found.storage.url) == ("megatron_legacy", str(folder.parent))
        assert "the whole set beside it is opened" in found.evidence[0]
    raw = ckptkit.open(str(folder / "model_optim_rng.pt"), format="torch_save")
    assert raw.read("model_optim_rng.model.output_layer.weight").shape == (64, 48)


def test_the_tracker_alone_decides_nothing(tmp_path):
    """verl writes latest_checkpointed_iteration.txt too, beside global_step_N/; and a tracker
    naming an iteration without rank folders is no legacy checkpoint."""
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    step = tmp_path / "global_step_10"
    step.mkdir()
    torch.save({"w": torch.ones(2)}, step / "model.pt")
    (tmp_path / ITERATION).mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / ITERATION / "model.pt")
    try:
        found = ckptkit.detect(str(tmp_path)).format
    except FormatError:
        found = None
    assert found != "megatron_legacy"


# --------------------------------------------------------------------------------------------
# The merged model against the TP=1 model, through the CLI and without torch.


@pytest.mark.parametrize("item", ITEMS)
def test_cli_verify_and_unshard_give_the_tp1_model(item, tmp_path, capsys):
    assert main(["verify", str(_run(item))]) == 0
    assert "no problems found" in capsys.readouterr().out
    out = tmp_path / "out"
    assert main(["unshard", str(_run(item)), str(out), "--to", "safetensors"]) == 0
    model = load_file(out / "model.safetensors")
    reference = _reference(item)
    assert model.keys() == reference.keys()  # a tied copy is not written: stored once
    bad = [key for key, spec in reference.items() if not _matches(model[key], spec)]
    assert not bad, bad


def test_inspection_and_reads_without_torch():
    """Tables, summary and reads with torch blocked (the items whose objects pickle back to
    the test: the TE one's ``io.BytesIO`` extra state stays a placeholder)."""
    items = ITEMS[1:]
    paths = [str(_run(item) / ITERATION) for item in items]
    for item, seen in zip(items, inspect_without_torch(*paths), strict=True):
        reference = _reference(item)
        digests = {
            k.removeprefix("model."): v
            for k, v in seen["tensors"].items()
            if k.startswith("model.")
        }
        assert digests == {key: spec["sha256"] for key, spec in reference.items()}, item


# --------------------------------------------------------------------------------------------
# How the pieces are placed.


def test_swiglu_fc1_equals_megatrons_converter():
    """Megatron's tools/checkpoint/loader_legacy.py: chunk each rank's fc1 in two, concatenate
    the first halves (W) of every rank, then the second halves (V); TP=1 holds [W; V]."""
    item = "megatron_legacy_swiglu_tp2_ws2"
    ckpt = ckptkit.open(str(_run(item)))
    ranks = [_rank_state(item, f"mp_rank_{r:02d}")["model"] for r in range(2)]
    for layer in range(2):
        key = f"decoder.layers.{layer}.mlp.linear_fc1.weight"
        halves = [torch.chunk(state[key], 2, dim=0) for state in ranks]
        w = torch.cat([h[0] for h in halves], dim=0)
        v = torch.cat([h[1] for h in halves], dim=0)
        assert torch.equal(ckpt.read(f"model.{key}"), torch.cat([w, v], dim=0))
        entry = ckpt.catalog.entries[f"model.{key}"]
        assert [c.offsets[0] for c in entry.chunks] == [0, 64, 32, 96]  # gate_r, up_r per rank
        assert [c.rank for c in entry.chunks] == [0, 0, 1, 1]
    row = ckpt.catalog.entries["model.decoder.layers.0.mlp.linear_fc2.weight"]
    assert [c.offsets for c in row.chunks] == [(0, 0), (0, 32)]  # row-parallel: dim 1


def test_pipeline_stages_are_renumbered_and_the_tied_copy_is_kept_aside():
    item = "megatron_legacy_tp2_pp2_ws4"
    ckpt = ckptkit.open(str(_run(item)))
    prefix = "model.language_model.encoder.layers."
    layers = {
        key[len(prefix) :].split(".")[0] for key in ckpt.catalog.entries if key.startswith(prefix)
    }
    assert layers == {"0", "1", "2", "3"}
    # global layer 3 is the second stage's local layer 1, columns of its two TP ranks
    pieces = [
        _rank_state(item, f"mp_rank_{tp:02d}_001")["model"]["language_model"]["encoder"][
            "layers.1.self_attention.dense.weight"
        ]
        for tp in range(2)
    ]
    merged = ckpt.read(f"{prefix}3.self_attention.dense.weight")
    assert torch.equal(merged, torch.cat(pieces, dim=1))
    assert ckpt.catalog.facts.alternate_groups == ("tied_copy",)
    copy = ckpt.read("tied_copy.word_embeddings_for_head.weight")
    assert torch.equal(copy, ckpt.read("model.language_model.embedding.word_embeddings.weight"))
    assert "tied_copy.word_embeddings_for_head.weight" not in {e.key for e in ckpt.catalog.select()}
    assert ckpt.catalog.facts.world_size == 4
    assert ckpt.catalog.facts.rank_files[2] == "mp_rank_00_001/model_optim_rng.pt"


def test_replicated_parameters_keep_every_ranks_copy():
    item = "megatron_legacy_tp2_ws2"
    ckpt = ckptkit.open(str(_run(item)))
    key = "decoder.layers.2.self_attention.linear_proj.bias"  # a row-parallel bias
    entry = ckpt.catalog.entries[f"model.{key}"]
    assert [(c.offsets, c.rank) for c in entry.chunks] == [((0,), 0), ((0,), 1)]
    rank1 = _rank_state(item, "mp_rank_01")["model"][key]
    assert torch.equal(ckpt.read(f"model.{key}", rank=1), rank1)


@pytest.mark.parametrize("zip_format", [True, False], ids=["crc32", "pre16-bytes"])
def test_differing_replicas_are_reported(zip_format, tmp_path):
    """Compared by the zip's CRC-32s, or (pre-1.6 files store none) by their bytes."""
    key = "decoder.final_layernorm.weight"

    def nudge(label: str, state: dict) -> bool:
        if label != "mp_rank_01":
            return False
        state["model"][key] = state["model"][key] + 1
        return True

    path = _edited("megatron_legacy_tp2_ws2", tmp_path, nudge, zip_format=zip_format)
    differ = r"1 copy of .* differs between the ranks holding it: model\.decoder\.final_layernorm\.weight "
    with pytest.warns(UserWarning, match=differ + r"\(mp_rank_00 vs mp_rank_01\)"):
        ckpt = ckptkit.open(str(path))
    rank0 = _rank_state("megatron_legacy_tp2_ws2", "mp_rank_00")["model"][key]
    assert torch.equal(ckpt.read(f"model.{key}"), rank0)
    assert torch.equal(ckpt.read(f"model.{key}", rank=1), rank0 + 1)


def test_pre16_rank_files_merge_and_replicas_compare_equal(tmp_path, recwarn):
    item = "megatron_legacy_swiglu_tp2_ws2"
    path = _edited(item, tmp_path, lambda label, state: False, zip_format=False)
    ckpt = ckptkit.open(str(path))
    assert not [
        w for w in recwarn if "differ" in str(w.message) or "not compared" in str(w.message)
    ]
    reference = _reference(item)
    bad = [key for key, spec in reference.items() if not _matches(ckpt.read(f"model.{key}"), spec)]
    assert not bad, bad


def test_distributed_optimizer_files_are_listed_as_skipped(tmp_path):
    path = _edited("megatron_legacy_tp2_ws2", tmp_path, lambda label, state: False)
    torch.save({"buckets_coalesced": True}, path / ITERATION / "mp_rank_01" / "distrib_optim.pt")
    ckpt = ckptkit.open(str(path))
    skipped = ckpt.catalog.facts.skipped_files
    assert list(skipped) == ["mp_rank_01/distrib_optim.pt"]
    assert "distributed optimizer" in skipped["mp_rank_01/distrib_optim.pt"]
    assert ckpt.catalog.files == ("mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt")


def test_args_holding_megatron_classes_still_merge(tmp_path):
    """Recent Megatron args hold its enums (``attention_backend``): kept as placeholders (never
    imported nor run), the shapes still come from the plain values."""

    def with_enum(label: str, state: dict) -> bool:
        enums = sys.modules["megatron.core.transformer.enums"]
        state["args"].attention_backend = enums.AttnBackend["auto"]
        return True

    path = _edited("megatron_legacy_tp2_ws2", tmp_path, with_enum)
    ckpt = ckptkit.open(str(path))
    args = ckpt.read_object("common.args")
    assert (args.hidden_size, args.num_query_groups) == (48, 2)
    assert args.attention_backend.global_name == "megatron.core.transformer.enums.AttnBackend"
    reference = _reference("megatron_legacy_tp2_ws2")
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert _matches(ckpt.read(f"model.{key}"), reference[key])
    same = ckptkit.diff(str(path), str(path), keys="common.*")  # args compared by attributes
    assert set(same["status"]) == {"equal"}, same[same["status"] != "equal"]


def test_run_state_is_per_rank():
    item = "megatron_legacy_tp2_pp2_ws4"
    ckpt = ckptkit.open(str(_run(item)))
    assert ckpt.read_object("common.args").hidden_size == 32
    assert [ckpt.read_object("common.args", rank=r).rank for r in range(4)] == [0, 1, 2, 3]
    assert ckpt.read_object("common.iteration") == 10
    state = _rank_state(item, "mp_rank_01_001")
    expected = state["optimizer"]["state"][3]["exp_avg"]
    assert torch.equal(ckpt.read("optimizer.mp_rank_01_001.state.3.exp_avg"), expected)
    rng = ckpt.read("rng_state.0.torch_rng_state", rank=3)
    assert torch.equal(rng, state["rng_state"][0]["torch_rng_state"])


# --------------------------------------------------------------------------------------------
# Refusals: copies re-saved by torch with one thing changed.


def _edited(
    item: str, tmp_path: Path, edit: Callable[[str, dict], bool], *, zip_format: bool = True
) -> Path:
    """A copy of ``item``'s run whose rank files ``edit(label, state)`` changed (re-saved
    when it returns True; in torch's pre-1.6 format without ``zip_format``)."""
    copy = tmp_path / item
    shutil.copytree(_run(item), copy)
    with _megatron_enums():
        for path in sorted((copy / ITERATION).glob("mp_rank_*/model_optim_rng.pt")):
            state = torch.load(path, weights_only=False)
            if edit(path.parent.name, state) or not zip_format:
                torch.save(state, path, _use_new_zipfile_serialization=zip_format)
    return copy


def _renamed(old: str, new: str) -> Callable[[str, dict], bool]:
    def edit(label: str, state: dict) -> bool:
        state["model"] = {(new if k == old else k): v for k, v in state["model"].items()}
        return True

    return edit


def _with_args(**changes) -> Callable[[str, dict], bool]:
    def edit(label: str, state: dict) -> bool:
        vars(state["args"]).update(changes)
        return True

    return edit


def _without(key: str, on: str) -> Callable[[str, dict], bool]:
    def edit(label: str, state: dict) -> bool:
        if label != on:
            return False
        del state["model"][key]
        return True

    return edit


REFUSALS = {
    "unknown-name": (
        "megatron_legacy_tp2_ws2",
        _renamed(
            "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc3.weight"
        ),
        "mp_rank_00",
        "model.decoder.layers.1.mlp.linear_fc3.weight",
        "no Megatron tensor-parallel rule",
    ),
    "ffn-size": (
        "megatron_legacy_tp2_ws2",
        _with_args(ffn_hidden_size=80),
        "mp_rank_00",
        "model.decoder.layers.0.mlp.linear_fc1.weight",
        r"has shape \[48, 48\] on TP rank 0, but args give \[40, 48\] per rank",
    ),
    "padded-vocab": (
        "megatron_legacy_tp2_ws2",
        _with_args(padded_vocab_size=192),
        "mp_rank_00",
        "model.embedding.word_embeddings.weight",
        r"args give \[96, 48\] per rank \(\[192, 48\] whole",
    ),
    "query-groups": (
        "megatron_legacy_tp2_ws2",
        _with_args(num_query_groups=6),
        "mp_rank_00",
        "model.decoder.layers.0.self_attention.linear_qkv.weight",
        r"\[144, 48\] whole",
    ),
    "swiglu-flag-off": (
        "megatron_legacy_swiglu_tp2_ws2",
        _with_args(swiglu=False),
        "mp_rank_00",
        "model.decoder.layers.0.mlp.linear_fc1.weight",
        r"has shape \[64, 32\] on TP rank 0, but args give \[32, 32\]",
    ),
    "missing-on-one-rank": (
        "megatron_legacy_tp2_ws2",
        _without("decoder.layers.2.mlp.linear_fc2.bias", "mp_rank_01"),
        "mp_rank_01",
        "model.decoder.layers.2.mlp.linear_fc2.bias",
        "is missing, but .*mp_rank_00/model_optim_rng.pt holds it",
    ),
    "layers-per-stage": (
        "megatron_legacy_tp2_pp2_ws4",
        _with_args(num_layers=6),
        "mp_rank_00_000",
        "model",
        r"pipeline stage 0 holds layers \[0, 1\], args say 3",
    ),
    "experts": (
        "megatron_legacy_tp2_ws2",
        _with_args(num_experts=8),
        "mp_rank_00",
        "args.num_experts",
        "a mixture of experts is not supported",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_naming_the_file_and_key(case, tmp_path, capsys):
    item, edit, label, key, message = REFUSALS[case]
    path = _edited(item, tmp_path, edit)
    with pytest.raises(MegatronLegacyError, match=message) as caught:
        ckptkit.open(str(path))
    assert caught.value.key == key
    assert caught.value.file == f"{label}/model_optim_rng.pt"
    assert str(path / ITERATION / caught.value.file) in str(caught.value)
    assert main(["inspect", str(path)]) == 2
    assert key in capsys.readouterr().err


def test_virtual_pipeline_chunks_are_refused(tmp_path):
    def split(label: str, state: dict) -> bool:
        state["model0"] = state.pop("model")
        return True

    path = _edited("megatron_legacy_tp2_ws2", tmp_path, split)
    with pytest.raises(MegatronLegacyError, match=r"model0: an interleaved \(virtual\) pipeline"):
        ckptkit.open(str(path))


def test_a_missing_rank_file_is_named(tmp_path):
    path = _edited("megatron_legacy_tp2_pp2_ws4", tmp_path, lambda label, state: False)
    shutil.rmtree(path / ITERATION / "mp_rank_01_001")
    with pytest.raises(
        CoverageError, match=r"mp_rank_01_001/model_optim_rng.pt: missing; args say TP=2 × PP=2"
    ):
        ckptkit.open(str(path))
    shutil.copytree(path / ITERATION / "mp_rank_01_000", path / ITERATION / "mp_rank_02_000")
    with pytest.raises(MegatronLegacyError, match="mp_rank_02_000: not a rank of this checkpoint"):
        ckptkit.open(str(path))


def test_without_args_the_ranks_are_not_merged(tmp_path):
    legacy = tmp_path / ITERATION / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(2)}, "iteration": 2}, legacy / "model_optim_rng.pt")
    assert ckptkit.detect(str(tmp_path / ITERATION)).format == "megatron_legacy"
    with pytest.raises(MegatronLegacyError, match="no 'args'"):
        ckptkit.open(str(tmp_path / ITERATION))
