"""Plain-text reports of a checkpoint, a diff, a sizes table, a verification and statistics:
what the ``ckptkit`` command prints, as functions notebooks and scripts can call
(``print(inspect_text(ckpt))``). Each fits the terminal's width (``width``, by default the
terminal's or 100 columns: long keys cut in the middle, the least telling columns left out)
unless ``wide``; a value that does not exist shows as ``—``, never ``nan`` or ``<NA>``. The
``--json`` / ``--csv`` renderings are in :mod:`.machine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..units import plural
from .terminal import ABSENT, Column, cut_middle, table, terminal_width, unbroken, wrap

if TYPE_CHECKING:
    import pandas as pd

    from ..checkpoint import Checkpoint
    from ..ops.convert import UnshardResult

__all__ = [
    "DIFF_LIST_CAP",
    "diff_text",
    "inspect_text",
    "sizes_text",
    "stats_text",
    "unshard_text",
    "verify_text",
]


#: Keys listed per status in ``diff``'s text output unless ``--all`` is given.
DIFF_LIST_CAP = 20
#: Narrowest a key (a diff's note) is cut to, in the middle, before columns are left out.
_KEY_FLOOR = 40
_NOTE_FLOOR = 30


def _limit(wide: bool, width: int | None) -> int | None:
    """The width lines are fitted to: none when ``wide``, else ``width`` or the terminal's."""
    if wide:
        return None
    return width if width is not None else terminal_width()


def _missing(value: object) -> bool:
    """Whether ``value`` is absent: None, NaN or ``pd.NA``."""
    if value is None:
        return True
    try:
        return bool(value != value)
    except (TypeError, ValueError):  # pd.NA is neither equal nor unequal to itself
        return True


