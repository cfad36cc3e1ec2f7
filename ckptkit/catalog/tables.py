"""pandas DataFrames over a catalog: tensors, chunks, files, objects, and a summary.

Only ``files`` (sizes on disk) and ``objects`` (previews) touch storage; none reads tensor bytes.
"""

from __future__ import annotations

import math
import reprlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter
from types import SimpleNamespace
from typing import Any

import pandas as pd

from ..decoding.unpickler import paused_gc
from ..units import human_bytes
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
    "object_bytes_by_group",
]

_preview_repr = reprlib.Repr()
_preview_repr.maxstring = 60
_preview_repr.maxother = 60
_preview_repr.maxlist = _preview_repr.maxtuple = _preview_repr.maxdict = _preview_repr.maxset = 8
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
    return pd.DataFrame(rows, columns=columns)


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


def files_table(catalog: Catalog, sizes: dict[str, int | None]) -> pd.DataFrame:
    """One row per data file: size on disk, records, element and object bytes, framing."""
    records: dict[str, int] = defaultdict(int)
    tensor_bytes: dict[str, int] = defaultdict(int)
    object_bytes: dict[str, int] = defaultdict(int)
    ranks: dict[str, int | None] = {}
    seen: set[tuple[str, int, int]] = set()  # many object leaves can share one pickle record
    for entry in catalog.entries.values():
        for chunk in entry.chunks:
            record = chunk.record
            if record is None:
                continue
            file = record.file
            ranks.setdefault(file, chunk.rank)
            if entry.kind == "tensor":
                records[file] += 1
                tensor_bytes[file] += chunk.numel * entry.dtype.itemsize
            elif (file, record.offset, record.length) not in seen:
                seen.add((file, record.offset, record.length))
                records[file] += 1
                object_bytes[file] += record.length
    rows = []
    for file in catalog.files:
        size = sizes.get(file)
        framing = size - tensor_bytes[file] - object_bytes[file] if size is not None else None
        rows.append(
            (
                file,
                ranks.get(file),
                size,
                records[file],
                tensor_bytes[file],
                object_bytes[file],
                framing,
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
    text = _preview_repr.repr(value)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def _type_name(value: Any) -> str:
    global_name = getattr(type(value), "global_name", None)
    return global_name if global_name else type(value).__name__


@dataclass
class Summary:
    """Totals of a checkpoint: by group, by dtype, by file/rank, and the parameter count."""

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

    def _repr_html_(self) -> str:
        parts = [
            f"<p><b>{self.parameters_text}</b>, <b>{human_bytes(self.total_bytes)}</b> on disk</p>"
        ]
        tables = [("by group", self.by_group), ("by dtype", self.by_dtype)]
        if self.ranked:
            tables.append(("by rank", self.by_rank))
        for title, frame in tables:
            parts.append(f"<h4>{title}</h4>{readable(frame).to_html()}")
        return "".join(parts)

    def __str__(self) -> str:
        text = (
            f"{self.parameters_text}, {self.files} files, {human_bytes(self.total_bytes)} on disk"
            f"\n\nby group:\n{self.by_group}\n\nby dtype:\n{self.by_dtype}"
        )
        return text + (f"\n\nby rank:\n{self.by_rank}" if self.ranked else "")


def summarize(
    tensors: pd.DataFrame,
    objects: pd.DataFrame,
    files: pd.DataFrame,
    metadata_sizes: Mapping[str, int | None] | None = None,
    catalog: Catalog | None = None,
) -> Summary:
    """Aggregate the tables; parameters = elements of the ``model`` group (all tensors if none);
    files and bytes include the metadata files (``metadata_sizes``), and with the ``catalog``
    object bytes count each stored record once, as ``compare_sizes`` counts them."""
    by_group = (
        tensors.groupby("group", sort=False)
        .agg(tensors=("key", "size"), numel=("numel", "sum"), nbytes=("nbytes", "sum"))
        .join(
            objects.groupby("group", sort=False).agg(
                objects=("key", "size"), object_bytes=("nbytes", "sum")
            ),
            how="outer",
        )
        .fillna(0)
        .astype("int64")
    )
    if catalog is not None:
        per_group = object_bytes_by_group(catalog)
        by_group["object_bytes"] = [per_group.get(group, 0) for group in by_group.index]
    by_dtype = tensors.groupby("dtype").agg(
        tensors=("key", "size"), numel=("numel", "sum"), nbytes=("nbytes", "sum")
    )
    by_file = files.set_index("file")[
        ["rank", "size", "records", "tensor_bytes", "object_bytes", "overhead_bytes"]
    ]
    by_rank = files.groupby("rank", dropna=False)[
        ["size", "records", "tensor_bytes", "object_bytes"]
    ].sum()
    model = tensors[tensors["group"] == "model"]
    parameters = int((model if len(model) else tensors)["numel"].sum())
    metadata_bytes = sum(size or 0 for size in (metadata_sizes or {}).values())
    total_bytes = int(files["size"].fillna(0).sum()) + metadata_bytes
    counted = "model" if len(model) else "all tensors"
    n_files = len(files) + len(metadata_sizes or {})
    return Summary(
        by_group, by_dtype, by_file, by_rank, parameters, total_bytes, counted, n_files,
        metadata_bytes,
    )  # fmt: skip


#: Columns that hold byte counts, shown in human units where people read them.
BYTE_COLUMNS = ("nbytes", "object_bytes", "size", "tensor_bytes", "overhead_bytes")


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``frame`` for display: byte columns in human units (``1.2 MB``); the frames
    ckptkit returns keep raw integers for arithmetic."""
    shown = frame.copy()
    for column in BYTE_COLUMNS:
        if column in shown:
            shown[column] = [human_bytes(v) if v == v else "" for v in shown[column]]
    return shown


def object_bytes_by_group(catalog: Catalog) -> dict[str, int]:
    """Bytes of the stored object records per group, each record once (a pickle shared by
    several groups' leaves counts for the first of them): they add up to the files'
    ``object_bytes``."""
    owner: dict[tuple[str, int, int], str] = {}
    for entry in catalog.objects():
        for chunk in entry.chunks:
            record = chunk.record
            if record is not None:
                owner.setdefault((record.file, record.offset, record.length), entry.group)
    totals: dict[str, int] = defaultdict(int)
    for (_, _, length), group in owner.items():
        totals[group] += length
    return dict(totals)
