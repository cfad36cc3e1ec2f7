"""ckptkit.browse in a kernel: filtering reads no tensor bytes, statistics and diffs equal what
torch computes on the tensors it saved, and the chunk-layout picture covers each tensor once."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ckptkit
from ckptkit import tunables
from ckptkit.catalog.model import Chunk
from ckptkit.views import browser, plots

from oracle import torch_keys

FIXTURE = Path(__file__).parent / "fixtures" / "dcp_torch22_fsdp1_ws2" / "checkpoint"


def _torch_stats(tensor: torch.Tensor) -> dict:
    values = tensor.double().reshape(-1).numpy()
    finite = values[np.isfinite(values)]
    counts, edges = np.histogram(finite, bins=browser.HIST_BINS)
    return {
        "min": finite.min(),
        "max": finite.max(),
        "mean": finite.mean(),
        "std": finite.std(),
        "frac_zero": np.mean(values == 0),
        "frac_nan": np.mean(np.isnan(values)),
        "frac_inf": np.mean(np.isinf(values)),
        "hist_counts": counts.tolist(),
        "hist_edges": edges.tolist(),
    }


def _assert_stats(stats: dict, tensor: torch.Tensor, key: str) -> None:
    expected = _torch_stats(tensor)
    for name in ("min", "max", "frac_zero", "frac_nan", "frac_inf", "hist_counts"):
        assert stats[name] == expected[name], f"{key} {name}: {stats[name]} != {expected[name]}"
    for name in ("mean", "std"):
        assert math.isclose(stats[name], expected[name], rel_tol=1e-12, abs_tol=1e-15), (
            f"{key} {name}: {stats[name]} != {expected[name]}"
        )
    np.testing.assert_allclose(stats["hist_edges"], expected["hist_edges"], rtol=1e-12)
    assert stats["numel"] == tensor.numel() and not stats["hist_sampled"]


def test_import_is_lazy_and_browse_stays_callable():
    script = f"""
import sys
import ckptkit
assert "ipywidgets" not in sys.modules and "matplotlib" not in sys.modules
first = ckptkit.browse({str(FIXTURE)!r})
second = ckptkit.browse({str(FIXTURE)!r})  # importing ckptkit.browser must not shadow it
assert callable(ckptkit.browse) and type(second).__name__ == "Browser"
print(second.state["count"])
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(torch_keys(FIXTURE, tensors_only=True)))


def test_filters_count_from_metadata_and_read_nothing(written, monkeypatch):
    sample = written("fsdp2_ws2")
    ckpt = ckptkit.open(str(sample.path))
    ranges: list = []
    original = ckpt.storage.read_ranges
    monkeypatch.setattr(ckpt.storage, "read_ranges", lambda r: ranges.extend(r) or original(r))
    ui = ckptkit.browse(ckpt)
    table = ckpt.tensors
    assert ui.state["count"] == len(table) and ui.state["nbytes"] == table["nbytes"].sum()

    weights = table[table["key"].str.endswith(".weight") & (table["group"] == "model")]
    assert ui.set_filter("*.weight", group="model") == weights["key"].tolist()
    assert ui.state["nbytes"] == weights["nbytes"].sum()

    assert ui.set_filter("odd") == [k for k in table["key"] if "odd" in k]  # plain text
    regex = ui.set_filter(r"blocks\.1\..*exp_avg$", mode="regex")
    assert regex and all(k.startswith("optim.state.blocks.1.") for k in regex)
    assert regex == [
        k for k in table["key"] if k.startswith("optim.state.blocks.1.") and k.endswith(".exp_avg")
    ]
    bf16 = ui.set_filter(dtype="bfloat16", group="optim")
    assert (
        bf16
        == table.loc[(table["dtype"] == "bfloat16") & (table["group"] == "optim"), "key"].tolist()
    )
    optim_state = sample.reference()["optim"]["state"]  # the bf16 adapter's exp_avg(_sq)
    assert len(bf16) == sum(
        isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16
        for state in optim_state.values()
        for v in state.values()
    )

    assert ui.set_filter("(", mode="regex") == [] and "bad regex" in ui.error
    assert ui.state["listed"] == []
    assert ui.reads == [] and ranges == [] and ui.selected is None


def test_selection_reads_one_tensor_and_matches_torch(written):
    sample = written("fsdp2_ws2")
    reference = sample.reference()
    ui = ckptkit.browse(str(sample.path))
    for key, tensor in [
        ("model.odd", reference["model"]["odd"]),
        ("model.adapter.up.weight", reference["model"]["adapter.up.weight"]),  # bfloat16
        ("model.position_ids", reference["model"]["position_ids"]),  # int64
        ("model.temperature", reference["model"]["temperature"]),  # 0-d
    ]:
        ui.set_filter(key)
        stats = ui.select(key)
        assert ui.selected == key and ui.reads[-1] == key and ui.error is None
        _assert_stats(stats, tensor, key)
        assert stats["bytes_read"] == tensor.numel() * tensor.element_size()
        assert ui.layout_figure is not None and ui.stats_figure is not None
    assert ui.reads == [
        "model.odd",
        "model.adapter.up.weight",
        "model.position_ids",
        "model.temperature",
    ]

    # The selection survives a filter that still matches it, and is dropped by one that doesn't.
    ui.set_filter("temp")
    assert ui.selected == "model.temperature" and ui.state["listed"] == ["model.temperature"]
    ui.set_filter("embed")
    assert ui.selected is None and ui.stats is None and len(ui.reads) == 4
    with pytest.raises(ckptkit.KeyNotFoundError, match="model.odd"):
        ui.select("model.odd")


