"""DCP checkpoints written by torch itself: the catalog equals torch's metadata, reads are bit-exact."""

from __future__ import annotations

import pickle

import pytest

import ckptkit
from ckptkit.units import human_bytes

from oracle import (
    assert_bit_equal,
    assert_catalog_matches_torch,
    assert_reads_match,
    lookup,
    torch_unsharded,
)
from writers import VARIANTS


@pytest.mark.parametrize("name", [name for name, (_, _, readable) in VARIANTS.items() if readable])
def test_catalog_and_reads_match_torch(written, name, tmp_path):
    ckpt_dir = written(name)
    ckpt = ckptkit.open(str(ckpt_dir.path))
    assert ckpt.format == "dcp"
    assert_catalog_matches_torch(ckpt, ckpt_dir.path)
    n = assert_reads_match(ckpt, torch_unsharded(ckpt_dir.path, tmp_path))
    assert n == len(ckpt.tensors) > 0
    # and against the state the job held in memory (torch's converter is not ground truth)
    assert_reads_match(ckpt, ckpt_dir.reference())


def test_objects_decode_like_torch(written, tmp_path):
    ckpt_dir = written("fsdp2_ws2")
    ckpt = ckptkit.open(str(ckpt_dir.path))
    expected = torch_unsharded(ckpt_dir.path, tmp_path)
    objects = ckpt.catalog.objects()
    assert {e.key for e in objects} >= {"train.step", "train.losses", "optim.param_groups.0.lr"}
    for entry in objects:
        assert ckpt.read_object(entry.key) == lookup(expected, entry.path), entry.key
    previews = ckpt.objects.set_index("key")["preview"]
    assert previews["train.run_name"] == "'sample'"
    assert previews["optim.param_groups.0.lr"] == "0.001"


def test_tables_describe_fsdp2_sharding(written):
    ckpt = ckptkit.open(str(written("fsdp2_ws4").path))
    tensors = ckpt.tensors.set_index("key")
    odd = tensors.loc["model.odd"]
    assert (odd["dtype"], odd["shape"], odd["n_chunks"], odd["sharded_dims"]) == (
        "float32",
        (37, 19),
        4,
        (0,),
    )
    assert tensors.loc["model.adapter.down.weight", "dtype"] == "bfloat16"
    assert (
        tensors.loc["model.num_updates", "shape"] == ()
        and tensors.loc["model.num_updates", "dtype"] == "int64"
    )
    chunks = ckpt.chunks[ckpt.chunks["key"] == "model.odd"].sort_values("rank")
    assert chunks["sizes"].tolist() == [(10, 19), (10, 19), (10, 19), (7, 19)]  # torch.chunk rule
    assert chunks["rank"].tolist() == [0, 1, 2, 3]
    files = ckpt.files
    assert sorted(files["rank"]) == [0, 1, 2, 3]
    on_disk = {p.name: p.stat().st_size for p in written("fsdp2_ws4").path.glob("*.distcp")}
    assert dict(zip(files["file"], files["size"], strict=True)) == on_disk
    assert (
        files["tensor_bytes"] + files["object_bytes"] + files["overhead_bytes"] == files["size"]
    ).all()
    summary = ckpt.summary()
    assert summary.parameters == int(tensors.loc[tensors["group"] == "model", "numel"].sum())
    assert set(summary.by_group.index) == {"model", "optim", "train"}
    assert summary.by_rank["size"].sum() == sum(on_disk.values())
    assert summary.ranked and summary.by_group["nbytes"].dtype == "int64"  # raw for arithmetic
    model_bytes = human_bytes(summary.by_group.loc["model", "nbytes"])
    assert f"<td>{model_bytes}</td>" in summary._repr_html_()  # human units where people read


def test_column_sharded_chunks(written):
    ckpt = ckptkit.open(str(written("column_sharded").path))
    tensors = ckpt.tensors.set_index("key")
    assert tensors.loc["model.uneven", "sharded_dims"] == (1,)
    assert tensors.loc["model.replicated", "n_chunks"] == 1
    sizes = ckpt.chunks[ckpt.chunks["key"] == "model.uneven"].sort_values("rank")["sizes"].tolist()
    assert sizes == [(16, 19), (16, 18)]


def test_empty_chunks_are_listed_and_read(written):
    ckpt = ckptkit.open(str(written("empty_chunks").path))
    few = ckpt.chunks[ckpt.chunks["key"] == "model.few_rows"]
    assert sorted(few["numel"]) == [0, 5, 5, 5]
    assert_bit_equal(
        ckpt.read("model.few_rows"),
        written("empty_chunks").reference()["model"]["few_rows"],
        "few_rows",
    )


def test_non_row_major_records_use_their_own_strides(written):
    ckpt_dir = written("single_process")
    ckpt = ckptkit.open(str(ckpt_dir.path))
    reference = ckpt_dir.reference()["model"]
    for key in ("transposed", "channels_last", "empty", "scalar", "bool", "float16", "bfloat16"):
        assert_bit_equal(ckpt.read(f"model.{key}"), reference[key], key)
    value = ckpt.read_object("train.tensor_tuple")
    assert isinstance(value, tuple) and value[1] == 5
    assert_bit_equal(value[0], ckpt_dir.reference()["train"]["tensor_tuple"][0], "tuple tensor")


def test_rank_local_metadata_is_unioned_with_ranks(written):
    import torch  # noqa: F401  (torch's classes unpickle the trusted oracle's view)

    ckpt_dir = written("no_collectives")
    assert not (ckpt_dir.path / ".metadata").exists()
    ckpt = ckptkit.open(str(ckpt_dir.path))
    assert ckpt.catalog.facts.metadata_files == ("__0.metadata", "__1.metadata")
    per_rank = {}
    for rank in (0, 1):
        with open(ckpt_dir.path / f"__{rank}.metadata", "rb") as f:
            per_rank[rank] = pickle.load(f)  # noqa: S301 - torch-written in this test
    for key in ckpt:
        entry = ckpt.entry(key)
        expected = sorted(
            (rank, tuple(c.offsets), tuple(c.sizes))
            for rank, md in per_rank.items()
            if key in md.state_dict_metadata and hasattr(md.state_dict_metadata[key], "chunks")
            for c in md.state_dict_metadata[key].chunks
        )
        if entry.kind == "tensor":
            assert sorted((c.rank, c.offsets, c.sizes) for c in entry.chunks) == expected, key
    # a replicated buffer is stored by both ranks: two chunk rows, one box
    temperature = ckpt.chunks[ckpt.chunks["key"] == "model.temperature"]
    assert sorted(temperature["rank"]) == [0, 1]
    assert ckpt.tensors.set_index("key").loc["model.temperature", "n_chunks"] == 1
    assert assert_reads_match(ckpt, ckpt_dir.reference()) == len(ckpt.tensors)


def test_safetensors_serialization_format(written):
    ckpt_dir = written("safetensors_format")
    ckpt = ckptkit.open(str(ckpt_dir.path))
    assert set(ckpt.chunks["encoding"]) == {"safetensors"}
    assert assert_reads_match(ckpt, ckpt_dir.reference()) == len(ckpt.tensors)
    assert ckpt.read_object("train.run_name") == "sample"
