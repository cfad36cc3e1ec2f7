"""diff / compare_sizes / their CLI on checkpoints torch wrote; torch computes the expected numbers."""

from __future__ import annotations

import importlib
import json
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import ckptkit
from ckptkit.cli import main
from ckptkit.examples import _spawn

from isolated import run_script

DIFF = importlib.import_module("ckptkit.diff")  # the module (``ckptkit.diff`` is the function)

# keys of the mutant copy (model group of fsdp2_ws2's reference, relative to "model")
PERTURBED = "blocks.1.fc1.weight"  # one element + 0.25
CLOSE = "blocks.0.qkv.weight"  # × (1 + 2e-6): inside rtol=1e-5
REMOVED = "ln_f.bias"
ADDED = "extra.weight"
RECAST = "odd"  # float32 → bfloat16
RESHAPED = "adapter.up.bias"  # (48,) → (40,)


class Marker:
    """An object only the test knows: ckptkit must keep it as a placeholder, never import it."""

    def __init__(self, value: int) -> None:
        self.value = value


def _mutant_state(reference: dict) -> dict:
    model = {k: v.clone() for k, v in reference["model"].items()}
    model[PERTURBED][3, 5] += 0.25
    model[CLOSE] = model[CLOSE] * (1 + 2e-6)
    del model[REMOVED]
    model[ADDED] = torch.ones(3, 4)
    model[RECAST] = model[RECAST].to(torch.bfloat16)
    model[RESHAPED] = model[RESHAPED][:40].clone()
    train = dict(reference["train"], step=99)
    return {"model": model, "train": train}


@pytest.fixture(scope="module")
def ws2(written):
    return written("fsdp2_ws2")


@pytest.fixture(scope="module")
def mutant(ws2, tmp_path_factory):
    """A single-process ``dcp.save`` of ws2's reference state with one change of each kind."""
    path = tmp_path_factory.mktemp("mutant") / "ckpt"
    dcp.save(_mutant_state(ws2.reference()), storage_writer=FileSystemWriter(path))
    return path


