"""Unshard, then diff against the source: every conformance case, both output formats, ``equal``.

A checkpoint diffed against its own unshard must be ``equal`` key by key, objects included, even
where the two sides spell a value differently (DCP's ``optim.param_groups`` pickled whole, the
output's ``optim.param_groups.0.lr`` …), and ``ckptkit diff SRC OUT`` must exit 0. Also: the
README's recipe (``unshard --dtype bf16`` then ``diff --rtol 1e-2``) passes; the one file torch's
own ``dcp_to_torch_save`` writes (keys under its stem) and a ``pytorch_model.bin`` line up with
an unshard, or a hint names the ``--key-map`` to pass; values inside objects are really compared.

The module is slow because it writes every conformance case's checkpoint (spawned torch jobs);
the unshard and diff of one case take about a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.cli import main

from conformance_cases import CASES, FIXTURES, Workspace

pytestmark = pytest.mark.slow

TARGETS = ("torch", "safetensors")
TORCH22 = next(case for case in CASES if case.id == "fixture-dcp-torch22")
TORCH22_SOURCE = FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint"


class Outputs:
    """Each case's checkpoint (written once) and its unshard per target (made once)."""

    def __init__(self, workspace: Workspace, root: Path) -> None:
        self.workspace = workspace
        self.root = root
        self._sources: dict[str, Path] = {}
        self._outputs: dict[tuple[str, str], Path] = {}

    def source(self, case) -> Path:
        if case.id not in self._sources:
            self._sources[case.id] = Path(case.locate(self.workspace))
        return self._sources[case.id]

    def unsharded(self, case, to: str) -> Path:
        if (case.id, to) not in self._outputs:
            out = self.root / f"{case.id}-{to}"
            ckptkit.unshard(str(self.source(case)), str(out), to=to, progress=False)
            self._outputs[case.id, to] = out
        return self._outputs[case.id, to]


@pytest.fixture(scope="module")
def outputs(written, tmp_path_factory) -> Outputs:
    workspace = Workspace(written, tmp_path_factory.mktemp("round_trip_sources"))
    return Outputs(workspace, tmp_path_factory.mktemp("round_trip_outputs"))


def _unequal(frame) -> str:
    rows = frame[frame["status"] != "equal"]
    return rows[["key", "status", "note", "key_b"]].head(12).to_string()


# --------------------------------------------------------------------------------------------
# Every case, both targets.


@pytest.mark.parametrize(
    ("case", "to"),
    [pytest.param(case, to, id=f"{case.id}-{to}") for case in CASES for to in TARGETS],
)
def test_unshard_then_diff_is_equal(case, to, outputs, capsys):
    src, out = outputs.source(case), outputs.unsharded(case, to)
    frame = ckptkit.diff(str(src), str(out))
    assert len(frame), f"{case.id} → {to}: empty diff"
    assert (frame["status"] == "equal").all(), f"{case.id} → {to}:\n{_unequal(frame)}"
    source = ckptkit.open(str(src))
    objects = {e.key for e in source.catalog.select() if e.kind == "object"}
    # every object of the source is compared: whole, or by the leaves the output keeps of it
    compared = set(frame["key"])
    assert all(key in compared or any(k.startswith(f"{key}.") for k in compared) for key in objects)
    assert main(["diff", str(src), str(out), "--quiet"]) == 0, capsys.readouterr().out


def test_an_object_and_its_leaves_compare_at_the_same_paths(outputs):
    """torch 2.2 pickles ``optim.param_groups`` whole; the unshard keeps its leaves
    (``optim.param_groups.0.lr`` …): one row per leaf, each ``equal``, saying where a holds it."""
    out = outputs.unsharded(TORCH22, "torch")
    source = ckptkit.open(str(TORCH22_SOURCE))
    assert source.entry("optim.param_groups").kind == "object"
    assert "optim.param_groups" not in ckptkit.open(str(out)).catalog.entries
    frame = ckptkit.diff(str(TORCH22_SOURCE), str(out)).set_index("key")
    leaves = frame[frame.index.str.startswith("optim.param_groups.")]
    assert "optim.param_groups.0.lr" in leaves.index and len(leaves) > 5
    assert set(leaves["status"]) == {"equal"}
    assert (leaves["note"] == "inside a's object optim.param_groups").all()
    assert (leaves["key_b"] == leaves.index).all()
    # globs name the leaves, or the object as a whole
    for keys in ("optim.param_groups.0.lr", "optim.param_groups"):
        rows = ckptkit.diff(str(TORCH22_SOURCE), str(out), keys=keys)
        assert set(rows["status"]) == {"equal"}
        assert len(rows) == (1 if keys.endswith("lr") else len(leaves))


