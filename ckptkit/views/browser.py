"""An ipywidgets browser over a checkpoint: filter its tensors, pick one, see its layout and values.

Everything shown before a tensor is picked comes from metadata. Picking one reads that tensor
only, chunk by chunk in bounded memory (and, with ``compare_to``, the same tensor there too).
The widget keeps its state in plain attributes (:attr:`Browser.state`) so code can drive it
(:meth:`Browser.set_filter`, :meth:`Browser.select`) and check what it shows.
"""

from __future__ import annotations

import fnmatch
import html
import io
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import numpy as np

from .. import tunables
from ..catalog.keys import map_key
from ..catalog.model import Chunk, Entry, distinct_chunks
from ..catalog.tables import tensors_table
from ..errors import CheckpointError, KeyNotFoundError
from ..ops.diff import diff as diff_checkpoints
from ..ops.source import Source, open_source
from ..reading import check_coverage, tensor_blocks
from ..units import human_bytes, plural
from .plots import plot_chunk_layout, plot_value_histogram

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["MAX_LISTED", "PROGRESS_BYTES", "HIST_SAMPLE", "HIST_BINS", "browse", "Browser"]

#: Keys put in the select list at most; a filter narrows what is listed.
MAX_LISTED = 1000
#: Tensors at least this large (bytes) show a progress bar while their statistics are read.
PROGRESS_BYTES = 16 << 20
#: The histogram uses every finite value up to this many elements, an even sample beyond.
HIST_SAMPLE = 1 << 20
HIST_BINS = 50
_MAX_CHUNK_ROWS = 64  # rows of the chunks table shown under the metadata
_ALL = ""  # the group/dtype menus' "all" entry (a None value would mean "nothing selected")


