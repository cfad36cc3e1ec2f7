"""Text for a terminal: a checkpoint's names printed with every character a terminal would act
on escaped (a key can hold an escape sequence that retitles the window or sets the clipboard),
and tables and sentences fitted to the terminal's width (the least important columns left out
first, long keys cut in the middle with ``…``) so that no line wraps."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TextIO

__all__ = [
    "ABSENT",
    "DEFAULT_WIDTH",
    "Column",
    "PrintableStream",
    "cut_middle",
    "printable",
    "table",
    "terminal_width",
    "unbroken",
    "wrap",
]

#: Columns assumed when stdout is not a terminal (a pipe, a file, a notebook).
DEFAULT_WIDTH = 100
#: What a table or sentence shows where a value does not exist (a file of no rank, the spread
#: of a single element): never ``nan``, ``<NA>`` or ``None``.
ABSENT = "—"


#: Characters a checkpoint's names may hold that a terminal would act on (C0/C1 controls but
#: newline and tab, DEL, bidirectional overrides): printed escaped, as ``\x1b``.
_UNPRINTABLE = {
    c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    for c in [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(c) not in "\n\t"
}


def printable(text: str) -> str:
    """``text`` with every character a terminal would interpret escaped (names come from the
    checkpoint: a key can hold an escape sequence that retitles the window or sets the
    clipboard)."""
    return text.translate(_UNPRINTABLE)


class PrintableStream:
    """A text stream that escapes what :func:`printable` escapes before writing (the CLI
    points ``sys.stdout`` at one, so nothing it prints reaches the terminal raw)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def terminal_width() -> int:
    """The terminal's columns (``COLUMNS`` when set), :data:`DEFAULT_WIDTH` when stdout is not
    a terminal."""
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def cut_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters in the middle, where ``…`` stands for what was left
    out: both ends of a key say the most (``optimizer.state.exp_a…ddings.weight``)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = width // 2
    tail = width - 1 - head
    return text[:head] + "…" + (text[len(text) - tail :] if tail else "")


def unbroken(text: str) -> str:
    """``text`` that :func:`wrap` keeps on one line (its spaces made non-breaking)."""
    return text.replace(" ", "\xa0")


def wrap(text: str, width: int | None, *, indent: str = "", hang: str = "  ") -> list[str]:
    """A sentence as lines of at most ``width`` columns (``None``: one line), broken at spaces
    only (a path or key is never split; parts joined by :func:`unbroken` stay together); the
    first line starts with ``indent``, the next ones with ``indent + hang``."""
    if width is None:
        return [(indent + text).replace("\xa0", " ")]
    lines = textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent + hang,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace("\xa0", " ") for line in lines] or [indent]


@dataclass(frozen=True)
class Column:
    """A column of a :func:`table`: its header and its cells as text. ``left`` aligns them left
    (names) rather than right (numbers); ``rank`` is how readily the column is left out when
    the table is too wide (0: never; the highest first), and a ``spare`` one goes before any
    cell is cut; ``cut_to`` lets long cells (keys, notes, a label in the header) be cut in the
    middle down to that many characters."""

    header: str
    cells: Sequence[str]
    left: bool = False
    rank: int = 0
    cut_to: int | None = None
    spare: bool = False

    @cached_property
    def natural(self) -> int:
        """The width of the column with every cell whole."""
        return max([len(self.header), *(len(cell) for cell in self.cells)])

    @property
    def narrowest(self) -> int:
        """The width of the column with its cells cut as far as they may be."""
        return self.natural if self.cut_to is None else min(self.natural, self.cut_to)


def table(columns: Sequence[Column], width: int | None) -> list[str]:
    """The lines of a table of ``columns`` (one space between them, no index), at most ``width``
    columns wide (``None``: everything, whole). Too wide, the ``spare`` columns are left out,
    highest ``rank`` first, until it fits whole; then others until it fits with cells cut to
    their ``cut_to`` (what was left out is named on a last line); then the widest cuttable
    cells are cut in the middle, as little as fits. Cells are made :func:`printable` before they
    are measured."""
    shown = [
        replace(c, header=printable(c.header), cells=[printable(v) for v in c.cells])
        for c in columns
    ]
    left_out: list[str] = []
    if width is not None:
        for measure, may_go in (("natural", "spare"), ("narrowest", "rank")):
            while _width(shown, measure) > width and any(getattr(c, may_go) for c in shown):
                going = [c for c in shown if getattr(c, may_go)]
                worst = max(reversed(going), key=lambda c: c.rank)  # ties: the rightmost goes
                shown.remove(worst)
                left_out.append(worst.header)
    widths = [c.natural for c in shown]
    excess = 0 if width is None else _width(shown, "natural") - width
    while excess > 0:  # one character at a time off the widest cuttable column
        cuttable = [i for i, c in enumerate(shown) if widths[i] > c.narrowest]
        if not cuttable:
            break
        widths[max(cuttable, key=lambda i: widths[i])] -= 1
        excess -= 1
    rows = [[c.header for c in shown], *zip(*(c.cells for c in shown), strict=True)]
    lines = [
        " ".join(
            cut_middle(cell, w).ljust(w) if c.left else cut_middle(cell, w).rjust(w)
            for cell, c, w in zip(row, shown, widths, strict=True)
        ).rstrip()
        for row in rows
    ]
    if left_out:
        lines += wrap(
            f"({', '.join(left_out)} left out to fit {width} columns; --wide shows them)",
            width,
            indent="  ",
        )
    return lines


def _width(columns: Sequence[Column], measure: str) -> int:
    """The width of a table of ``columns``, each as wide as its ``measure`` says."""
    return sum(getattr(c, measure) for c in columns) + max(len(columns) - 1, 0)