def test_a_changed_value_inside_an_object_is_found(outputs, tmp_path, capsys):
    """The leaves are compared, not waved through: a changed learning rate is object_changed
    at its own path, every other key equal, exit 1."""
    out = outputs.unsharded(TORCH22, "torch")
    changed = tmp_path / "changed"
    changed.mkdir()
    for group in ("model", "train"):
        (changed / f"{group}.pt").write_bytes((out / f"{group}.pt").read_bytes())
    optim = torch.load(out / "optim.pt", weights_only=True)
    lr = optim["param_groups"][0]["lr"]
    optim["param_groups"][0]["lr"] = lr * 10
    torch.save(optim, changed / "optim.pt")
    frame = ckptkit.diff(str(TORCH22_SOURCE), str(changed))
    unequal = frame[frame["status"] != "equal"]
    assert unequal["key"].tolist() == ["optim.param_groups.0.lr"]
    row = unequal.iloc[0]
    assert row["status"] == "object_changed"
    assert row["note"] == f"{lr} → {lr * 10}; inside a's object optim.param_groups"
    assert main(["diff", str(TORCH22_SOURCE), str(changed), "--quiet"]) == 1
    assert "optim.param_groups.0.lr" in capsys.readouterr().out


def test_a_tensor_inside_an_object_is_compared_by_value(tmp_path):
    """DCP pickles a tuple holding a tensor whole (one object entry); torch.save files keep the
    tensor as an entry of its own. The tensor is compared as tensors are: numbers included."""
    import torch.distributed.checkpoint as dcp

    values = torch.arange(6, dtype=torch.float32)
    dcp.save({"train": {"pair": (values, 5), "step": 3}}, checkpoint_id=str(tmp_path / "dcp"))
    assert ckptkit.open(str(tmp_path / "dcp")).entry("train.pair").kind == "object"
    (tmp_path / "same").mkdir()
    torch.save({"pair": (values.clone(), 5), "step": 3}, tmp_path / "same" / "train.pt")
    (tmp_path / "moved").mkdir()
    torch.save({"pair": (values + 0.5, 5), "step": 3}, tmp_path / "moved" / "train.pt")

    same = ckptkit.diff(str(tmp_path / "dcp"), str(tmp_path / "same")).set_index("key")
    assert same["status"].to_dict() == {
        "train.pair.0": "equal",
        "train.pair.1": "equal",
        "train.step": "equal",
    }
    assert same.loc["train.pair.0", "dtype"] == "float32"
    assert same.loc["train.pair.0", "shape"] == (6,)

    moved = ckptkit.diff(str(tmp_path / "dcp"), str(tmp_path / "moved")).set_index("key")
    row = moved.loc["train.pair.0"]
    assert row["status"] == "different"
    assert row["max_abs"] == pytest.approx(0.5) and row["frac_outside"] == 1.0
    expected = (0.5 * 6**0.5) / values.double().norm().item()
    assert row["rel_l2"] == pytest.approx(expected, rel=1e-9)
    assert moved.loc["train.pair.1", "status"] == "equal"


# --------------------------------------------------------------------------------------------
# The README recipe: unshard to bf16, diff with --rtol 1e-2.


