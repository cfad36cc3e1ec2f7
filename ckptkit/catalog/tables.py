"""pandas DataFrames over a catalog: tensors, chunks, files, objects, and a summary.

Only ``files`` (sizes on disk) and ``objects`` (previews) touch storage; none reads tensor bytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

import pandas as pd

from ..decoding.bounded_repr import bounded_repr
from ..decoding.unpickler import paused_gc
from ..units import human_bytes, plural
from .accounting import ByteAccount, GroupBytes
from .model import Catalog, Encoding, Entry, shared

__all__ = [
    "PREVIEW_CHARS",
    "tensors_table",
    "chunks_table",
    "files_table",
    "objects_table",
    "preview",
    "Summary",
    "summarize",
    "BYTE_COLUMNS",
    "readable",
    "files_text",
    "bytes_text",
    "alternates_text",
    "missing_text",
    "skipped_lines",
]

PREVIEW_CHARS = 100


def tensors_table(catalog: Catalog) -> pd.DataFrame:
    """One row per tensor: key, group, dtype, shape, numel, nbytes, n_chunks, sharded_dims."""
    rows = [
        (
            entry.key,
            entry.group,
            entry.dtype.name,
            entry.shape,
            entry.numel,
            entry.nbytes,
            entry.n_chunks,
            _sharded_dims(entry),
        )
        for entry in catalog.tensors()
    ]
    columns = ["key", "group", "dtype", "shape", "numel", "nbytes", "n_chunks", "sharded_dims"]
    frame = pd.DataFrame(rows, columns=columns)
    if not rows:  # numbers typed even with no tensors (all left as objects): reports rank them
        frame = frame.astype({"numel": "int64", "nbytes": "int64", "n_chunks": "int64"})
    return frame


def _sharded_dims(entry: Entry) -> tuple[int | str, ...]:
    """Dimensions along which chunks split the tensor (``("flat",)`` for flat shards)."""
    if any(c.flat for c in entry.chunks):
        return ("flat",)
    dims: set[int] = set()
    for sizes in {c.sizes for c in entry.chunks}:
        dims.update(
            d for d, (n, full) in enumerate(zip(sizes, entry.shape, strict=True)) if n != full
        )
    return tuple(sorted(dims))


def chunks_table(catalog: Catalog) -> pd.DataFrame:
    """One row per stored tensor chunk: its box in the tensor and its bytes in a file.

    Built column by column (C-level ``map`` over the chunks) with the GC paused: DCP metadata
    at scale has 500k chunks."""
    with paused_gc(promote=True):
        entries = catalog.tensors()
        chunks = [chunk for entry in entries for chunk in entry.chunks]
        records = [_NO_RECORD if r is None else r for r in map(_RECORD, chunks)]
        sizes = list(map(_SIZES, chunks))
        numel = {box: math.prod(box) for box in set(sizes)}  # the builder checked the boxes
        columns = {
            "key": list(chain.from_iterable(repeat(e.key, len(e.chunks)) for e in entries)),
            "offsets": list(map(_OFFSETS, chunks)),
            "sizes": sizes,
            "numel": list(map(numel.__getitem__, sizes)),
            "rank": pd.array(list(map(_RANK, chunks)), dtype="Int64"),
            "file": list(map(_FILE, records)),
            "offset": pd.array(list(map(_OFFSET, records)), dtype="Int64"),
            "length": list(map(_LENGTH, records)),
            "encoding": list(map(_ENCODING_VALUES.get, map(_ENCODING, records))),
            "transform": list(map(_TRANSFORM, records)),
        }
        return pd.DataFrame(columns)


#: What a chunk without a record shows in the chunks table.
_NO_RECORD = SimpleNamespace(file=None, offset=None, length=0, encoding=None, transform=None)
_RECORD, _OFFSETS, _SIZES, _RANK = (attrgetter(a) for a in ("record", "offsets", "sizes", "rank"))
_FILE, _OFFSET, _LENGTH = attrgetter("file"), attrgetter("offset"), attrgetter("length")
_ENCODING, _TRANSFORM = attrgetter("encoding"), attrgetter("transform")
_ENCODING_VALUES = {encoding: encoding.value for encoding in Encoding}


def files_table(catalog: Catalog, account: ByteAccount) -> pd.DataFrame:
    """One row per data file: size on disk, distinct stored records, their tensor and object
    bytes, and the framing around them (from ``account``: each stored record counted once)."""
    ranks: dict[str, int | None] = {}
    for entry in catalog.entries.values():
        for chunk in entry.chunks:
            if chunk.record is not None:
                ranks.setdefault(chunk.record.file, chunk.rank)
    rows = []
    for file in account.data_files:
        size = account.sizes.get(file)
        counts = account.per_file[file]
        stored = counts.tensor_bytes + counts.object_bytes
        rows.append(
            (
                file,
                ranks.get(file),
                size,
                counts.records,
                counts.tensor_bytes,
                counts.object_bytes,
                size - stored if size is not None else None,
            )
        )
    columns = ["file", "rank", "size", "records", "tensor_bytes", "object_bytes", "overhead_bytes"]
    frame = pd.DataFrame(rows, columns=columns)
    for column in ("rank", "size", "overhead_bytes"):
        frame[column] = frame[column].astype("Int64")
    return frame


def objects_table(catalog: Catalog, values: list[Any] | None) -> pd.DataFrame:
    """One row per stored object record: key, group, file, nbytes, rank, type and a preview."""
    rows = []
    entries = catalog.objects()
    for i, entry in enumerate(entries):
        value = values[i] if values is not None else None
        for chunk in entry.chunks[:1] if values is not None else entry.chunks:
            record = chunk.record
            rows.append(
                (
                    entry.key,
                    entry.group,
                    record.file,
                    record.length if not shared(record) else None,
                    chunk.rank,
                    _type_name(value) if values is not None else None,
                    preview(value) if values is not None else None,
                )
            )
    frame = pd.DataFrame(
        rows, columns=["key", "group", "file", "nbytes", "rank", "type", "preview"]
    )
    frame["rank"] = frame["rank"].astype("Int64")
    return frame


def preview(value: Any) -> str:
    """A short, safe one-line rendering of a decoded object (never calls unknown code)."""
    return bounded_repr(value, items=8, chars=PREVIEW_CHARS)


def _type_name(value: Any) -> str:
    global_name = getattr(type(value), "global_name", None)
    return global_name if global_name else type(value).__name__


@dataclass
class Summary:
    """Totals of a checkpoint: by group, by dtype, by file/rank, and the parameter count.

    Files and bytes are those of its :class:`~ckptkit.catalog.accounting.ByteAccount`, the
    numbers ``inspect``, the reprs and ``compare_sizes`` report too."""

    by_group: pd.DataFrame
    by_dtype: pd.DataFrame
    by_file: pd.DataFrame
    by_rank: pd.DataFrame
    parameters: int
    #: every file the checkpoint consists of: data files plus metadata (``.metadata``, an
    #: index), as ``compare_sizes`` counts them
    total_bytes: int
    #: what ``parameters`` counts: the ``model`` group's elements, or every tensor's when the
    #: checkpoint has no ``model`` group (then optimizer state is counted too)
    counted: str = "model"
    #: data files + metadata files
    files: int = 0
    metadata_bytes: int = 0
    #: bytes of distinct stored tensor / object records, and the framing around them
    tensor_bytes: int = 0
    object_bytes: int = 0
    overhead_bytes: int = 0
    #: groups that re-expose bytes other groups hold (Megatron's ``stacked``): listed in
    #: ``by_group`` with their ``nbytes``, but owning no ``stored_bytes``
    alternate_groups: tuple[str, ...] = ()
    #: a first line no reader may miss: tensors ckptkit left as objects, unread
    #: (:func:`~ckptkit.catalog.model.left_as_objects_warning`); '' when there are none
    warning: str = ""
    #: counted files that are not there (the summary needs only the metadata; ``verify`` says
    #: what each one held)
    missing_files: tuple[str, ...] = ()
    #: files in the checkpoint folder that ckptkit does not read, with why
    #: (:attr:`~ckptkit.catalog.model.Facts.skipped_files`)
    skipped_files: Mapping[str, str] = field(default_factory=dict)
    #: how the checkpoint was found (:attr:`~ckptkit.catalog.model.Facts.notes`)
    found_notes: tuple[str, ...] = ()

    @property
    def ranked(self) -> bool:
        """Whether the files belong to ranks (a sharded save) — else ``by_rank`` says nothing."""
        return bool(self.by_rank.index.notna().any())

    @property
    def parameters_text(self) -> str:
        """``'1,234 parameters in 'model''`` or ``'1,234 elements in all tensors (no 'model'
        group)'``: the count with what it counts, so neither is mistaken for the other."""
        if self.counted == "model":
            return f"{self.parameters:,} parameters in 'model'"
        return f"{self.parameters:,} elements in all tensors (no 'model' group)"

    @property
    def files_text(self) -> str:
        """``'3 files, 1.7 MB on disk'``: what every rendering of a checkpoint says."""
        return files_text(self.files, self.total_bytes)

    @property
    def bytes_text(self) -> str:
        """Where the bytes on disk go: ``'tensors 1.2 MB, objects 4 kB, framing 30 kB,
        metadata 56 kB'``."""
        return bytes_text(
            self.tensor_bytes, self.object_bytes, self.overhead_bytes, self.metadata_bytes
        )

    @property
    def alternates_text(self) -> str:
        """A note naming the alternate groups ('' when there are none)."""
        return alternates_text(self.alternate_groups)

    @property
    def notes(self) -> list[str]:
        """Lines on how the checkpoint was found, then what is not there or not read: missing
        files, then skipped ones."""
        missing = [missing_text(self.missing_files)] if self.missing_files else []
        return [*self.found_notes, *missing, *skipped_lines(self.skipped_files)]

    def _repr_html_(self) -> str:
        parts = [f"<p><b>{html.escape(self.warning)}</b></p>"] if self.warning else []
        parts += [
            f"<p><b>{self.parameters_text}</b>, <b>{html.escape(self.files_text)}</b> "
            f"({html.escape(self.bytes_text)})</p>"
        ]
        parts += [f"<p>{html.escape(line)}</p>" for line in self.notes]
        tables = [("by group", self.by_group), ("by dtype", self.by_dtype)]
        if self.ranked:
            tables.append(("by rank", self.by_rank))
        for title, frame in tables:
            parts.append(f"<h4>{title}</h4>{readable(frame).to_html()}")
            if title == "by group" and self.alternates_text:
                parts.append(f"<p>{html.escape(self.alternates_text)}</p>")
        return "".join(parts)

    def __str__(self) -> str:
        note = f"\n{self.alternates_text}" if self.alternates_text else ""
        text = (
            (f"{self.warning}\n" if self.warning else "")
            + f"{self.parameters_text}, {self.files_text} ({self.bytes_text})"
            + "".join(f"\n{line}" for line in self.notes)
            + f"\n\nby group:\n{self.by_group}{note}\n\nby dtype:\n{self.by_dtype}"
        )
        return text + (f"\n\nby rank:\n{self.by_rank}" if self.ranked else "")


