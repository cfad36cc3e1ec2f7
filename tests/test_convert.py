"""unshard / convert / load_state_dict / from_checkpoint against torch-written checkpoints."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import ckptkit
from ckptkit.examples import TinyLM

from oracle import (
    assert_bit_equal,
    assert_same_structure,
    dcp_load_model,
    lookup,
    torch_unsharded,
)

STREAMED = ["single_process", "fsdp2_ws2", "fsdp2_ws4", "column_sharded", "empty_chunks", "zstd"]


@pytest.mark.parametrize("name", STREAMED)
def test_unshard_torch_equals_dcp_to_torch_save(written, name, tmp_path):
    source = written(name)
    expected = torch_unsharded(source.path, tmp_path)
    result = ckptkit.unshard(str(source.path), str(tmp_path / "out"), progress=False)
    assert sorted(f.name for f in result.files) == sorted(f"{group}.pt" for group in expected)
    for group, value in expected.items():
        for mmap in (False, True):
            loaded = torch.load(
                tmp_path / "out" / f"{group}.pt", weights_only=group != "train", mmap=mmap
            )
            assert_same_structure(loaded, value, group, ordered=True)
    assert not list((tmp_path / "out").glob(".ckptkit-tmp-*"))


def test_unshard_safetensors_format_source(written, tmp_path):
    """torch 2.13 cannot read its own SAFETENSORS-format DCP; ckptkit unshards it."""
    source = written("safetensors_format")
    reference = source.reference()
    ckptkit.unshard(str(source.path), str(tmp_path / "out"), groups="model", progress=False)
    loaded = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert_same_structure(loaded, reference["model"], "model", ordered=False)


def test_unshard_safetensors_output(written, tmp_path):
    source = written("fsdp2_ws2")
    reference = source.reference()
    result = ckptkit.unshard(
        str(source.path), str(tmp_path / "out"), to="safetensors", progress=False
    )
    names = {f.name for f in result.files}
    assert {
        "model.safetensors",
        "optim.safetensors",
        "optim.objects.pt",
        "train.objects.pt",
    } <= names
    model = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert model.keys() == reference["model"].keys()
    for key, tensor in reference["model"].items():
        assert_bit_equal(model[key], tensor, key)
    optim = safetensors.torch.load_file(tmp_path / "out" / "optim.safetensors")
    for key, tensor in optim.items():  # dotted keys relative to the group
        assert_bit_equal(tensor, lookup(reference["optim"], tuple(_split_optim_key(key))), key)
    side = torch.load(tmp_path / "out" / "optim.objects.pt", weights_only=True)
    assert side["param_groups"][0]["lr"] == pytest.approx(1e-3)
    train = torch.load(tmp_path / "out" / "train.objects.pt", weights_only=True)
    assert train["run_name"] == "sample" and train["step"] == 2


def _split_optim_key(key: str) -> list:
    """``state.blocks.0.fc1.weight.exp_avg`` → ["state", "blocks.0.fc1.weight", "exp_avg"]."""
    head, rest = key.split(".", 1)
    fqn, leaf = rest.rsplit(".", 1)
    return [head, fqn, leaf]


def test_safetensors_shards_dtype_and_filters(written, tmp_path):
    source = written("fsdp2_ws2")
    reference = source.reference()["model"]
    result = ckptkit.unshard(
        str(source.path),
        str(tmp_path / "out"),
        to="safetensors",
        groups=["model"],
        keys=["model.blocks.*", "model.odd", "model.num_updates"],
        dtype="bfloat16",
        max_shard_size="40KB",
        progress=False,
    )
    shards = sorted(f.name for f in result.files if f.name.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in shards:
        loaded.update(safetensors.torch.load_file(tmp_path / "out" / shard))
    assert set(index["weight_map"]) == set(loaded)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values()
    )
    expected_keys = {k for k in reference if k.startswith("blocks.")} | {"odd", "num_updates"}
    assert set(loaded) == expected_keys
    assert loaded["odd"].dtype == torch.bfloat16
    assert_bit_equal(loaded["odd"], reference["odd"].to(torch.bfloat16), "odd")
    assert loaded["num_updates"].dtype == torch.int64  # only floating tensors are cast


def test_outputs_are_all_or_nothing(written, tmp_path, monkeypatch):
    source = written("fsdp2_ws2")
    out = tmp_path / "out"
    calls = {"n": 0}
    original = ckptkit.reading.Reader.iter_checked

    def failing(self, entry):
        calls["n"] += 1
        if calls["n"] == 20:
            raise ckptkit.CorruptRecordError("injected failure")
        yield from original(self, entry)

    monkeypatch.setattr(ckptkit.reading.Reader, "iter_checked", failing)
    with pytest.raises(ckptkit.CorruptRecordError, match="injected"):
        ckptkit.unshard(str(source.path), str(out), progress=False)
    assert not out.exists()  # no final names, no staging, not even the folder made for them
    monkeypatch.undo()

    ckptkit.unshard(str(source.path), str(out), groups="model", progress=False)
    before = (out / "model.pt").read_bytes()
    with pytest.raises(FileExistsError):
        ckptkit.unshard(str(source.path), str(out), groups="model", progress=False)
    assert (out / "model.pt").read_bytes() == before
    # with overwrite, a different output (bfloat16) replaces it, and nothing else is left
    ckptkit.unshard(
        str(source.path), str(out), groups="model", dtype="bfloat16", overwrite=True, progress=False
    )
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]
    replaced = torch.load(out / "model.pt", weights_only=True)
    reference = source.reference()["model"]
    assert replaced.keys() == reference.keys()
    for key, tensor in reference.items():
        cast = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert_bit_equal(replaced[key], cast, key)


def test_ctrl_c_leaves_nothing_behind(written, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of ``ckptkit unshard``: one line, status 130, no output and no
    folder made for it; a folder that existed before keeps exactly what it held."""
    from ckptkit.cli import main

    source = written("fsdp2_ws2")
    original = ckptkit.reading.Reader.iter_checked
    calls = {"n": 0}

    def interrupted(self, entry):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        yield from original(self, entry)

    monkeypatch.setattr(ckptkit.reading.Reader, "iter_checked", interrupted)
    fresh = tmp_path / "new" / "out"
    assert main(["unshard", str(source.path), str(fresh), "--quiet"]) == 130
    assert capsys.readouterr().err == "ckptkit: interrupted\n"
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    calls["n"] = 0
    assert main(["unshard", str(source.path), str(kept), "--quiet"]) == 130
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_one_folder_holds_one_checkpoint(written, tmp_path):
    """A second unshard in another format (or sharding) into the same folder is refused
    before anything is written, overwrite or not: a reader could only choose between the two
    silently."""
    source = written("fsdp2_ws2")
    dst = tmp_path / "out"
    ckptkit.unshard(str(source.path), str(dst), to="safetensors", progress=False)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    for overwrite in (False, True):
        with pytest.raises(ckptkit.OutputExistsError, match=r"already holds model\.safetensors"):
            ckptkit.unshard(str(source.path), str(dst), overwrite=overwrite, progress=False)
    with pytest.raises(ckptkit.OutputExistsError, match="another format or sharding"):
        ckptkit.unshard(str(source.path), str(dst), to="safetensors", max_shard_size="64KB",
                        groups="model", overwrite=True, progress=False)  # fmt: skip
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    # the same output again replaces itself: same names, same bytes
    ckptkit.unshard(str(source.path), str(dst), to="safetensors", overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_load_state_dict_and_from_checkpoint(written):
    source = written("fsdp2_ws2")
    reference = source.reference()
    state = ckptkit.load_state_dict(str(source.path), groups=["model", "train"])
    assert set(state) == {"model", "train"}
    assert_same_structure(state["model"], reference["model"], "model", ordered=False)
    assert state["train"]["losses"] == reference["train"]["losses"]

    module = TinyLM()
    result = ckptkit.from_checkpoint(module, str(source.path))
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, tensor in module.state_dict().items():
        assert_bit_equal(tensor, reference["model"][key], key)

    smaller = torch.nn.Linear(3, 3)
    with pytest.raises(ckptkit.FormatError, match="missing weight"):
        ckptkit.from_checkpoint(smaller, str(source.path))
    lenient = ckptkit.from_checkpoint(
        TinyLM(), str(source.path), prefix="model.blocks.0.", strict=False
    )
    assert "embed.weight" in lenient.missing_keys


def test_convert_to_dcp_is_read_by_torch_at_two_ranks(written, tmp_path):
    source = written("fsdp2_ws4")
    ckptkit.convert(
        str(source.path), str(tmp_path / "dcp"), to="dcp", groups="model", progress=False
    )
    ours = ckptkit.open(str(tmp_path / "dcp"))
    original = ckptkit.open(str(source.path))
    assert ours.keys() == [k for k in original if k.startswith("model.")]
    for key in ours:
        assert_bit_equal(ours.read(key), original.read(key), key)
    # chunk boxes survive: records were copied byte for byte
    assert ours.tensors.set_index("key").loc["model.odd", "n_chunks"] == 4
    for world_size in (1, 2):
        outcome = dcp_load_model(tmp_path / "dcp", world_size, source.reference_path, tmp_path)
        assert outcome["mismatched"] == [] and outcome["keys"] == len(ours.tensors)


def test_convert_unsharded_output_back_to_dcp(written, tmp_path):
    source = written("fsdp2_ws2")
    ckptkit.unshard(
        str(source.path), str(tmp_path / "st"), to="safetensors", groups="model", progress=False
    )
    ckptkit.convert(
        str(tmp_path / "st" / "model.safetensors"), str(tmp_path / "dcp"), to="dcp", progress=False
    )
    back = torch_unsharded(tmp_path / "dcp", tmp_path)["model"]  # keys sit under the file's stem
    reference = source.reference()["model"]
    assert set(back) == set(reference)
    for key, tensor in reference.items():
        assert_bit_equal(back[key], tensor, key)
