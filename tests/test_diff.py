"""diff and ``ckptkit diff`` on checkpoints torch wrote; torch computes the expected numbers.
compare_sizes is tested in test_sizes.py, the plots in test_plots.py."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import ckptkit
from ckptkit import tunables
from ckptkit.cli import main

from isolated import run_script
from oracle import torch_keys
from writers import ADDED, CLOSE, MUTANT_STEP, PERTURBED, RECAST, REMOVED, RESHAPED, mutant_state

DIFF = importlib.import_module("ckptkit.ops.diff")  # the module (``ckptkit.diff`` is the function)

# the fixtures ws2 (fsdp2_ws2), mutant (its changed copy) and unsharded are in conftest.py


class Marker:
    """An object only the test knows: ckptkit must keep it as a placeholder, never import it."""

    def __init__(self, value: int) -> None:
        self.value = value


def _statuses(frame) -> dict[str, str]:
    return dict(zip(frame["key"], frame["status"], strict=True))


# -- diff ---------------------------------------------------------------------------------


def test_identical_sources_all_equal(ws2):
    ckpt = ckptkit.open(str(ws2.path))
    frame = ckptkit.diff(ckpt, str(ws2.path))
    assert len(frame) == len(ckpt) == len(torch_keys(ws2.path))
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
    state = mutant_state(ws2.reference())["model"]

    for name in (PERTURBED, CLOSE, RECAST):
        a, b = reference[name].double(), state[name].double()
        row = rows.loc[f"model.{name}"]
        assert row["max_abs"] == pytest.approx((a - b).abs().max().item(), rel=1e-12)
        assert row["mean_abs"] == pytest.approx((a - b).abs().mean().item(), rel=1e-9)
        assert row["rel_l2"] == pytest.approx(((a - b).norm() / a.norm()).item(), rel=1e-9)
        cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert row["cosine"] == pytest.approx(cosine.item(), rel=1e-12)
        outside = ~torch.isclose(a, b, rtol=1e-5, atol=0.0)
        assert row["frac_outside"] == pytest.approx(outside.double().mean().item(), rel=1e-12)
    perturbed = rows.loc[f"model.{PERTURBED}"]
    assert perturbed["frac_outside"] == 1 / reference[PERTURBED].numel()
    assert rows.loc[f"model.{CLOSE}", "frac_outside"] == 0
    assert rows.loc[f"model.{RECAST}", "note"] == "dtype float32 → bfloat16"
    assert rows.loc[f"model.{RESHAPED}", "note"] == "shape (48,) → (40,)"
    assert rows.loc["train.step", "note"] == f"{ws2.reference()['train']['step']} → {MUTANT_STEP}"
    assert rows.loc[f"model.{ADDED}", "key_b"] == f"model.{ADDED}"
    assert rows.loc[f"model.{ADDED}", "shape"] == (3, 4)


def test_zero_tolerance_turns_close_into_different(ws2, mutant):
    frame = ckptkit.diff(str(ws2.path), str(mutant), keys=f"model.{CLOSE}", rtol=0, atol=0)
    assert _statuses(frame) == {f"model.{CLOSE}": "different"}
    assert frame["frac_outside"].iloc[0] > 0.5


def _two_files(tmp_path, a: dict, b: dict) -> tuple[str, str]:
    """``a`` and ``b`` saved by torch as ``a/m.pt`` and ``b/m.pt`` (keys ``m.*`` on both sides)."""
    paths = []
    for name, state in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        torch.save(state, tmp_path / name / "m.pt")
        paths.append(str(tmp_path / name / "m.pt"))
    return paths[0], paths[1]


def test_close_is_judged_against_each_tensors_own_scale(tmp_path, capsys):
    """The gate a CI job builds on diff: small-magnitude tensors (Adam's exp_avg_sq near 1e-10)
    that changed by a factor, or many tiny elements changed behind one large one, are
    ``different`` with the default tolerances and the CLI exits 1; float32 rounding noise
    (the same sums in another order) stays ``close``."""
    generator = torch.Generator().manual_seed(0)
    exp_avg_sq = torch.rand(4096, generator=generator) * 1e-10
    masked = torch.full((10_000,), 1e-4)
    masked[0] = 1.0
    masked_b = masked.clone()
    masked_b[1:] *= 1.05  # each within rtol·max|b|, together 5% of the small part's norm
    x = torch.randn(64, 256, generator=generator)
    summed = x.sum(dim=0)
    resummed = x.flip(0).sum(dim=0)  # another summation order: float32 rounding only
    assert not torch.equal(summed, resummed)
    a, b = _two_files(
        tmp_path,
        {"exp_avg_sq": exp_avg_sq, "masked": masked, "noise": summed},
        {"exp_avg_sq": exp_avg_sq * 3, "masked": masked_b, "noise": resummed},
    )
    frame = ckptkit.diff(a, b)
    statuses = _statuses(frame)
    assert statuses == {"m.exp_avg_sq": "different", "m.masked": "different", "m.noise": "close"}
    # the old element-wise rule (torch.isclose with atol=1e-8) calls all three close
    assert torch.isclose(exp_avg_sq, exp_avg_sq * 3, rtol=1e-5, atol=1e-8).all()
    assert main(["diff", a, b, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "different (2):" in out and "close (1):" in out
    assert main(["diff", a, b, "--keys", "m.noise", "--quiet"]) == 0


def test_text_output_groups_statuses_and_caps_long_lists(tmp_path, capsys):
    state = {f"w{i:02d}": torch.full((3,), float(i)) for i in range(30)}
    a, b = _two_files(tmp_path, state, {"other": torch.zeros(2)})
    assert main(["diff", a, b, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "30 only_a" in out and "only_a (30):" in out and "only_b (1):" in out
    assert "… and 10 more (--all lists them)" in out
    assert "m.w19" in out and "m.w20" not in out
    assert main(["diff", a, b, "--quiet", "--all"]) == 1
    out = capsys.readouterr().out
    assert "m.w29" in out and "more (--all" not in out


def test_small_blocks_give_the_same_answer(ws2, mutant, monkeypatch):
    """Blocks of 7 elements: leading identical blocks of the perturbed tensor are re-read for
    its norm; every number equals the one-block result."""
    whole = ckptkit.diff(str(ws2.path), str(mutant), keys="model.*")
    monkeypatch.setattr(tunables, "BLOCK_ELEMENTS", 7)
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
    n_keys, n_model = len(torch_keys(ws2.path)), len(ws2.reference()["model"])
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
        assert len(frame) == (n_keys if keys is None else n_model)


def test_key_map_prefix_and_fsdp_wrappers(ws2, tmp_path):
    """A torch.save file of the reference: its keys sit under the file stem; an FSDP1-style
    copy adds ``_fsdp_wrapped_module.`` segments. key_map and wrapper stripping line them up."""
    reference = ws2.reference()
    torch.save(reference, tmp_path / "full.pt")
    full = str(tmp_path / "full.pt")
    # key_map={} turns the automatic single-file alignment off: nothing pairs without a map
    assert set(ckptkit.diff(str(ws2.path), full, key_map={})["status"]) == {"only_a", "only_b"}
    aligned = ckptkit.diff(str(ws2.path), full)  # the file stem dropped automatically, and said
    assert set(aligned["status"]) == {"equal"} and aligned.attrs["key_map"] == {"full.": ""}
    for key_map in ({"full.": ""}, lambda key: key.removeprefix("full.")):
        frame = ckptkit.diff(str(ws2.path), full, key_map=key_map)
        assert len(frame) == len(torch_keys(ws2.path)) and set(frame["status"]) == {"equal"}
        assert (frame["key_b"] == "full." + frame["key"]).all()

    wrapped = {
        "_fsdp_wrapped_module." + key.replace("blocks.0.", "blocks.0._fsdp_wrapped_module."): value
        for key, value in reference["model"].items()
    }
    torch.save(wrapped, tmp_path / "module.pt")
    module = str(tmp_path / "module.pt")
    frame = ckptkit.diff(str(ws2.path), module, keys="model.*", key_map={"module.": "model."})
    assert len(frame) == len(reference["model"]) and set(frame["status"]) == {"equal"}
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


# -- CLI ----------------------------------------------------------------------------------


def test_cli_diff_exit_codes_and_json(ws2, mutant, unsharded, tmp_path, capsys):
    st = str(unsharded / "st")
    assert main(["diff", str(ws2.path), st, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{len(torch_keys(ws2.path))} equal -> equal within tolerance" in out

    assert (
        main(
            [
                "diff",
                str(ws2.path),
                str(mutant),
                "--keys",
                "model.*",
                "--keys",
                "train.*",
                "--quiet",
            ]
        )
        == 1
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
    model_a = set(ws2.reference()["model"])
    model_b = set(mutant_state(ws2.reference())["model"])
    unchanged = (model_a & model_b) - {PERTURBED, CLOSE, RECAST, RESHAPED}
    assert document["counts"]["equal"] == len(unchanged)
    assert sum(document["counts"].values()) == len(rows) == len(model_a | model_b)

    assert main(["diff", str(ws2.path), str(tmp_path / "missing"), "--quiet"]) == 2
    assert "ckptkit: error:" in capsys.readouterr().err
    assert main(["diff", str(ws2.path), st, "--key-map", "nonsense", "--quiet"]) == 2
    assert main(["diff", str(ws2.path), st, "--keys", "modle.*", "--quiet"]) == 2
    assert "no key matches" in capsys.readouterr().err


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
    assert f"torch-free ok {len(torch_keys(paths[0]))}" in run_script(TORCH_FREE, *paths)