def files_text(files: int, size: int) -> str:
    """``'3 files, 1.7 MB on disk'`` (``'1 file, …'``)."""
    return f"{plural(files, 'file')}, {human_bytes(size)} on disk"


def bytes_text(
    tensor_bytes: int, object_bytes: int, overhead_bytes: int, metadata_bytes: int
) -> str:
    """``'tensors 1.2 MB, objects 4 kB, framing 30 kB, metadata 56 kB'``."""
    return (
        f"tensors {human_bytes(tensor_bytes)}, objects {human_bytes(object_bytes)}, "
        f"framing {human_bytes(overhead_bytes)}, metadata {human_bytes(metadata_bytes)}"
    )


def missing_text(files: Sequence[str], *, shown: int = 4) -> str:
    """``'1 file missing (__1_0.distcp) — run `ckptkit verify`'``: a summary needs only the
    metadata, so a missing data file is a line of it, not an error."""
    names = ", ".join(files[:shown]) + (" …" if len(files) > shown else "")
    noun = "file" if len(files) == 1 else "files"
    return f"{len(files)} {noun} missing ({names}) — run `ckptkit verify`"


def skipped_lines(skipped: Mapping[str, str], *, shown: int = 6, reasons: int = 8) -> list[str]:
    """One line per reason a file is not read, naming the files (at most ``shown`` each, the
    first ``reasons`` reasons): ``'skipped: train/rank0.pt, train/rank1.pt (per-rank trainer
    state beside a DCP: open train/ to read it)'``."""
    by_reason: dict[str, list[str]] = {}
    for name, why in skipped.items():
        by_reason.setdefault(why, []).append(name)
    lines = []
    for why, names in list(by_reason.items())[:reasons]:
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        lines.append(f"skipped: {', '.join(names[:shown])}{more} ({why})")
    if len(by_reason) > reasons:
        rest = sum(len(names) for names in list(by_reason.values())[reasons:])
        lines.append(f"skipped: {rest} more file(s) (--json lists them)")
    return lines


