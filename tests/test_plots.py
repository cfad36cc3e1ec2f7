"""ckptkit.plots on the fsdp2_ws2 sample, its mutant copy and its unsharded copies: every bar,
label and count drawn is read off the axes and compared with the frame it plots or with torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.units import human_bytes

from writers import CLOSE, PERTURBED, RECAST, mutant_state


@pytest.fixture
def plots():
    """``ckptkit.plots`` drawing off-screen; every figure is closed afterwards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ckptkit.views import plots

    yield plots
    plt.close("all")


def test_diff_plots_draw_what_the_frame_says(plots, ws2, mutant):
    frame = ckptkit.diff(str(ws2.path), str(mutant), keys="model.*")
    ax = plots.plot_diff(frame)
    rel = frame.set_index("key")["rel_l2"]
    nonzero = rel[rel > 0].sort_values(ascending=False)
    # only the keys whose values changed are drawn (a log axis has no 0), largest first
    assert set(nonzero.index) == {f"model.{key}" for key in (PERTURBED, CLOSE, RECAST)}
    assert [patch.get_width() for patch in ax.patches] == pytest.approx(nonzero.tolist())
    assert [label.get_text() for label in ax.get_yticklabels()] == nonzero.index.tolist()
    assert ax.get_xscale() == "log"

    by_layer = plots.diff_by_layer(frame)
    assert by_layer["blocks.1"] == rel[f"model.{PERTURBED}"]
    assert by_layer["blocks.0"] == rel[f"model.{CLOSE}"]
    assert by_layer["embed"] == 0
    layers = by_layer.index.tolist()
    assert layers.index("blocks.0") + 1 == layers.index("blocks.1")
    ax = plots.plot_diff_by_layer(frame)
    assert [p.get_height() for p in ax.patches] == by_layer.tolist()
    assert [label.get_text() for label in ax.get_xticklabels()] == layers

    # the histogram of a − b counts what torch computes on the tensors that were saved
    a = ws2.reference()["model"][PERTURBED]
    b = mutant_state(ws2.reference())["model"][PERTURBED]
    d = (a.double() - b.double()).flatten().numpy()
    largest = np.abs(d).max()
    expected, _ = np.histogram(d, bins=np.linspace(-largest, largest, 102))
    ax = plots.plot_diff_histogram(str(ws2.path), str(mutant), f"model.{PERTURBED}")
    (stairs,) = ax.patches
    assert stairs.get_data().values.tolist() == expected.tolist()
    numel = a.numel()
    assert f"{(numel - 1) / numel:.1%} exactly equal" in ax.get_title()


def _segments(ax) -> dict[str, list[float]]:
    """Bytes of each stacked segment (legend label) per bar, read off a kB axis."""
    assert ax.get_xlabel() == "bytes on disk (kB)"
    return {c.get_label(): [p.get_width() * 1e3 for p in c.patches] for c in ax.containers}


def _dtypes(value) -> set[str]:
    """The dtypes of the tensors in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        return {str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*map(_dtypes, value))
    return set()


def test_size_plots_draw_what_the_frame_says(plots, ws2, unsharded):
    sizes = ckptkit.compare_sizes(str(ws2.path), str(unsharded / "st"))
    by = {
        "group": {
            "model": "model",
            "optim": "optim",
            "train": "train",
            "other": "other",
            "framing overhead": "overhead_bytes",
            "metadata files": "metadata_bytes",
        },
        "dtype": {
            **{dtype: dtype for dtype in sorted(_dtypes(ws2.reference()))},
            "objects": "object_bytes",
            "framing overhead": "overhead_bytes",
            "metadata files": "metadata_bytes",
        },
    }
    for name, columns in by.items():
        ax = plots.plot_sizes(sizes, by=name)
        segments = _segments(ax)
        # one segment per non-zero part, one bar per checkpoint, the parts adding up to its size
        expected = {label: sizes[c].tolist() for label, c in columns.items() if sizes[c].any()}
        assert segments.keys() == expected.keys(), name
        for label, widths in segments.items():
            assert widths == pytest.approx(expected[label]), (name, label)
        assert np.sum(list(segments.values()), axis=0) == pytest.approx(sizes["size"].tolist())
        assert [t.get_text() for t in ax.get_yticklabels()] == sizes.index.tolist()
        assert [t.get_text() for t in ax.texts] == [
            f"  {human_bytes(size)}  ({ratio:.2f}×)"
            for size, ratio in zip(sizes["size"], sizes["ratio"], strict=True)
        ]
        assert ax.get_title() == f"checkpoint size by {name}"
