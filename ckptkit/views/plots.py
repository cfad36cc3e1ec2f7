"""matplotlib pictures of :func:`ckptkit.compare_sizes` and :func:`ckptkit.diff` results, and of
one tensor (its chunk layout and values, as :func:`ckptkit.browse` shows them).

matplotlib is imported inside each function; every helper draws on ``ax`` (a new figure when
None) and returns the Axes, never calling ``plt.show()``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..catalog.keys import KeyMap, map_key
from ..catalog.model import Chunk
from ..errors import KeyNotFoundError, UsageError
from ..extras import require
from ..ops.source import Source, open_source
from ..reading.tensor_blocks import aligned_blocks, as_float
from ..units import human_bytes, plural

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

__all__ = [
    "LAYER_PATTERN",
    "plot_sizes",
    "plot_diff",
    "diff_by_layer",
    "plot_diff_by_layer",
    "plot_diff_histogram",
    "MAX_RECTS_PER_CHUNK",
    "plot_chunk_layout",
    "plot_value_histogram",
]

#: Transformer layer indices in common key spellings: ``blocks.3.``, ``layers.3.``, ``h.3.``.
LAYER_PATTERN = r"(?:^|\.)((?:blocks|layers|layer|h)\.(\d+))\."

_SEGMENTS = {
    "group": [
        ("model", "model", "tab:blue"),
        ("optim", "optim", "tab:orange"),
        ("train", "train", "tab:green"),
        ("other", "other", "tab:purple"),
        ("overhead_bytes", "framing overhead", "tab:red"),
        ("metadata_bytes", "metadata files", "tab:gray"),
    ],
}


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    plt = require("matplotlib.pyplot", "plotting (ckptkit.views.plots)")
    _, ax = plt.subplots(figsize=figsize)
    return ax


def _unit(largest: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= scale:
            return scale, unit
    return 1.0, "B"


def plot_sizes(frame: pd.DataFrame, *, by: str = "group", ax: Axes | None = None) -> Axes:
    """Stacked horizontal bars, one per checkpoint of a :func:`compare_sizes` frame.

    ``by="group"``: model / optim / train / other, framing overhead and metadata files;
    ``by="dtype"``: tensor bytes per dtype, then objects, overhead and metadata. Each bar is
    labelled with its total and its ratio to the first checkpoint.
    """
    if by == "group":
        segments = _SEGMENTS["group"]
    elif by == "dtype":
        dtype_columns = frame.attrs.get("dtype_columns") or [
            c for c in frame.columns if c not in _NON_DTYPE_COLUMNS
        ]
        segments = [(c, c, None) for c in dtype_columns] + [
            ("object_bytes", "objects", "tab:olive"),
            ("overhead_bytes", "framing overhead", "tab:red"),
            ("metadata_bytes", "metadata files", "tab:gray"),
        ]
    else:
        raise UsageError(f"by must be 'group' or 'dtype', not {by!r}")
    ax = _axes(ax, (9, 0.6 * len(frame) + 1.6))
    scale, unit = _unit(float(frame["size"].max()))
    labels = [str(label) for label in frame.index]
    y = np.arange(len(frame))
    left = np.zeros(len(frame))
    for column, name, color in segments:
        values = frame[column].to_numpy(dtype=float) / scale
        if not values.any():
            continue
        ax.barh(y, values, left=left, label=name, color=color, height=0.6)
        left += values
    for i, (size, ratio) in enumerate(zip(frame["size"], frame["ratio"], strict=True)):
        ax.text(left[i], i, f"  {human_bytes(size)}  ({ratio:.2f}×)", va="center", fontsize=9)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.3 if left.max() else 1)
    ax.set_xlabel(f"bytes on disk ({unit})")
    ax.set_title(f"checkpoint size by {by}")
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.grid(axis="x", alpha=0.3)
    return ax


_NON_DTYPE_COLUMNS = {
    "format",
    "files",
    "records",
    "size",
    "ratio",
    "model",
    "optim",
    "train",
    "other",
    "tensor_bytes",
    "object_bytes",
    "overhead_bytes",
    "metadata_bytes",
    "alternate_bytes",
}


def plot_diff(
    frame: pd.DataFrame, *, metric: str = "rel_l2", top: int | None = 40, ax: Axes | None = None
) -> Axes:
    """``metric`` per key of a :func:`ckptkit.diff` frame, largest first, on a log scale.

    Keys whose value is 0 (bit-identical) cannot sit on a log axis: the title counts them.
    """
    values = frame.set_index("key")[metric].astype(float).dropna()
    zero = int((values == 0).sum())
    shown = values[values > 0].sort_values(ascending=False)
    hidden = len(shown) - top if top is not None and len(shown) > top else 0
    if hidden:
        shown = shown.iloc[:top]
    ax = _axes(ax, (9, 0.22 * len(shown) + 1.5))
    colors = [
        _STATUS_COLORS.get(s, "tab:gray") for s in frame.set_index("key").loc[shown.index, "status"]
    ]
    ax.barh(np.arange(len(shown)), shown.to_numpy(), color=colors)
    ax.set_yticks(np.arange(len(shown)), shown.index, fontsize=7)
    ax.invert_yaxis()
    if len(shown):
        ax.set_xscale("log")
    notes = [f"{plural(zero, 'key')} at 0"] if zero else []
    if hidden:
        notes.append(f"{hidden} smaller not shown")
    ax.set_title(f"{metric} per key" + (f" ({', '.join(notes)})" if notes else ""))
    ax.set_xlabel(metric)
    ax.grid(axis="x", alpha=0.3, which="both")
    return ax


_STATUS_COLORS = {"different": "tab:red", "close": "tab:green", "dtype_changed": "tab:orange"}


def diff_by_layer(
    frame: pd.DataFrame,
    *,
    pattern: str = LAYER_PATTERN,
    metric: str = "rel_l2",
    agg: str = "max",
) -> pd.Series:
    """``metric`` aggregated (``agg``: max, mean, median…) over the numeric rows of each layer.

    A key's layer is ``pattern``'s first group (``blocks.3``) when it matches, else its first
    path component after the group (``embed``, ``ln_f``). Layers keep the order they first
    appear in, numbered layers in numeric order.
    """
    regex = re.compile(pattern)
    rows = frame[frame[metric].notna()]
    layers = [_layer(key, regex) for key in rows["key"]]
    names = [name for name, _ in layers]
    series = rows[metric].astype(float).groupby(names, sort=False).agg(agg)
    numbers = {name: number for name, number in layers}
    numbered = iter(sorted((n for n in series.index if numbers[n] is not None), key=numbers.get))
    order = [next(numbered) if numbers[n] is not None else n for n in series.index]
    series = series.loc[order]
    series.name = f"{agg} {metric}"
    series.index.name = "layer"
    return series


def _layer(key: str, regex: re.Pattern) -> tuple[str, int | None]:
    """``(layer name, layer number or None)`` of a key."""
    match = regex.search(key)
    if match:
        return match.group(1), int(match.group(2))
    parts = key.split(".")
    return (parts[1] if len(parts) > 2 else parts[-1]), None


def plot_diff_by_layer(
    frame: pd.DataFrame,
    *,
    pattern: str = LAYER_PATTERN,
    metric: str = "rel_l2",
    agg: str = "max",
    log: bool = True,
    ax: Axes | None = None,
) -> Axes:
    """Bars of :func:`diff_by_layer`: which layers moved most."""
    series = diff_by_layer(frame, pattern=pattern, metric=metric, agg=agg)
    ax = _axes(ax, (max(5, 0.5 * len(series) + 2), 3.5))
    ax.bar(np.arange(len(series)), series.to_numpy(), color="tab:blue")
    ax.set_xticks(np.arange(len(series)), series.index, rotation=45, ha="right")
    if log and (series > 0).any():
        ax.set_yscale("log")
    ax.set_ylabel(series.name)
    ax.set_title(f"{series.name} per layer")
    ax.grid(axis="y", alpha=0.3, which="both")
    return ax


def plot_diff_histogram(
    a: str | Source,
    b: str | Source,
    key: str,
    *,
    key_b: str | None = None,
    key_map: KeyMap = None,
    bins: int = 101,
    ax: Axes | None = None,
    storage_options: dict | None = None,
) -> Axes:
    """Histogram of the element-wise difference a − b of one tensor (counts on a log scale when
    they span orders of magnitude).

    ``key_b`` names the tensor in ``b`` when its key differs (else ``key`` mapped by
    ``key_map`` is looked up among b's mapped keys). Streams both tensors twice (range first).
    """
    ckpt_a = open_source(a, storage_options)
    ckpt_b = open_source(b, storage_options)
    ea = ckpt_a.entry(key)
    eb = ckpt_b.entry(key_b) if key_b is not None else _find(ckpt_b, map_key(key, key_map), key_map)
    if ea.kind != "tensor" or eb.kind != "tensor" or ea.shape != eb.shape:
        raise KeyNotFoundError(f"{key!r}: needs tensors of the same shape on both sides")
    largest = 0.0
    for _, ba, bb in aligned_blocks(ckpt_a.reader, ea, ckpt_b.reader, eb):
        d = as_float(ba, ea.dtype) - as_float(bb, eb.dtype)
        finite = d[np.isfinite(d)]
        if finite.size:
            largest = max(largest, float(np.abs(finite).max()))
    edges = np.linspace(-largest, largest, bins + 1) if largest else np.linspace(-1, 1, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    zeros = 0
    for _, ba, bb in aligned_blocks(ckpt_a.reader, ea, ckpt_b.reader, eb):
        d = np.real(as_float(ba, ea.dtype) - as_float(bb, eb.dtype))
        zeros += int(np.count_nonzero(d == 0))
        counts += np.histogram(d, bins=edges)[0]
    ax = _axes(ax, (7, 3.5))
    ax.stairs(counts, edges, fill=True, color="tab:blue")
    if counts.any() and counts.max() > 50 * max(1, counts[counts > 0].min()):
        ax.set_yscale("log")  # counts over orders of magnitude (e.g. a few outliers)
    ax.set_xlabel("a − b")
    ax.set_ylabel("elements")
    share = zeros / ea.numel if ea.numel else math.nan
    ax.set_title(
        f"{key}: {ea.numel:,} elements, max |a−b| {largest:.3g}, {share:.1%} exactly equal"
    )
    return ax


def _find(ckpt: Source, name: str, key_map: KeyMap) -> Any:
    for entry in ckpt.catalog.entries.values():
        if map_key(entry.key, key_map) == name:
            return entry
    raise KeyNotFoundError(f"{ckpt.url}: no entry maps to {name!r}")


# -- one tensor: chunk layout and value histogram (used by ckptkit.browse) ------------------

#: Rectangles drawn per chunk at most; a chunk needing more is drawn as its bounding box.
MAX_RECTS_PER_CHUNK = 256


def plot_chunk_layout(
    source: str | Source,
    key: str,
    *,
    ax: Axes | None = None,
    storage_options: dict | None = None,
) -> Axes:
    """Which rank (or file) stores which rows/columns of tensor ``key``, from metadata only.

    One rectangle per stored box over the tensor drawn as a matrix (row 0 on top); a 1-D
    tensor is a bar; dims after the first are flattened into columns; flat-parameter shards
    cover row ranges that may start and end mid-row. One colour per holder.
    """
    from matplotlib.patches import Patch

    entry = open_source(source, storage_options).entry(key)
    if entry.kind != "tensor":
        raise KeyNotFoundError(f"{key!r} is an object, not a tensor: it has no chunk layout")
    ax = _axes(ax, (5.0, 3.2))
    rows, cols, xlabel = _grid(entry.shape)
    boxes: dict[tuple, list[Chunk]] = {}  # stored box → every copy of it (replicas)
    for chunk in entry.chunks:
        boxes.setdefault((chunk.flat, chunk.offsets, chunk.sizes), []).append(chunk)
    colors: dict[str, Any] = {}
    approx = False
    unlabelled = 0
    for copies in boxes.values():
        label = _holders(copies)
        color = colors.setdefault(label, _color(len(colors)))
        rects, rough = _chunk_rects(copies[0], entry.shape)
        approx |= rough
        text = f"{label}\n{'×'.join(map(str, copies[0].sizes))}"
        if rects and not _draw_box(ax, rects, color, text, (rows, cols), crowded=len(boxes) > 16):
            unlabelled += 1  # too small to write in: the legend names it
    _layout_axes(ax, entry.shape, rows, cols, xlabel)
    shape = "×".join(map(str, entry.shape)) or "scalar"
    rough = " (approx.)" if approx else ""
    ax.set_title(f"{entry.key}\n{shape}, {len(boxes)} chunk(s){rough}", fontsize=9)
    if unlabelled:
        handles = [Patch(facecolor=c, label=label) for label, c in list(colors.items())[:12]]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def _draw_box(
    ax: Axes, rects: list[tuple], color: Any, text: str, grid: tuple[int, int], *, crowded: bool
) -> bool:
    """Fill one stored box's (non-empty) rectangles; write ``text`` in the largest one unless
    it is too small (or the plot too crowded) to hold it. True when the text was written."""
    from matplotlib.patches import Rectangle

    for r0, r1, c0, c1 in rects:
        ax.add_patch(
            Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="white", lw=1.5)
        )
    rows, cols = grid
    r0, r1, c0, c1 = max(rects, key=lambda r: (r[1] - r[0]) * (r[3] - r[2]))
    if crowded or r1 - r0 < 0.12 * rows or c1 - c0 < 0.15 * cols:
        return False
    ax.text((c0 + c1) / 2, (r0 + r1) / 2, text, ha="center", va="center", fontsize=8)
    return True


def _layout_axes(ax: Axes, shape: tuple[int, ...], rows: int, cols: int, xlabel: str) -> None:
    """Limits, integer ticks and labels for a tensor drawn as a matrix (a bar when 1-D)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)  # row 0 at the top, as a matrix is written
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rows" if len(shape) >= 2 else "")
    if len(shape) < 2:  # a bar
        ax.set_yticks([])
        ax.set_box_aspect(0.25)
    if not shape:
        ax.set_xticks([])


