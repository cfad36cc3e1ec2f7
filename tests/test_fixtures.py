"""Checkpoints written by torch 2.2, OLMo and OLMo-core (copied from the shared fixture set)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit

from oracle import (
    assert_catalog_matches_torch,
    assert_matches_sha256,
    assert_reads_match,
    torch_keys,
    torch_unsharded,
)

FIXTURES = Path(__file__).parent / "fixtures"


def test_torch22_fsdp1_metadata_and_tensors(tmp_path):
    path = FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint"
    ckpt = ckptkit.open(str(path))
    assert ckpt.format == "dcp"
    assert ckpt.catalog.facts.version is None  # pre-2.4: no version, no storage_meta
    assert_catalog_matches_torch(ckpt, path)
    assert (
        assert_matches_sha256(
            ckpt, FIXTURES / "dcp_torch22_fsdp1_ws2" / "reference" / "tensors.sha256.json"
        )
        == len(ckpt.tensors)  # every tensor of the catalog, which is torch's (checked above)
    )
    # pre-2.4 flattening: the whole param_groups list is one object entry
    groups = ckpt.read_object("optim.param_groups")
    assert isinstance(groups, list) and groups[0]["betas"] == (0.85, 0.97)
    assert ckpt.read_object("train.mean_losses") == pytest.approx(
        [5.0455, 5.1044, 4.8877], abs=1e-4
    )
    tensors = ckpt.tensors.set_index("key")
    assert tensors.loc["model.odd", "shape"] == (29, 11)
    assert tensors.loc["model.odd", "sharded_dims"] == (0,)
    assert tensors.loc["model.num_updates", "dtype"] == "int64"
    assert tensors.loc["model.adapter.down.weight", "dtype"] == "bfloat16"
    odd = ckpt.chunks[ckpt.chunks["key"] == "model.odd"].sort_values("rank")
    assert odd["sizes"].tolist() == [(15, 11), (14, 11)] and odd["rank"].tolist() == [0, 1]


def test_olmo_torch_new_model_and_optim_is_plain_dcp(tmp_path):
    # the whole step directory (DCP + train/ + config) is tested in test_formats_legacy.py
    step = FIXTURES / "olmo_torch_new_ws2" / "step3"
    ckpt = ckptkit.open(str(step / "model_and_optim"))
    assert ckpt.format == "dcp" and ckpt.url.endswith("step3/model_and_optim")
    assert ckpt.catalog.facts.version == "1.0.0"
    assert ckpt.catalog.facts.checkpoint_id.endswith(
        "step3-tmp/model_and_optim"
    )  # a PosixPath, as str
    assert_catalog_matches_torch(ckpt, step / "model_and_optim")
    n_tensors = len(torch_keys(step / "model_and_optim", tensors_only=True))
    assert (
        assert_reads_match(ckpt, torch_unsharded(step / "model_and_optim", tmp_path)) == n_tensors
    )
    assert ckpt.read_object("optim.param_groups.0.lr") == 0.003


def test_olmo_core_storage_info_class(tmp_path):
    step = FIXTURES / "olmo_core3_trainer_ws2" / "step3"
    ckpt = ckptkit.open(str(step / "model_and_optim"))
    distcp = sorted(p.name for p in (step / "model_and_optim").glob("*.distcp"))
    assert sorted(ckpt.catalog.files) == distcp
    assert (
        assert_matches_sha256(
            ckpt, FIXTURES / "olmo_core3_trainer_ws2" / "reference" / "tensors.sha256.json"
        )
        == len(ckpt.tensors)  # every tensor of the catalog (torch needs olmo_core to read it)
    )
    assert ckpt.read_object("optim.param_groups.embeddings.weight.betas") == (0.9, 0.97)
    files = ckpt.files.set_index("file")
    assert files["size"].sum() == sum(
        p.stat().st_size for p in (step / "model_and_optim").glob("*.distcp")
    )
    assert torch.is_tensor(ckpt.read("model.embeddings.weight"))
