"""Plain-text reports of a checkpoint, a diff, a sizes table, a verification and statistics:
what the ``ckptkit`` command prints, as functions notebooks and scripts can call
(``print(inspect_text(ckpt))``). The ``--json`` / ``--csv`` renderings are in :mod:`.machine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from ..checkpoint import Checkpoint

__all__ = ["DIFF_LIST_CAP", "diff_text", "inspect_text", "sizes_text", "stats_text", "verify_text"]


#: Keys listed per status in ``diff``'s text output unless ``--all`` is given.
DIFF_LIST_CAP = 20


def diff_text(frame: pd.DataFrame, same: bool | None = None, *, show_all: bool = False) -> str:
    """A human report of a :func:`ckptkit.diff` frame: verdict and counts, then the keys of each
    status that is not ``equal``, worst first, at most :data:`DIFF_LIST_CAP` per status unless
    ``show_all``. ``same`` (the verdict) defaults to "every row equal or close"."""
    from ..ops.diff import SAME, STATUSES

    if same is None:
        same = bool(frame["status"].isin(SAME).all())

    counts = frame["status"].value_counts()
    ordered = [status for status in reversed(STATUSES) if status in counts]
    verdict = "equal within tolerance" if same else "DIFFERENT"
    summary = ", ".join(f"{counts[status]} {status}" for status in ordered)
    lines = [
        f"a: {frame.attrs.get('a')}",
        f"b: {frame.attrs.get('b')}",
        f"{len(frame)} keys (rtol={frame.attrs.get('rtol')}, atol={frame.attrs.get('atol')}): "
        f"{summary or 'none'} -> {verdict}",
    ]
    for status in ordered:
        if status == "equal" and not show_all:
            continue
        rows = frame[frame["status"] == status]
        shown = rows if show_all else rows.head(DIFF_LIST_CAP)
        lines += ["", f"{status} ({len(rows)}):", _diff_table(shown)]
        if len(shown) < len(rows):
            lines.append(f"  … and {len(rows) - len(shown)} more (--all lists them)")
    return "\n".join(lines)


def _diff_table(rows: pd.DataFrame) -> str:
    """The rows of one status, with the columns that say something for it."""
    columns = ["key", "dtype", "shape"]
    if rows["max_abs"].notna().any():
        columns += ["max_abs", "rel_l2", "cosine", "frac_outside"]
    if rows["note"].astype(bool).any():
        columns.append("note")
    table = rows[columns].astype(object)
    for column in columns:
        table[column] = [_cell(value) for value in table[column]]
    return table.to_string(index=False)


def _cell(value: object) -> str:
    """A table cell: floats to 3 significant digits, missing values blank."""
    if value is None or value != value:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def sizes_text(frame: pd.DataFrame) -> str:
    """A :func:`ckptkit.compare_sizes` frame as text, one column per checkpoint, byte counts in
    kB/MB/GB."""
    from ..units import human_bytes

    shown = frame.copy()
    for column in shown.columns:
        if column not in ("format", "files", "records", "ratio"):
            shown[column] = shown[column].map(human_bytes)
    shown["ratio"] = shown["ratio"].map(lambda r: f"{r:.3f}x")
    return shown.T.to_string()


def inspect_text(ckpt: Checkpoint, *, top: int = 10) -> str:
    """A human summary of a checkpoint (what ``ckptkit inspect`` prints): totals, where the bytes
    on disk go, bytes by group, dtype and rank, and the ``top`` largest stored tensors (not the
    alternate views of :attr:`~ckptkit.catalog.model.Facts.alternate_groups`)."""
    from ..catalog.tables import readable

    summary = ckpt.summary()
    tensors = ckpt.tensors
    stored = tensors[~tensors["group"].isin(summary.alternate_groups)]
    largest = readable(
        stored.nlargest(top, "nbytes")[
            ["key", "dtype", "shape", "nbytes", "n_chunks", "sharded_dims"]
        ]
    )
    by_group = readable(summary.by_group)
    by_rank = readable(summary.by_rank)
    note = [summary.alternates_text] if summary.alternate_groups else []
    lines = [
        *([summary.warning] if summary.warning else []),  # first: never missed
        f"{ckpt.format} checkpoint {ckpt.url}",
        f"  {len(tensors)} tensors, {len(ckpt.catalog.objects())} objects, {summary.files_text}, "
        f"{summary.parameters_text}",
        f"  stored: {summary.bytes_text}",
        "",
        "by group:",
        by_group.to_string(),
        *note,
        "",
        "by dtype:",
        readable(summary.by_dtype).to_string(),
        "",
        *(["by rank:", by_rank[["size", "records"]].to_string(), ""] if summary.ranked else []),
        f"largest {len(largest)} tensors:",
        largest.to_string(index=False),
    ]
    return "\n".join(lines)


def verify_text(path: str, frame: pd.DataFrame) -> str:
    """``verify``'s report: the verdict, problems counted per file, then every problem with
    its whole detail (never cut to a column width)."""
    if frame.empty:
        return f"{path}: no problems found"
    files = frame["file"].fillna("(checkpoint)")
    lines = [f"{path}: {len(frame)} problem(s) in {files.nunique()} file(s)"]
    for file, rows in frame.groupby(files, sort=False):
        kinds = rows["problem"].value_counts()
        lines.append(f"  {file}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()))
    lines.append("")
    for row in frame.itertuples(index=False):
        where = " ".join(str(part) for part in (row.file, row.key) if part is not None)
        lines += [f"{row.problem}: {where or path}", f"    {row.detail}"]
    return "\n".join(lines)


def stats_text(frame: pd.DataFrame) -> str:
    """The ``stats`` table: one line per tensor, fractions in percent, fingerprints shortened
    to 16 hex digits (``--json`` has them whole); tensors holding NaN/Inf named after it."""
    columns = ["key", "dtype", "shape", "min", "max", "mean", "std", "l2", "abs_max"]
    table = frame[columns].copy()
    table["shape"] = [str(list(shape)) for shape in frame["shape"]]
    for name in ("zero", "nan", "inf"):
        table[f"{name} %"] = 100 * frame[f"frac_{name}"]
    if "fingerprint" in frame:
        table["fingerprint"] = [str(value)[:16] for value in frame["fingerprint"]]
    head = (
        f"{frame.attrs.get('url')} ({frame.attrs.get('format')}): {len(frame)} tensors, "
        f"{int(frame['numel'].sum()):,} elements"
    )
    lines = [head, table.to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    bad = frame.loc[(frame["frac_nan"] > 0) | (frame["frac_inf"] > 0), "key"].tolist()
    if bad:
        shown = ", ".join(bad[:10]) + (" …" if len(bad) > 10 else "")
        lines.append(f"{len(bad)} tensor(s) hold NaN or Inf: {shown}")
    if frame.attrs.get("fingerprint"):
        lines.append(f"fingerprint: {frame.attrs['fingerprint']}")
    return "\n".join(lines)