def plot_value_histogram(stats: Mapping[str, Any], *, ax: Axes | None = None) -> Axes:
    """The histogram in a tensor's statistics (``Browser.stats``: ``hist_counts``,
    ``hist_edges`` over its finite values, plus ``key``, ``numel``, ``dtype``)."""
    ax = _axes(ax, (5.0, 3.2))
    if stats["hist_counts"]:
        ax.stairs(stats["hist_counts"], stats["hist_edges"], fill=True, color="tab:blue")
    sampled = " (even sample)" if stats.get("hist_sampled") else ""
    ax.set(xlabel="|x|" if stats.get("of") == "abs" else "value", ylabel="count")
    ax.set_title(f"{stats['key']}\n{stats['numel']:,} {stats['dtype']} values{sampled}", fontsize=9)
    return ax


def _grid(shape: tuple[int, ...]) -> tuple[int, int, str]:
    """The 2-D grid a tensor is drawn on: (rows, columns, x-axis label)."""
    if len(shape) == 0:
        return 1, 1, "scalar"
    if len(shape) == 1:
        return 1, shape[0], "elements"
    if len(shape) == 2:
        return shape[0], shape[1], "columns"
    trailing = "×".join(map(str, shape[1:]))
    return shape[0], math.prod(shape[1:]), f"dims 1–{len(shape) - 1} flattened ({trailing})"