def test_nan_inf_zeros_and_progress(tmp_path, monkeypatch):
    values = torch.arange(-6, 18, dtype=torch.float32).reshape(4, 6)  # one exact zero
    values[0, 0], values[1, 1], values[2, 2] = math.nan, math.inf, -math.inf
    torch.save({"x": values}, tmp_path / "model.pt")
    monkeypatch.setattr(browser, "PROGRESS_BYTES", 0)  # every tensor counts as large
    monkeypatch.setattr(tunables, "BLOCK_ELEMENTS", 5)  # 24 elements in 5 blocks
    ui = ckptkit.browse(str(tmp_path / "model.pt"))
    seen: list[float] = []
    ui._progress.observe(lambda change: seen.append(change["new"]), "value")
    stats = ui.select(ui.matching[0])
    _assert_stats(stats, values, "x")
    assert (stats["frac_nan"], stats["frac_inf"], stats["frac_zero"]) == (1 / 24, 2 / 24, 1 / 24)
    assert stats["min"] == -5 and stats["max"] == 17  # over finite values
    assert seen == sorted(seen) and len(seen) == 5 and seen[-1] == 1.0
    assert ui._progress.layout.display == "none"  # hidden again once read


def test_compare_to_shows_the_same_tensors_diff(written, tmp_path):
    sample = written("fsdp2_ws2")
    model = sample.reference()["model"]
    model["odd"] = model["odd"].clone()
    model["odd"][3, 4] += 0.5
    copy = tmp_path / "model.safetensors"  # keys come out as model.<name>, as in the DCP
    save_file({k: v.contiguous() for k, v in model.items()}, str(copy))

    ui = ckptkit.browse(str(sample.path), compare_to=str(copy))
    ui.set_filter("odd")
    ui.select("model.odd")
    assert ui.diff["status"] == "different"
    assert math.isclose(ui.diff["max_abs"], 0.5, rel_tol=1e-6)
    assert ui.diff["frac_outside"] == 1 / model["odd"].numel()
    expected = ckptkit.diff(str(sample.path), str(copy), keys=["model.odd"]).iloc[0]
    assert ui.diff["rel_l2"] == expected["rel_l2"]
    ui.select("optim.state.odd.exp_avg")
    assert ui.diff["status"] == "only_a"
    ui.set_filter("embed.weight", group="model")
    ui.select("model.embed.weight")
    assert ui.diff["status"] == "equal" and ui.diff["max_abs"] == 0


def _painted(chunks: list[Chunk], shape: tuple[int, ...]) -> np.ndarray:
    """How many times each cell of the drawing grid is covered by the chunks' rectangles."""
    rows, cols, _ = plots._grid(shape)
    grid = np.zeros((rows, cols), dtype=int)
    for chunk in chunks:
        rects, approx = plots._chunk_rects(chunk, shape)
        assert not approx
        for r0, r1, c0, c1 in rects:
            grid[r0:r1, c0:c1] += 1
    return grid


def test_chunk_layout_covers_every_tensor_once(written):
    for name in ("column_sharded", "fsdp2_ws2"):
        ckpt = ckptkit.open(str(written(name).path))
        for entry in ckpt.catalog.tensors():
            boxes = {(c.offsets, c.sizes): c for c in entry.chunks if c.numel}
            assert (_painted(list(boxes.values()), entry.shape) == 1).all(), entry.key
        ui = ckptkit.browse(ckpt)
        ui.select(ui.matching[0])
        axes = ui.layout_figure.axes[0]
        assert len(axes.patches) == len({c.offsets for c in ckpt.entry(ui.selected).chunks})


def test_chunk_rects_of_flat_ranges_and_3d_boxes():
    shape = (5, 7)
    for start, end in [(0, 35), (3, 4), (3, 30), (7, 14), (6, 8), (10, 11), (0, 7)]:
        grid = _painted([Chunk((start,), (end - start,), None, flat=True)], shape)
        assert (grid.reshape(-1) == (np.arange(35) >= start) & (np.arange(35) < end)).all()
    shape = (3, 4, 5, 6)
    box = ((1, 1, 2, 3), (2, 2, 2, 2))
    grid = _painted([Chunk(*box, None)], shape)
    expected = np.zeros(shape, dtype=int)
    expected[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))] = 1
    assert (grid == expected.reshape(3, -1)).all()