def test_readme_bf16_recipe_exits_0(written, tmp_path, capsys):
    src = str(written("fsdp2_ws2").path)
    out = str(tmp_path / "bf16")
    assert main(["unshard", src, out, "--dtype", "bf16", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["diff", src, out, "--rtol", "1e-2", "--quiet"]) == 0, capsys.readouterr().out
    capsys.readouterr()

    frame = ckptkit.diff(src, out, rtol=1e-2)
    cast = frame[frame["note"] == "dtype float32 → bfloat16"]
    assert len(cast) > 10 and set(cast["status"]) == {"close"}
    assert (cast["max_abs"] > 0).any()
    assert set(frame["status"]) == {"equal", "close"}
    # the default tolerance is finer than a bf16 rounding: the cast shows as dtype_changed
    strict = ckptkit.diff(src, out)
    assert "dtype_changed" in set(strict["status"])
    assert main(["diff", src, out, "--quiet"]) == 1


# --------------------------------------------------------------------------------------------
# What people compare against: torch's dcp_to_torch_save, a pytorch_model.bin.


@pytest.fixture(scope="module")
def torch_ref(tmp_path_factory) -> Path:
    """torch's own conversion of the torch 2.2 DCP: one file, keys ``model.…`` at its top."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path_factory.mktemp("dcp_to_torch_save") / "torch_ref.pt"
    dcp_to_torch_save(str(TORCH22_SOURCE), str(path))
    return path


def test_dcp_to_torch_save_output_lines_up(torch_ref, outputs, capsys):
    """``diff SRC torch_ref.pt`` and ``diff torch_ref.pt OUT`` exit 0: the file's stem is
    dropped (its keys all pair then), and a note names the ``--key-map`` that does it."""
    assert next(iter(ckptkit.open(str(torch_ref)).catalog.entries)).startswith("torch_ref.")
    out = outputs.unsharded(TORCH22, "torch")
    for a, b in ((TORCH22_SOURCE, torch_ref), (torch_ref, out)):
        frame = ckptkit.diff(str(a), str(b))
        assert (frame["status"] == "equal").all(), _unequal(frame)
        assert frame.attrs["key_map"] == {"torch_ref.": ""}
        assert any("--key-map torch_ref.=" in note for note in frame.attrs["notes"])
        assert main(["diff", str(a), str(b), "--quiet"]) == 0
        err = capsys.readouterr().err
        assert err.startswith("ckptkit: note: ") and "--key-map torch_ref.=" in err
    # key_map={} matches keys as they are: nothing pairs, and a note says what to do
    frame = ckptkit.diff(str(TORCH22_SOURCE), str(torch_ref), key_map={})
    assert set(frame["status"]) == {"only_a", "only_b"}
    assert any("--key-map OLD=NEW" in note for note in frame.attrs["notes"])


@pytest.fixture(scope="module")
def model_bin(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A flat state dict of the torch 2.2 DCP's model in one file, as HF / DeepSpeed's
    ``pytorch_model.bin`` holds one (keys without ``model.``)."""
    source = ckptkit.open(str(TORCH22_SOURCE))
    model = {
        e.key.removeprefix("model."): source.read(e.key)
        for e in source.catalog.tensors()
        if e.group == "model"
    }
    path = tmp_path_factory.mktemp("hf") / "pytorch_model.bin"
    torch.save(model, path)
    return path, model


def test_pytorch_model_bin_lines_up_or_gets_a_hint(model_bin, outputs, tmp_path, capsys):
    """Its keys are read under ``pytorch_model.``; renamed to the other side's ``model.`` when
    that pairs them all, else a note names the exact ``--key-map``."""
    path, model = model_bin
    out = outputs.unsharded(TORCH22, "torch")
    frame = ckptkit.diff(str(path), str(out), keys="model.*")
    assert len(frame) == len(model) and set(frame["status"]) == {"equal"}
    assert frame.attrs["key_map"] == {"pytorch_model.": "model."}
    assert main(["diff", str(path), str(out), "--keys", "model.*", "--quiet"]) == 0
    assert "--key-map pytorch_model.=model." in capsys.readouterr().err

    # one key the other side lacks: nothing is renamed behind the user's back, a hint is given
    extra = tmp_path / "pytorch_model.bin"
    torch.save({**model, "extra.bias": torch.zeros(3)}, extra)
    frame = ckptkit.diff(str(extra), str(out))
    assert frame.attrs["key_map"] is None
    hint = f"--key-map pytorch_model.=model. would pair {len(model)} of its {len(model) + 1} keys"
    assert any(hint in note for note in frame.attrs["notes"]), frame.attrs["notes"]
    assert main(["diff", str(extra), str(out), "--quiet"]) == 1
    assert hint in capsys.readouterr().err


def test_a_glob_that_matches_nothing_is_never_silent(model_bin, outputs, capsys):
    out = outputs.unsharded(TORCH22, "torch")
    # nothing on either side: an error naming the closest keys (exit 2)
    assert main(["diff", str(TORCH22_SOURCE), str(out), "--keys", "model.embed.weigth"]) == 2
    err = capsys.readouterr().err
    assert "no key matches" in err and "did you mean 'model.embed.weight'" in err
    # one side only: the rows are only_a, and a note says what b has instead
    path, _ = model_bin
    frame = ckptkit.diff(str(TORCH22_SOURCE), str(path), keys="optim.state.*")
    assert set(frame["status"]) == {"only_a"}
    note = "no key of b matches 'optim.state.*' (groups: model)"
    assert note in frame.attrs["notes"], frame.attrs["notes"]
    assert main(["diff", str(TORCH22_SOURCE), str(path), "--keys", "optim.state.*"]) == 1
    assert note in capsys.readouterr().err