def _chunk_rects(chunk: Chunk, shape: tuple[int, ...]) -> tuple[list[tuple], bool]:
    """Rectangles ``(row0, row1, col0, col1)`` of ``chunk`` on the tensor's grid, and whether
    they are only its bounding box."""
    rows, cols, _ = _grid(shape)
    if chunk.flat:
        start = chunk.offsets[0]
        return _flat_rects(start, start + chunk.numel, cols), False
    if len(shape) == 0:
        return [(0, 1, 0, 1)], False
    if len(shape) == 1:
        return [(0, 1, chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])], False
    r0, r1 = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
    runs = _column_runs(chunk.offsets[1:], chunk.sizes[1:], shape[1:])
    if runs is None:  # too fragmented to draw: its bounding columns
        inner = math.prod(shape[2:])
        begin = chunk.offsets[1] * inner
        return [(r0, r1, begin, (chunk.offsets[1] + chunk.sizes[1]) * inner)], True
    return [(r0, r1, b, e) for b, e in runs], False


def _flat_rects(start: int, end: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Rectangles covering flat elements [start, end) of a grid ``cols`` wide (≤ 3)."""
    if end <= start or cols == 0:
        return []
    r0, c0 = divmod(start, cols)
    r1, c1 = divmod(end, cols)
    if r0 == r1:
        return [(r0, r0 + 1, c0, c1)]
    rects = []
    if c0:
        rects.append((r0, r0 + 1, c0, cols))
        r0 += 1
    if r1 > r0:
        rects.append((r0, r1, 0, cols))
    if c1:
        rects.append((r1, r1 + 1, 0, c1))
    return rects


def _column_runs(
    offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]
) -> list[tuple[int, int]] | None:
    """Contiguous [begin, end) runs a box of the trailing dims covers once flattened (None when
    there would be more than :data:`MAX_RECTS_PER_CHUNK`)."""
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return [(0, math.prod(shape))]
    last = partial[-1]  # dims after it are whole, so each index above it gives one run
    if math.prod(sizes[:last]) > MAX_RECTS_PER_CHUNK:
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs: list[tuple[int, int]] = []
    for index in np.ndindex(*sizes[:last]):
        begin = sum((o + i) * s for o, i, s in zip(offsets, index, strides, strict=False))
        begin += offsets[last] * strides[last]
        end = begin + sizes[last] * strides[last]
        if runs and runs[-1][1] == begin:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((begin, end))
    return runs


def _holders(copies: list[Chunk]) -> str:
    """Who stored a box: ``rank 1``, ``ranks 0,1`` (replicas) or the file when ranks are unknown."""
    if all(c.rank is not None for c in copies):
        ranks = ",".join(str(c.rank) for c in copies)
        return f"rank {ranks}" if len(copies) == 1 else f"ranks {ranks}"
    files = [c.record.file if c.record is not None else "—" for c in copies]
    return files[0] if len(files) == 1 else f"{files[0]} +{len(files) - 1}"


def _color(i: int) -> Any:
    from matplotlib import colormaps

    return colormaps["tab10"](i) if i < 10 else colormaps["tab20"](i % 20)