def _text(value: object) -> str:
    """A cell of a summary table: the value as text, :data:`~.terminal.ABSENT` when absent; a
    tuple as pandas shows one (``(flat,)``, not ``('flat',)``)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return ABSENT if _missing(value) else str(value)


def _sentence(text: str, width: int | None, indent: str = "") -> list[str]:
    """``text``, parts joined by ``', '``, as lines broken only after its commas."""
    return wrap(", ".join(unbroken(part) for part in text.split(", ")), width, indent=indent)


def diff_text(
    frame: pd.DataFrame,
    same: bool | None = None,
    *,
    show_all: bool = False,
    wide: bool = False,
    width: int | None = None,
) -> str:
    """A human report of a :func:`ckptkit.diff` frame: verdict and counts, then the keys of each
    status that is not ``equal``, worst first, at most :data:`DIFF_LIST_CAP` per status unless
    ``show_all``. ``same`` (the verdict) defaults to "every row equal or close". Lines fit
    ``width`` (keys and notes cut in the middle, then columns left out) unless ``wide``.

    Args:
        frame: a frame returned by :func:`ckptkit.diff` (its ``attrs`` name ``a``, ``b`` and
            the tolerances).
        same: the verdict printed; None (default) computes it from the statuses.
        show_all: list every key of every status, ``equal`` ones included (default False).
        wide: never cut or drop anything to fit a width (default False).
        width: the line width to fit; None (default) uses the terminal's (100 when not a terminal).

    Returns:
        The report as one string of lines, without a trailing newline.

    Example:
        >>> frame = ckptkit.diff("ckpt/step_1000", "release/model.safetensors")
        >>> print(ckptkit.diff_text(frame, width=120))
    """
    from ..ops.diff import SAME, STATUSES

    if same is None:
        same = bool(frame["status"].isin(SAME).all())

    limit = _limit(wide, width)
    counts = frame["status"].value_counts()
    ordered = [status for status in reversed(STATUSES) if status in counts]
    verdict = "equal within tolerance" if same else "DIFFERENT"
    parts = [f"{counts[status]} {status}" for status in ordered] or ["none"]
    parts[-1] += f" -> {verdict}"  # the verdict stays beside the last count
    tolerance = f"(rtol={frame.attrs.get('rtol')}, atol={frame.attrs.get('atol')}):"
    summary = unbroken(f"{plural(len(frame), 'key')} {tolerance}") + " "
    lines = [
        f"a: {frame.attrs.get('a')}",
        f"b: {frame.attrs.get('b')}",
        *wrap(summary + ", ".join(unbroken(part) for part in parts), limit),
    ]
    for status in ordered:
        if status == "equal" and not show_all:
            continue
        rows = frame[frame["status"] == status]
        shown = rows if show_all else rows.head(DIFF_LIST_CAP)
        lines += ["", f"{status} ({len(rows)}):", *_diff_table(shown, limit)]
        if len(shown) < len(rows):
            lines.append(f"  … and {len(rows) - len(shown)} more (--all lists them)")
    return "\n".join(lines)


#: How readily each column of a diff table is left out to fit (0: never; highest first), and
#: the spare ones, left out before a key is cut.
_DIFF_RANKS = {"key": 0, "note": 0, "shape": 1, "max_abs": 2, "rel_l2": 3, "dtype": 4,
               "cosine": 5, "frac_outside": 6}  # fmt: skip
_DIFF_SPARE = ("cosine", "frac_outside")


def _diff_table(rows: pd.DataFrame, width: int | None) -> list[str]:
    """The rows of one status, with the columns that say something for it (no dtype and shape
    for objects)."""
    names = ["key", "dtype", "shape"]
    if rows["max_abs"].notna().any():
        names += ["max_abs", "rel_l2", "cosine", "frac_outside"]
    if rows["note"].astype(bool).any():
        names.append("note")
    floors = {"key": _KEY_FLOOR, "note": _NOTE_FLOOR}
    columns = []
    for name in names:
        cells = [_cell(value) for value in rows[name]]
        if name == "key" or any(cells):
            left = name in ("key", "dtype", "note")
            rank, spare, floor = _DIFF_RANKS[name], name in _DIFF_SPARE, floors.get(name)
            columns.append(Column(name, cells, left=left, rank=rank, cut_to=floor, spare=spare))
    return table(columns, width)


def _cell(value: object) -> str:
    """A table cell: floats to 3 significant digits, missing values blank."""
    if _missing(value):
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def sizes_text(frame: pd.DataFrame, *, wide: bool = False, width: int | None = None) -> str:
    """A :func:`ckptkit.compare_sizes` frame as text, one column per checkpoint, byte counts in
    kB/MB/GB; labels cut in the middle to fit ``width`` unless ``wide``.

    Args:
        frame: a frame returned by :func:`ckptkit.compare_sizes`.
        wide: never cut or drop anything to fit a width (default False).
        width: the line width to fit; None (default) uses the terminal's (100 when not a terminal).

    Returns:
        The table as one string: a row per column of ``frame``, a column per checkpoint.

    Example:
        >>> sizes = ckptkit.compare_sizes("ckpt/step_1000", "release/")
        >>> print(ckptkit.sizes_text(sizes))
    """
    from ..units import human_bytes

    def shown(row: str, value: object) -> str:
        if _missing(value):
            return ABSENT
        if row == "ratio":
            return f"{value:.3f}x"
        return str(value) if row in ("format", "files", "records") else human_bytes(value)

    rows = [str(row) for row in frame.columns]
    columns = [Column(str(frame.index.name or ""), rows, left=True)]
    for label, values in zip(frame.index, frame.itertuples(index=False), strict=True):
        cells = [shown(row, value) for row, value in zip(rows, values, strict=True)]
        columns.append(Column(str(label), cells, cut_to=12))
    return "\n".join(table(columns, _limit(wide, width)))


def inspect_text(
    ckpt: Checkpoint, *, top: int = 10, wide: bool = False, width: int | None = None
) -> str:
    """A human summary of a checkpoint (what ``ckptkit inspect`` prints): totals, where the bytes
    on disk go, bytes by group, dtype and rank, and the ``top`` largest stored tensors (not the
    alternate views of :attr:`~ckptkit.catalog.model.Facts.alternate_groups`). Lines fit
    ``width`` (long keys cut in the middle) unless ``wide``; the warning comes first, whole.

    Args:
        ckpt: an opened checkpoint (from :func:`ckptkit.open`).
        top: how many of the largest stored tensors to list (default 10).
        wide: never cut or drop anything to fit a width (default False).
        width: the line width to fit; None (default) uses the terminal's (100 when not a terminal).

    Returns:
        The summary as one string of lines, without a trailing newline.

    Example:
        >>> ckpt = ckptkit.open("ckpt/step_1000")
        >>> print(ckptkit.inspect_text(ckpt, top=5))
    """
    from ..catalog.tables import readable

    limit = _limit(wide, width)
    summary = ckpt.summary()
    tensors = ckpt.tensors
    stored = tensors[~tensors["group"].isin(summary.alternate_groups)]
    largest = readable(
        stored.nlargest(top, "nbytes")[
            ["key", "dtype", "shape", "nbytes", "n_chunks", "sharded_dims"]
        ]
    )
    counts = [
        plural(len(tensors), "tensor"),
        plural(len(ckpt.catalog.objects()), "object"),
        summary.files_text,  # "3 files, 1.7 MB on disk": kept on one line
        summary.parameters_text,
    ]
    lines = [
        *([summary.warning] if summary.warning else []),  # first, and whole: never missed
        *wrap(f"{ckpt.format} checkpoint {unbroken(str(ckpt.url))}", limit),
        *wrap(", ".join(map(unbroken, counts)), limit, indent="  "),
        *_sentence(f"stored: {summary.bytes_text}", limit, "  "),
        *(part for note in summary.notes for part in wrap(note, limit, indent="  ")),
        "",
        "by group:",
        *_summary_table(readable(summary.by_group), limit),
        *(wrap(summary.alternates_text, limit) if summary.alternate_groups else []),
        "",
        "by dtype:",
        *_summary_table(readable(summary.by_dtype), limit),
        "",
    ]
    if summary.ranked:
        by_rank = readable(summary.by_rank)[["size", "records"]]
        lines += ["by rank:", *_summary_table(by_rank, limit)]
        if by_rank.index.isna().any():  # e.g. a DeepSpeed ZeRO-3 model-states file
            lines += wrap(f"{ABSENT}: files that name no rank", limit, indent="  ")
        lines.append("")
    lines += [f"largest {plural(len(largest), 'tensor')}:", *_largest_table(largest, limit)]
    return "\n".join(lines)


def _summary_table(frame: pd.DataFrame, width: int | None) -> list[str]:
    """A by-group / by-dtype / by-rank table: its index first, named in the header line; the
    last columns left out first."""
    index = Column(str(frame.index.name or ""), [_text(v) for v in frame.index], left=True)
    columns = [
        Column(str(name), [_text(v) for v in frame[name]], rank=rank)
        for rank, name in enumerate(frame.columns, 1)
    ]
    return table([index, *columns], width)


#: How readily each column of inspect's largest tensors is left out (0: never; highest first);
#: none is spare: keys are cut first (the table ends the report, nothing under it).
_LARGEST_RANKS = {"key": 0, "nbytes": 1, "shape": 2, "dtype": 3, "n_chunks": 4, "sharded_dims": 5}


def _largest_table(largest: pd.DataFrame, width: int | None) -> list[str]:
    """inspect's largest tensors, keys cut in the middle to fit."""
    columns = [
        Column(
            name,
            [_text(v) for v in largest[name]],
            left=name in ("key", "dtype"),
            rank=rank,
            cut_to=_KEY_FLOOR if name == "key" else None,
        )
        for name, rank in _LARGEST_RANKS.items()
    ]
    return table(columns, width)