def _resave_rank(rank: int, world_size: int, reference_path: str, path: str) -> None:
    """Rank body: the reference model re-saved from ``world_size`` ranks, 2-D tensors split by
    columns where they divide (Shard(1)), the rest by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = torch.load(reference_path, weights_only=False)["model"]

    def placement(t: torch.Tensor) -> Shard:
        return Shard(1) if t.ndim == 2 and t.shape[1] % world_size == 0 else Shard(0)

    state = {
        k: distribute_tensor(v, mesh, [placement(v)]) if v.ndim else v for k, v in model.items()
    }
    dcp.save({"model": state}, storage_writer=FileSystemWriter(path))


@pytest.fixture(scope="module")
def ws4_resave(ws2, tmp_path_factory):
    path = tmp_path_factory.mktemp("resave") / "ws4"
    _spawn(_resave_rank, 4, str(ws2.reference_path), str(path))
    return path


@pytest.fixture(scope="module")
def unsharded(ws2, tmp_path_factory):
    """ws2 unsharded by ckptkit to safetensors and to torch.save."""
    root = tmp_path_factory.mktemp("unsharded")
    ckptkit.unshard(str(ws2.path), str(root / "st"), to="safetensors", progress=False)
    ckptkit.unshard(str(ws2.path), str(root / "pt"), progress=False)
    return root


def _statuses(frame) -> dict[str, str]:
    return dict(zip(frame["key"], frame["status"], strict=True))


# -- diff ---------------------------------------------------------------------------------


def test_identical_sources_all_equal(ws2):
    ckpt = ckptkit.open(str(ws2.path))
    frame = ckptkit.diff(ckpt, str(ws2.path))
    assert len(frame) == len(ckpt) == 150
    assert set(frame["status"]) == {"equal"}
    assert frame["key"].tolist() == ckpt.keys()
    tensors = frame[frame["dtype"].notna()]
    assert len(tensors) == len(ckpt.catalog.tensors())
    assert (tensors[["max_abs", "mean_abs", "rel_l2", "frac_outside"]] == 0).all().all()
    assert (tensors["cosine"] == 1).all()


def test_mutant_detects_each_change_with_torch_numbers(ws2, mutant):
    reference = ws2.reference()["model"]
    frame = ckptkit.diff(str(ws2.path), str(mutant), keys=["model.*", "train.*"])
    statuses = _statuses(frame)
    expected = {
        f"model.{PERTURBED}": "different",
        f"model.{CLOSE}": "close",
        f"model.{REMOVED}": "only_a",
        f"model.{ADDED}": "only_b",
        f"model.{RECAST}": "dtype_changed",
        f"model.{RESHAPED}": "shape_changed",
        "train.step": "object_changed",
    }
    for key, status in statuses.items():
        assert status == expected.get(key, "equal"), key
    assert set(expected) <= set(statuses)
    rows = frame.set_index("key")
    state = _mutant_state(ws2.reference())["model"]

    for name in (PERTURBED, CLOSE, RECAST):
        a, b = reference[name].double(), state[name].double()
        row = rows.loc[f"model.{name}"]
        assert row["max_abs"] == pytest.approx((a - b).abs().max().item(), rel=1e-12)
        assert row["mean_abs"] == pytest.approx((a - b).abs().mean().item(), rel=1e-9)
        assert row["rel_l2"] == pytest.approx(((a - b).norm() / a.norm()).item(), rel=1e-9)
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert row["cosine"] == pytest.approx(cosine.item(), rel=1e-12)
        outside = ~torch.isclose(a, b, rtol=1e-5, atol=1e-8)
        assert row["frac_outside"] == pytest.approx(outside.double().mean().item(), rel=1e-12)
    perturbed = rows.loc[f"model.{PERTURBED}"]
    assert perturbed["frac_outside"] == 1 / reference[PERTURBED].numel()
    assert rows.loc[f"model.{CLOSE}", "frac_outside"] == 0
    assert rows.loc[f"model.{RECAST}", "note"] == "dtype float32 → bfloat16"
    assert rows.loc[f"model.{RESHAPED}", "note"] == "shape (48,) → (40,)"
    assert rows.loc["train.step", "note"] == "2 → 99"
    assert rows.loc[f"model.{ADDED}", "key_b"] == f"model.{ADDED}"
    assert rows.loc[f"model.{ADDED}", "shape"] == (3, 4)


def test_zero_tolerance_turns_close_into_different(ws2, mutant):
    frame = ckptkit.diff(str(ws2.path), str(mutant), keys=f"model.{CLOSE}", rtol=0, atol=0)
    assert _statuses(frame) == {f"model.{CLOSE}": "different"}
    assert frame["frac_outside"].iloc[0] > 0.5


def test_small_blocks_give_the_same_answer(ws2, mutant, monkeypatch):
    """Blocks of 7 elements: leading identical blocks of the perturbed tensor are re-read for
    its norm; every number equals the one-block result."""
    whole = ckptkit.diff(str(ws2.path), str(mutant), keys="model.*")
    monkeypatch.setattr(DIFF, "BLOCK_ELEMENTS", 7)
    blocked = ckptkit.diff(str(ws2.path), str(mutant), keys="model.*")
    assert blocked["status"].tolist() == whole["status"].tolist()
    for column in ("max_abs", "mean_abs", "rel_l2", "cosine", "frac_outside"):
        assert blocked[column].to_numpy() == pytest.approx(
            whole[column].to_numpy(), rel=1e-12, nan_ok=True
        ), column


def test_cross_format_equal(ws2, unsharded, ws4_resave):
    """DCP ws=2 (row shards) vs its safetensors and torch.save unshards vs a ws=4 resave of the
    same weights with column shards: every key equal, whatever the chunking on either side."""
    st, pt = str(unsharded / "st"), str(unsharded / "pt")
    ws4 = ckptkit.open(str(ws4_resave))
    assert ws4.entry("model.embed.weight").n_chunks == 4
    assert ws4.tensors.set_index("key").loc["model.embed.weight", "sharded_dims"] == (1,)
    for a, b, keys in [
        (str(ws2.path), st, None),
        (str(ws2.path), pt, None),
        (st, pt, None),
        (str(ws2.path), ws4, "model.*"),
        (st, ws4, "model.*"),
        (str(ws2.path), f"{st}/model.safetensors", "model.*"),
    ]:
        frame = ckptkit.diff(a, b, keys=keys)
        assert set(frame["status"]) == {"equal"}, (a, b)
        assert len(frame) == (150 if keys is None else 35)


def test_key_map_prefix_and_fsdp_wrappers(ws2, tmp_path):
    """A torch.save file of the reference: its keys sit under the file stem; an FSDP1-style
    copy adds ``_fsdp_wrapped_module.`` segments. key_map and wrapper stripping line them up."""
    reference = ws2.reference()
    torch.save(reference, tmp_path / "full.pt")
    full = str(tmp_path / "full.pt")
    assert set(ckptkit.diff(str(ws2.path), full)["status"]) == {"only_a", "only_b"}
    for key_map in ({"full.": ""}, lambda key: key.removeprefix("full.")):
        frame = ckptkit.diff(str(ws2.path), full, key_map=key_map)
        assert len(frame) == 150 and set(frame["status"]) == {"equal"}
        assert (frame["key_b"] == "full." + frame["key"]).all()

    wrapped = {
        "_fsdp_wrapped_module." + key.replace("blocks.0.", "blocks.0._fsdp_wrapped_module."): value
        for key, value in reference["model"].items()
    }
    torch.save(wrapped, tmp_path / "module.pt")
    module = str(tmp_path / "module.pt")
    frame = ckptkit.diff(str(ws2.path), module, keys="model.*", key_map={"module.": "model."})
    assert len(frame) == 35 and set(frame["status"]) == {"equal"}
    row = frame.set_index("key").loc["model.blocks.0.qkv.weight"]
    assert row["key_b"] == "module._fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.qkv.weight"

    with pytest.raises(ValueError, match="both map to"):
        ckptkit.diff(str(ws2.path), full, key_map=lambda key: "same")


def test_opaque_objects_compare_by_name_and_state(tmp_path):
    """Objects of a class ckptkit never imports come back as placeholders; equal placeholders
    compare equal, a changed attribute is object_changed."""
    for name, value in (("a", 1), ("b", 1), ("c", 2)):
        torch.save(
            {"marker": Marker(value), "step": 3, "w": torch.arange(4.0)}, tmp_path / f"{name}.pt"
        )
    same = ckptkit.diff(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), key_map={"b.": "a."})
    assert _statuses(same) == {"a.marker": "equal", "a.step": "equal", "a.w": "equal"}
    changed = ckptkit.diff(str(tmp_path / "a.pt"), str(tmp_path / "c.pt"), key_map={"c.": "a."})
    assert _statuses(changed)["a.marker"] == "object_changed"
    assert "test_diff.Marker" in changed.set_index("key").loc["a.marker", "note"]


# -- compare_sizes ------------------------------------------------------------------------


def _file_sizes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def test_compare_sizes_matches_files_on_disk(ws2, unsharded):
    reference = ws2.reference()
    st = unsharded / "st"
    frame = ckptkit.compare_sizes(
        str(ws2.path), str(unsharded / "pt"), str(st), str(st / "model.safetensors")
    )
    assert frame.index.tolist() == ["ckpt", "pt", "st", "model.safetensors"]
    assert frame["format"].tolist() == ["dcp", "torch_save", "safetensors", "safetensors"]
    for label, path in [("ckpt", ws2.path), ("pt", unsharded / "pt"), ("st", st)]:
        row = frame.loc[label]
        assert row["size"] == _file_sizes(path), label
        assert row["files"] == len(list(path.iterdir())), label
        assert row["tensor_bytes"] == _tensor_bytes(reference), label
        assert row["model"] == _tensor_bytes(reference["model"]), label  # buffers are tensors
        parts = ["model", "optimizer", "trainer", "other", "overhead_bytes", "metadata_bytes"]
        assert row[parts].sum() == row["size"], label
        assert row[["float32", "bfloat16", "int64"]].sum() == row["tensor_bytes"], label
    assert frame.loc["ckpt", "metadata_bytes"] == (ws2.path / ".metadata").stat().st_size
    assert frame.loc["ckpt", "trainer"] > 0 and frame.loc["st", "other"] == 0
    assert frame.loc["ckpt", "ratio"] == 1.0
    assert frame.loc["pt", "ratio"] == pytest.approx(
        frame.loc["pt", "size"] / frame.loc["ckpt", "size"]
    )
    # safetensors framing is the 8-byte length plus the JSON header, nothing else
    model = frame.loc["model.safetensors"]
    (header,) = struct.unpack("<Q", (st / "model.safetensors").read_bytes()[:8])
    assert model["overhead_bytes"] == 8 + header
    assert model["size"] == (st / "model.safetensors").stat().st_size
    assert model["optimizer"] == 0 and model["records"] == 35
    # one zip record per tensor chunk in DCP: more framing than in the unsharded files
    assert frame.loc["ckpt", "overhead_bytes"] > 10 * frame.loc["st", "overhead_bytes"]


def test_compare_sizes_labels_and_categories(ws2):
    frame = ckptkit.compare_sizes(str(ws2.path), labels=["run"], categories={"train": "other"})
    assert frame.index.tolist() == ["run"]
    assert frame.loc["run", "trainer"] == 0 and frame.loc["run", "other"] > 0
    with pytest.raises(ValueError):
        ckptkit.compare_sizes(str(ws2.path), labels=["a", "b"])


# -- CLI ----------------------------------------------------------------------------------


def test_cli_diff_exit_codes_and_json(ws2, mutant, unsharded, tmp_path, capsys):
    st = str(unsharded / "st")
    assert main(["diff", str(ws2.path), st, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "150 equal -> equal within tolerance" in out

    assert (
        main(["diff", str(ws2.path), str(mutant), "--keys", "model.*", "train.*", "--quiet"]) == 1
    )
    out = capsys.readouterr().out
    assert f"model.{PERTURBED}" in out and "DIFFERENT" in out
    assert f"model.{CLOSE}" in out  # close keys are listed, only equal ones are not
    assert "model.embed.weight" not in out

    assert main(["diff", str(ws2.path), str(mutant), "--keys", f"model.{CLOSE}", "--quiet"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "diff",
                str(ws2.path),
                str(mutant),
                "--keys",
                f"model.{CLOSE}",
                "--rtol",
                "0",
                "--atol",
                "0",
                "--quiet",
            ]
        )
        == 1
    )
    capsys.readouterr()

    assert main(["diff", str(ws2.path), str(mutant), "--keys", "model.*", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["same"] is False and document["rtol"] == 1e-5
    rows = {row["key"]: row for row in document["keys"]}
    assert rows[f"model.{PERTURBED}"]["status"] == "different"
    assert rows[f"model.{PERTURBED}"]["max_abs"] == pytest.approx(0.25, rel=1e-6)
    assert rows[f"model.{REMOVED}"]["max_abs"] is None
    assert rows[f"model.{ADDED}"]["shape"] == [3, 4]
    assert document["counts"]["equal"] == 30 and sum(document["counts"].values()) == len(rows) == 36

    assert main(["diff", str(ws2.path), str(tmp_path / "missing"), "--quiet"]) == 2
    assert "ckptkit: error:" in capsys.readouterr().err
    assert main(["diff", str(ws2.path), st, "--key-map", "nonsense", "--quiet"]) == 2
    assert main(["diff", str(ws2.path), st, "--keys", "modle.*", "--quiet"]) == 2
    assert "no key matches" in capsys.readouterr().err


def test_cli_sizes(ws2, unsharded, capsys):
    paths = [str(ws2.path), str(unsharded / "st")]
    assert main(["sizes", *paths, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    frame = ckptkit.compare_sizes(*paths)
    assert [row["size"] for row in document["checkpoints"]] == frame["size"].tolist()
    assert [row["label"] for row in document["checkpoints"]] == ["ckpt", "st"]
    assert main(["sizes", *paths, "--labels", "dcp", "safetensors"]) == 0
    out = capsys.readouterr().out
    assert "overhead_bytes" in out and "1.000x" in out
    assert out.splitlines()[0].split() == ["checkpoint", "dcp", "safetensors"]


# -- plots --------------------------------------------------------------------------------


def test_plots_draw_what_the_frames_say(ws2, mutant, unsharded):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ckptkit import plots

    frame = ckptkit.diff(str(ws2.path), str(mutant), keys="model.*")
    ax = plots.plot_diff(frame)
    widths = [patch.get_width() for patch in ax.patches]
    nonzero = frame["rel_l2"][frame["rel_l2"] > 0].sort_values(ascending=False)
    assert widths == pytest.approx(nonzero.tolist()) and len(widths) == 3
    assert ax.get_xscale() == "log"

    by_layer = plots.diff_by_layer(frame)
    rel = frame.set_index("key")["rel_l2"]
    assert by_layer["blocks.1"] == rel[f"model.{PERTURBED}"]
    assert by_layer["blocks.0"] == rel[f"model.{CLOSE}"]
    assert by_layer["embed"] == 0
    layers = by_layer.index.tolist()
    assert layers.index("blocks.0") + 1 == layers.index("blocks.1")
    ax = plots.plot_diff_by_layer(frame)
    assert [p.get_height() for p in ax.patches] == by_layer.tolist()

    ax = plots.plot_diff_histogram(str(ws2.path), str(mutant), f"model.{PERTURBED}")
    (stairs,) = ax.patches
    numel = frame.set_index("key").loc[f"model.{PERTURBED}", "numel"]
    assert stairs.get_data().values.sum() == numel
    assert f"{(numel - 1) / numel:.1%} exactly equal" in ax.get_title()

    sizes = ckptkit.compare_sizes(str(ws2.path), str(unsharded / "st"))
    ax = plots.plot_sizes(sizes)
    bars: dict[int, float] = {}
    for patch in ax.patches:
        row = round(patch.get_y() + patch.get_height() / 2)
        bars[row] = bars.get(row, 0) + patch.get_width()
    assert bars[0] * 1e3 == pytest.approx(sizes["size"].iloc[0])  # kB axis
    assert bars[1] * 1e3 == pytest.approx(sizes["size"].iloc[1])
    plots.plot_sizes(sizes, by="dtype")
    plt.close("all")


TORCH_FREE = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

a, *others = sys.argv[1:]
frame = ckptkit.diff(a, a)
assert set(frame["status"]) == {"equal"} and len(frame) == len(ckptkit.open(a)), frame
assert "bfloat16" in set(frame["dtype"])
sizes = ckptkit.compare_sizes(a, *others)
assert (sizes["tensor_bytes"] > 0).all() and sizes["ratio"].iloc[0] == 1
print("torch-free ok", len(frame))
"""


def test_diff_and_sizes_need_no_torch():
    """Real fixtures (torch 2.2 FSDP1 with bf16 tensors, OLMo, OLMo-core) with torch blocked."""
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures"
    paths = [
        fixtures / "dcp_torch22_fsdp1_ws2" / "checkpoint",
        fixtures / "olmo_torch_new_ws2" / "step3",
        fixtures / "olmo_core3_trainer_ws2" / "step3",
    ]
    assert "torch-free ok 137" in run_script(TORCH_FREE, *paths)