def alternates_text(groups: tuple[str, ...]) -> str:
    """What alternate groups are, for a note under a table that lists them."""
    if not groups:
        return ""
    names = ", ".join(repr(group) for group in groups)
    return (
        f"{names}: alternate view of bytes other groups hold (not counted again in the "
        "stored bytes)"
    )


def summarize(
    tensors: pd.DataFrame,
    objects: pd.DataFrame,
    files: pd.DataFrame,
    account: ByteAccount,
    *,
    warning: str = "",
    skipped: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
) -> Summary:
    """Aggregate the tables; parameters = elements of the ``model`` group (all tensors if none);
    files and bytes are ``account``'s (data and metadata files, each stored record once):
    ``by_group`` has each group's tensor ``nbytes`` (its elements) and the ``stored_bytes`` and
    ``object_bytes`` of the records it is first to view; ``objects`` may hold a row per record
    (objects are counted by key). ``skipped``: the files not read, with why; ``notes``: how
    the checkpoint was found."""
    by_group = (
        tensors.groupby("group", sort=False)
        .agg(tensors=("key", "size"), numel=("numel", "sum"), nbytes=("nbytes", "sum"))
        .join(objects.groupby("group", sort=False).agg(objects=("key", "nunique")), how="outer")
        .fillna(0)
        .astype("int64")
    )
    owned = account.by_group
    by_group.insert(
        3, "stored_bytes", [_owned(owned, group).tensor_bytes for group in by_group.index]
    )
    by_group["object_bytes"] = [_owned(owned, group).object_bytes for group in by_group.index]
    by_group = by_group.astype("int64")
    by_dtype = tensors.groupby("dtype").agg(
        tensors=("key", "size"), numel=("numel", "sum"), nbytes=("nbytes", "sum")
    )
    by_dtype["stored_bytes"] = [account.by_dtype.get(name, 0) for name in by_dtype.index]
    by_file = files.set_index("file")[
        ["rank", "size", "records", "tensor_bytes", "object_bytes", "overhead_bytes"]
    ]
    by_rank = files.groupby("rank", dropna=False)[
        ["size", "records", "tensor_bytes", "object_bytes"]
    ].sum()
    model = tensors[tensors["group"] == "model"]
    parameters = int((model if len(model) else tensors)["numel"].sum())
    counted = "model" if len(model) else "all tensors"
    return Summary(
        by_group, by_dtype, by_file, by_rank, parameters, account.size, counted,
        len(account.files), account.metadata_bytes, account.tensor_bytes, account.object_bytes,
        account.overhead_bytes, account.alternate_groups, warning, tuple(account.missing),
        dict(skipped or {}), tuple(notes),
    )  # fmt: skip


def _owned(owned: Mapping[str, GroupBytes], group: str) -> GroupBytes:
    return owned.get(group) or GroupBytes()


#: Columns that hold byte counts, shown in human units where people read them.
BYTE_COLUMNS = (
    "nbytes",
    "stored_bytes",
    "object_bytes",
    "size",
    "tensor_bytes",
    "overhead_bytes",
    "alternate_bytes",
)


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``frame`` for display: byte columns in human units (``1.2 MB``); the frames
    ckptkit returns keep raw integers for arithmetic."""
    shown = frame.copy()
    for column in BYTE_COLUMNS:
        if column in shown:
            shown[column] = [human_bytes(v) if v == v else "" for v in shown[column]]
    return shown