def unshard_text(result: UnshardResult, *, width: int | None = None) -> str:
    """What ``unshard`` / ``convert`` print: the result's report (``str(result)``), a line too
    wide for ``width`` (the terminal's by default) broken at spaces, indented as it was; the
    first line (``wrote … to DST``) stays whole, as scripts read the destination from it."""
    limit = _limit(False, width)
    lines = []
    for number, line in enumerate(str(result).splitlines()):
        if number == 0 or len(line) <= limit:
            lines.append(line)
        else:
            body = line.lstrip(" ")
            lines += wrap(body, limit, indent=line[: len(line) - len(body)])
    return "\n".join(lines)


def verify_text(
    path: str, frame: pd.DataFrame, *, wide: bool = False, width: int | None = None
) -> str:
    """``verify``'s report: the verdict, problems counted per file, then every problem: where
    (a long key cut in the middle to fit ``width`` unless ``wide``) and, below, its whole
    detail (never cut or wrapped: it is what one searches a log for)."""
    if frame.empty:
        return f"{path}: no problems found"
    limit = _limit(wide, width)
    files = frame["file"].fillna("(checkpoint)")
    lines = [f"{path}: {len(frame)} problem(s) in {files.nunique()} file(s)"]
    for file, rows in frame.groupby(files, sort=False):
        kinds = rows["problem"].value_counts()
        lines.append(f"  {file}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()))
    lines.append("")
    for row in frame.itertuples(index=False):
        where = [] if _missing(row.file) else [str(row.file)]
        if not _missing(row.key):
            key = str(row.key)
            if limit is not None:
                used = len(f"{row.problem}: ") + sum(len(part) + 1 for part in where)
                key = cut_middle(key, max(limit - used, _KEY_FLOOR))
            where.append(key)
        lines += [f"{row.problem}: {' '.join(where) or path}", f"    {_text(row.detail)}"]
    return "\n".join(lines)


#: stats columns: (header, frame column, how readily it is left out to fit: highest first,
#: spare: left out before a key is cut; NaN and Inf are also named under the table).
_STATS_COLUMNS = [("min", "min", 4, False), ("max", "max", 5, False),
                  ("mean", "mean", 2, False), ("std", "std", 3, False), ("l2", "l2", 12, True),
                  ("abs_max", "abs_max", 10, True), ("zero %", "frac_zero", 11, True),
                  ("nan %", "frac_nan", 8, True), ("inf %", "frac_inf", 9, True)]  # fmt: skip


def stats_text(frame: pd.DataFrame, *, wide: bool = False, width: int | None = None) -> str:
    """The ``stats`` table: one line per tensor, fractions in percent, fingerprints shortened
    to 16 hex digits (``--json`` has them whole); tensors holding NaN/Inf named after it. A
    statistic that does not exist (the std of one element: a 0-d tensor shows its value as
    min, max and mean) is ``—``. Lines fit ``width`` (keys cut in the middle, then the least
    telling columns left out) unless ``wide``."""

    def number(value: object, scale: float = 1) -> str:
        return ABSENT if _missing(value) else f"{value * scale:.4g}"

    columns = [
        Column("key", [str(key) for key in frame["key"]], left=True, cut_to=_KEY_FLOOR),
        Column("dtype", [str(v) for v in frame["dtype"]], left=True, rank=6),
        Column("shape", [str(list(shape)) for shape in frame["shape"]], rank=1),
    ]
    for header, name, rank, spare in _STATS_COLUMNS:
        cells = [number(v, 100 if name.startswith("frac_") else 1) for v in frame[name]]
        columns.append(Column(header, cells, rank=rank, spare=spare))
    if "fingerprint" in frame:  # asked for: never left out
        prints = [ABSENT if _missing(v) else str(v)[:16] for v in frame["fingerprint"]]
        columns.append(Column("fingerprint", prints, left=True))
    limit = _limit(wide, width)
    counts = [
        plural(len(frame), "tensor"),
        plural(int(frame["numel"].sum()), "element", thousands=True),
    ]
    # the path whole on the first line, the counts after it or, when too long, below it
    head = unbroken(f"{frame.attrs.get('url')} ({frame.attrs.get('format')}):")
    lines = [
        *wrap(" ".join([head, ", ".join(map(unbroken, counts))]), limit),
        *table(columns, limit),
    ]
    bad = frame.loc[(frame["frac_nan"] > 0) | (frame["frac_inf"] > 0), "key"].tolist()
    if bad:
        shown = ", ".join(bad[:10]) + (" …" if len(bad) > 10 else "")
        lines += _sentence(f"{len(bad)} tensor(s) hold NaN or Inf: {shown}", limit)
    if frame.attrs.get("fingerprint"):
        lines.append(f"fingerprint: {frame.attrs['fingerprint']}")
    return "\n".join(lines)