def browse(
    source: str | Source,
    *,
    compare_to: str | Source | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Browser:
    """A widget over ``source``'s tensors (a path, fsspec URL or open :class:`Checkpoint`).

    With ``compare_to`` (another checkpoint), the selected tensor is also diffed against it.
    """
    ckpt = open_source(source, storage_options)
    other = open_source(compare_to, storage_options) if compare_to is not None else None
    return Browser(ckpt, other)


class Browser(widgets.VBox):
    """Filter box + group/dtype selectors → matching tensors → the selected tensor's metadata,
    chunk layout, statistics and (with a second checkpoint) diff.

    Plain attributes hold what is shown: ``matching``, ``selected``, ``stats``, ``diff``,
    ``layout_figure``, ``stats_figure``, ``reads`` (keys whose bytes were read, in order) and
    ``error``; :attr:`state` gathers them.
    """

    def __init__(self, checkpoint: Source, other: Source | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.other = other
        self.table: pd.DataFrame = tensors_table(checkpoint.catalog)  # metadata only
        self.matching: list[str] = []
        self.matching_bytes = 0
        self.selected: str | None = None
        self.stats: dict[str, Any] | None = None
        self.diff: dict[str, Any] | None = None
        self.layout_figure: Figure | None = None
        self.stats_figure: Figure | None = None
        self.reads: list[str] = []
        self.error: str | None = None
        self._batch = self._listing = False  # guards while several widgets change at once
        self._make_controls()
        self._make_panels()
        self._tag_widgets()
        self.children = self._arrange()
        for widget in (self._filter, self._mode, self._group, self._dtype):
            widget.observe(self._on_filter, "value")
        self._list.observe(self._on_select, "value")
        self._refresh_matches()
        self._clear_detail()

    def _make_controls(self) -> None:
        """The filter text, glob/regex toggle and group/dtype menus (from the table)."""
        groups = list(dict.fromkeys(self.table["group"]))
        dtypes = sorted(set(self.table["dtype"]))
        self._filter = widgets.Text(
            placeholder="*.weight, blocks.0 … (glob or text; regex with the toggle)",
            description="filter",
            continuous_update=True,
            layout=widgets.Layout(width="38%"),
        )
        self._mode = widgets.ToggleButtons(
            options=["glob", "regex"], style={"button_width": "56px"}
        )
        self._group = widgets.Dropdown(
            options=[("all groups", _ALL)] + [(g, g) for g in groups],
            layout=widgets.Layout(width="auto"),
        )
        self._dtype = widgets.Dropdown(
            options=[("all dtypes", _ALL)] + [(d, d) for d in dtypes],
            layout=widgets.Layout(width="auto"),
        )

    def _make_panels(self) -> None:
        """The match summary, key list and the selected tensor's detail panels."""
        self._summary = widgets.HTML()
        self._list = widgets.Select(
            options=[], value=None, rows=20, layout=widgets.Layout(width="34%")
        )
        self._meta = widgets.HTML()
        self._progress = widgets.FloatProgress(
            min=0.0, max=1.0, description="reading", layout=widgets.Layout(display="none")
        )
        self._layout_image = widgets.Image(format="png", layout=widgets.Layout(width="48%"))
        self._hist_image = widgets.Image(format="png", layout=widgets.Layout(width="48%"))
        self._stats_html = widgets.HTML()
        self._diff_html = widgets.HTML()

    def _tag_widgets(self) -> None:
        """CSS classes ``ckptkit-<name>`` that notebooks and tests find the widgets by."""
        for widget, name in [
            (self._filter, "filter"),
            (self._group, "group"),
            (self._dtype, "dtype"),
            (self._summary, "summary"),
            (self._list, "list"),
            (self._meta, "meta"),
            (self._layout_image, "layout"),
            (self._hist_image, "histogram"),
            (self._stats_html, "stats"),
            (self._diff_html, "diff"),
        ]:
            widget.add_class(f"ckptkit-{name}")
        self.add_class("ckptkit-browse")

    def _arrange(self) -> list[widgets.Widget]:
        """Header, filter row, summary, then the key list beside the detail column."""
        detail = widgets.VBox(
            [
                self._meta,
                self._progress,
                widgets.HBox([self._layout_image, self._hist_image]),
                self._stats_html,
                self._diff_html,
            ],
            layout=widgets.Layout(width="66%", padding="0 0 0 12px"),
        )
        return [
            widgets.HTML(self._header_html()),
            widgets.HBox([self._filter, self._mode, self._group, self._dtype]),
            self._summary,
            widgets.HBox([self._list, detail]),
        ]

    # -- driving it from code ----------------------------------------------------------------

    @property
    def state(self) -> dict[str, Any]:
        """What the widget shows, as plain values (for notebooks and tests to assert on)."""
        return {
            "filter": self._filter.value,
            "mode": self._mode.value,
            "group": self._group.value or None,
            "dtype": self._dtype.value or None,
            "matching": list(self.matching),
            "count": len(self.matching),
            "nbytes": self.matching_bytes,
            "listed": list(self._list.options),
            "selected": self.selected,
            "stats": self.stats,
            "diff": self.diff,
            "reads": list(self.reads),
            "error": self.error,
        }

    def set_filter(
        self,
        pattern: str = "",
        *,
        mode: str = "glob",
        group: str | None = None,
        dtype: str | None = None,
    ) -> list[str]:
        """Set the whole filter at once (as typing/clicking would) and return the matching keys."""
        self._batch = True
        try:
            self._filter.value = pattern
            self._mode.value = mode
            self._group.value = group or _ALL
            self._dtype.value = dtype or _ALL
        finally:
            self._batch = False
        self._refresh_matches()
        return list(self.matching)

    def select(self, key: str | None) -> dict[str, Any] | None:
        """Select ``key`` among the matching tensors (as clicking it would); returns its stats."""
        if key is not None and key not in self.matching:
            raise KeyNotFoundError(
                f"{self.checkpoint.url}: {key!r} is not among the {len(self.matching)} tensors "
                f"matching the filter {self._filter.value!r}"
            )
        if key is not None and key not in self._list.options:  # beyond MAX_LISTED
            self._set_list([*self._list.options, key], self._list.value)
        self._list.value = key
        return self.stats

    # -- filtering (metadata only) -----------------------------------------------------------

    def _on_filter(self, _change: dict) -> None:
        if not self._batch:
            self._refresh_matches()

    def _refresh_matches(self) -> None:
        frame = self.table
        self.error = None
        try:
            mask = _key_mask(frame["key"], self._filter.value, self._mode.value)
        except re.error as exc:
            self.error = f"bad regex {self._filter.value!r}: {exc}"
            mask = np.zeros(len(frame), dtype=bool)
        if self._group.value != _ALL:
            mask &= (frame["group"] == self._group.value).to_numpy()
        if self._dtype.value != _ALL:
            mask &= (frame["dtype"] == self._dtype.value).to_numpy()
        found = frame[mask]
        self.matching = found["key"].tolist()
        self.matching_bytes = int(found["nbytes"].sum())
        self._summary.value = self._summary_html(len(frame))

        keep = self.selected if self.selected in self.matching else None
        listed = self.matching[:MAX_LISTED]
        if keep is not None and keep not in listed:
            listed.append(keep)
        self._set_list(listed, keep)
        if keep is None and self.selected is not None:
            self.selected = None
            self._clear_detail()

    def _set_list(self, options: list[str], value: str | None) -> None:
        """Replace the listed keys without selecting (and reading) anything on the way."""
        self._listing = True
        try:
            self._list.value = None  # with no index, new options don't auto-select the first
            self._list.options = options
            self._list.value = value
        finally:
            self._listing = False

    def _summary_html(self, total: int) -> str:
        all_bytes = int(self.table["nbytes"].sum())
        text = (
            f"<b>{len(self.matching)}</b> of {total} tensors match · "
            f"<b>{human_bytes(self.matching_bytes)}</b> of {human_bytes(all_bytes)}"
        )
        if len(self.matching) > MAX_LISTED:
            text += f" · listing the first {MAX_LISTED}; narrow the filter to see the rest"
        if self.error:
            text += f' · <span style="color:#b00">{html.escape(self.error)}</span>'
        return text

    def _header_html(self) -> str:
        ckpt = self.checkpoint
        text = (
            f"<b>{html.escape(ckpt.format)}</b> checkpoint <code>{html.escape(ckpt.url)}</code>: "
            f"{plural(len(self.table), 'tensor')}, {human_bytes(int(self.table['nbytes'].sum()))}"
        )
        if self.other is not None:
            text += (
                f"<br>compared with <b>{html.escape(self.other.format)}</b> "
                f"<code>{html.escape(self.other.url)}</code>"
            )
        return text

    # -- the selected tensor -----------------------------------------------------------------

    def _on_select(self, change: dict) -> None:
        if self._listing:
            return
        key = change["new"]
        if key is None:
            self.selected = None
            self._clear_detail()
            return
        self._show(key)

    def _clear_detail(self) -> None:
        self.stats = self.diff = self.layout_figure = self.stats_figure = None
        self._meta.value = "<i>Select a tensor to see its chunks and values.</i>"
        self._layout_image.value = b""
        self._hist_image.value = b""
        self._stats_html.value = ""
        self._diff_html.value = ""
        self._progress.layout.display = "none"

    def _show(self, key: str) -> None:
        entry = self.checkpoint.entry(key)
        self._clear_detail()
        self.selected = key
        self.error = None
        self._meta.value = _metadata_html(entry)
        self.layout_figure = _chunk_layout_figure(self.checkpoint, key)
        self._layout_image.value = _png(self.layout_figure)
        self._stats_html.value = "<i>reading…</i>"
        progress = None
        if entry.nbytes >= PROGRESS_BYTES:
            self._progress.value = 0.0
            self._progress.layout.display = None
            progress = self._on_progress
        try:
            self.reads.append(key)
            self.stats = _tensor_stats(self.checkpoint, entry, progress)
        except CheckpointError as exc:
            self.error = str(exc)
            self._stats_html.value = f'<span style="color:#b00">{html.escape(self.error)}</span>'
            return
        finally:
            self._progress.layout.display = "none"
        self.stats_figure = _histogram_figure(self.stats)
        self._hist_image.value = _png(self.stats_figure)
        self._stats_html.value = _stats_html(self.stats)
        if self.other is not None:
            self._diff_html.value = "<i>comparing…</i>"
            try:
                self.diff = self._diff_with_other(key)
            except CheckpointError as exc:
                self.error = str(exc)
                self._diff_html.value = f'<span style="color:#b00">{html.escape(self.error)}</span>'
                return
            self._diff_html.value = _diff_html(self.diff, self.other.url)

    def _on_progress(self, done: int, total: int) -> None:
        self._progress.value = done / total if total else 1.0
        self._progress.description = f"{human_bytes(done)}"

    def _diff_with_other(self, key: str) -> dict[str, Any]:
        """The diff row of ``key`` against :attr:`other` (``status`` ``only_a`` when absent)."""
        name = _glob_escape(map_key(key))
        frame = diff_checkpoints(self.checkpoint, self.other, keys=[name])
        rows = frame[frame["key"] == key]
        return rows.iloc[0].to_dict() if len(rows) else {"key": key, "status": "only_a"}


# -- matching --------------------------------------------------------------------------------


def _key_mask(keys: pd.Series, pattern: str, mode: str) -> np.ndarray:
    """Keys matching ``pattern``: a regex searched anywhere, a glob matched whole, or (a glob
    without wildcards) a plain substring. Raises ``re.error`` for a bad regex."""
    if not pattern:
        return np.ones(len(keys), dtype=bool)
    if mode == "regex":
        regex = re.compile(pattern)
        return np.fromiter((regex.search(k) is not None for k in keys), bool, len(keys))
    if any(c in pattern for c in "*?["):
        regex = re.compile(fnmatch.translate(pattern))
        return np.fromiter((regex.match(k) is not None for k in keys), bool, len(keys))
    return np.fromiter((pattern in k for k in keys), bool, len(keys))


def _glob_escape(key: str) -> str:
    """``key`` as a glob that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", key)


# -- statistics (reads the tensor) -----------------------------------------------------------


def _distinct_chunks(entry: Entry) -> list[Chunk]:
    """One chunk per stored box (replicas dropped), empty ones left out."""
    return [c for c in distinct_chunks(entry.chunks) if c.record is not None and c.numel]


class _Running:
    """Count, extremes, mean and variance (Chan's merge) over blocks; NaN/Inf counted apart."""

    def __init__(self) -> None:
        self.total = self.finite = self.zeros = self.nans = self.infs = 0
        self.mean = self.m2 = 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, values: np.ndarray) -> np.ndarray:
        """Fold in a block of float64 values; returns its finite ones."""
        self.total += values.size
        self.zeros += int(np.count_nonzero(values == 0))
        nan = np.isnan(values)
        inf = np.isinf(values)
        self.nans += int(np.count_nonzero(nan))
        self.infs += int(np.count_nonzero(inf))
        finite = values[~(nan | inf)] if nan.any() or inf.any() else values
        if finite.size:
            n = finite.size
            mean = float(finite.mean())
            m2 = float(np.square(finite - mean).sum())
            both = self.finite + n
            delta = mean - self.mean
            self.mean += delta * n / both
            self.m2 += m2 + delta * delta * self.finite * n / both
            self.finite = both
            self.min = min(self.min, float(finite.min()))
            self.max = max(self.max, float(finite.max()))
        return finite


def _tensor_stats(
    ckpt: Source, entry: Entry, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """min/max/mean/std (over finite values, population std), fractions of zeros/NaN/Inf and a
    histogram, reading ``entry`` one chunk at a time. Complex tensors are summarized by |x|."""
    start = time.perf_counter()
    itemsize = entry.dtype.itemsize
    chunks = _distinct_chunks(entry)
    check_coverage(entry, chunks)  # every element once, or a CoverageError
    total_bytes = entry.numel * itemsize
    step = max(1, math.ceil(entry.numel / HIST_SAMPLE))
    running = _Running()
    samples: list[np.ndarray] = []
    done = 0
    for chunk in chunks:
        raw = ckpt.reader.read_chunk(entry, chunk)
        for begin in range(0, len(raw), tunables.BLOCK_ELEMENTS * itemsize):
            block = raw[begin : begin + tunables.BLOCK_ELEMENTS * itemsize]
            values = tensor_blocks.as_float(block, entry.dtype)
            if values.dtype.kind == "c":
                values = np.abs(values)
            finite = running.add(values)
            samples.append(finite[::step].copy() if step > 1 else finite.copy())
            done += len(block)
            if progress is not None:
                progress(done, total_bytes)
        del raw
    sample = np.concatenate(samples) if samples else np.empty(0)
    counts, edges = np.histogram(sample, bins=HIST_BINS) if sample.size else ([], [])
    n = running.total
    return {
        "key": entry.key,
        "dtype": entry.dtype.name,
        "shape": entry.shape,
        "numel": entry.numel,
        "of": "abs" if entry.dtype.name.startswith("complex") else "value",
        "min": running.min if running.finite else math.nan,
        "max": running.max if running.finite else math.nan,
        "mean": running.mean if running.finite else math.nan,
        "std": math.sqrt(running.m2 / running.finite) if running.finite else math.nan,
        "frac_zero": running.zeros / n if n else math.nan,
        "frac_nan": running.nans / n if n else math.nan,
        "frac_inf": running.infs / n if n else math.nan,
        "hist_counts": [int(c) for c in counts],
        "hist_edges": [float(e) for e in edges],
        "hist_sampled": step > 1,
        "bytes_read": done,
        "seconds": time.perf_counter() - start,
    }


# -- HTML panels -----------------------------------------------------------------------------


def _table(rows: list[tuple], header: tuple | None = None) -> str:
    cell = 'style="padding:1px 8px;text-align:left"'
    head = "".join(f"<th {cell}>{html.escape(str(h))}</th>" for h in header) if header else ""
    body = "".join(
        "<tr>" + "".join(f"<td {cell}>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table>{f'<tr>{head}</tr>' if head else ''}{body}</table>"


def _metadata_html(entry: Entry) -> str:
    shape = "×".join(map(str, entry.shape)) or "scalar"
    facts = (
        f"<b>{html.escape(entry.key)}</b>: {entry.dtype.name}, {shape}, {entry.numel:,} "
        f"elements, {human_bytes(entry.nbytes)}, {entry.n_chunks} chunk(s) in "
        f"{len(entry.chunks)} record(s)"
    )
    rows = []
    for chunk in entry.chunks[:_MAX_CHUNK_ROWS]:
        record = chunk.record
        rows.append(
            (
                "—" if chunk.rank is None else chunk.rank,
                record.file if record else "—",
                ("flat " if chunk.flat else "") + str(list(chunk.offsets)),
                str(list(chunk.sizes)),
                f"{record.offset:,}+{record.length:,}" if record else "—",
            )
        )
    more = len(entry.chunks) - len(rows)
    tail = f"<i>… {more} more chunks</i>" if more > 0 else ""
    return facts + _table(rows, ("rank", "file", "offsets", "sizes", "offset+length")) + tail


def _stats_html(stats: dict[str, Any]) -> str:
    of = "|x| " if stats["of"] == "abs" else ""
    header = (f"{of}min", f"{of}max", f"{of}mean", f"{of}std", "zeros", "NaN", "Inf", "read")
    row = (
        *(f"{stats[name]:.6g}" for name in ("min", "max", "mean", "std")),
        *(f"{100 * stats[name]:.3g}%" for name in ("frac_zero", "frac_nan", "frac_inf")),
        f"{human_bytes(stats['bytes_read'])} in {stats['seconds'] * 1e3:.0f} ms",
    )
    return "<b>statistics</b> (over finite values)" + _table([row], header)


def _diff_html(row: dict[str, Any], other_url: str) -> str:
    status = str(row.get("status"))
    color = "#080" if status in ("equal", "close") else "#b00"
    names = ("max_abs", "mean_abs", "rel_l2", "cosine", "frac_outside")
    values = [row.get(name) for name in names]
    numbers = [f"{v:.6g}" if isinstance(v, float) and not math.isnan(v) else "—" for v in values]
    note = f"<br>{html.escape(str(row['note']))}" if row.get("note") else ""
    return (
        f"<b>diff</b> against <code>{html.escape(other_url)}</code>: "
        f'<b style="color:{color}">{html.escape(status)}</b>{note}' + _table([numbers], names)
    )


# -- pictures (matplotlib, imported on first use) --------------------------------------------


def _figure() -> Figure:
    """A figure outside pyplot: nothing to close, and the inline backend never shows it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(5.0, 3.2), dpi=80, layout="constrained")


def _chunk_layout_figure(checkpoint: Source, key: str) -> Figure:
    fig = _figure()
    plot_chunk_layout(checkpoint, key, ax=fig.add_subplot())
    return fig


def _histogram_figure(stats: dict[str, Any]) -> Figure:
    fig = _figure()
    plot_value_histogram(stats, ax=fig.add_subplot())
    return fig


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
