"""The user-facing :class:`Checkpoint`: tables over the catalog plus lazy reads."""

from __future__ import annotations

import html
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from . import formats
from .catalog import Catalog, Entry
from .errors import KeyNotFoundError
from .formats import Detection
from .reading import Reader
from .storage import Storage

if TYPE_CHECKING:  # pandas is imported on first use: opening a checkpoint does not need it
    import pandas as pd

    from .tables import Summary


def open(
    url: str, *, storage_options: dict[str, Any] | None = None, format: str | None = None
) -> Checkpoint:  # noqa: A001
    """Open the checkpoint at ``url`` (a path or fsspec URL), reading only its metadata.

    ``format`` forces an adapter instead of detecting one; ``storage_options`` go to fsspec.
    """
    storage = Storage(url, storage_options)
    detection = formats.detect(storage, format)
    return Checkpoint(formats.describe(detection), detection)


def open_source(src: str | Checkpoint, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """``src`` itself when it is already an open checkpoint, else :func:`open` it."""
    return src if isinstance(src, Checkpoint) else open(src, storage_options=storage_options)


class Checkpoint:
    """A checkpoint described by its metadata: DataFrames, and tensors read on demand."""

    def __init__(self, catalog: Catalog, detection: Detection) -> None:
        self.catalog = catalog
        self.detection = detection
        self.storage = detection.storage
        self.reader = Reader(self.storage)

    # -- identity --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def format(self) -> str:
        return self.catalog.format

    def keys(self) -> list[str]:
        """Every entry's dotted key, tensors and objects, in checkpoint order."""
        return list(self.catalog.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.catalog.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.catalog.entries

    def __len__(self) -> int:
        return len(self.catalog.entries)

    def entry(self, key: str) -> Entry:
        """The catalog entry of ``key`` (dtype, shape, chunks and their records)."""
        try:
            return self.catalog.entries[key]
        except KeyError:
            raise KeyNotFoundError(f"{self.url}: no entry {key!r}") from None

    # -- tables ----------------------------------------------------------------------------

    @cached_property
    def tensors(self) -> pd.DataFrame:
        """One row per tensor: key, group, dtype, shape, numel, nbytes, n_chunks, sharded_dims."""
        from . import tables

        return tables.tensors_table(self.catalog)

    @cached_property
    def chunks(self) -> pd.DataFrame:
        """One row per stored tensor chunk: offsets/sizes in the tensor, file, byte range, rank."""
        from . import tables

        return tables.chunks_table(self.catalog)

    @cached_property
    def files(self) -> pd.DataFrame:
        """One row per data file: size on disk, records, tensor/object bytes, framing overhead."""
        from . import tables

        return tables.files_table(self.catalog, self.storage.sizes(self.catalog.files))

    @cached_property
    def objects(self) -> pd.DataFrame:
        """One row per non-tensor entry: key, file, nbytes, type and a safe preview (reads them)."""
        from . import tables

        entries = self.catalog.objects()
        values = self.reader.read_objects(entries, tensors="ref") if entries else []
        return tables.objects_table(self.catalog, values)

    def summary(self) -> Summary:
        """Bytes by group, dtype, file and rank, and the parameter count."""
        from . import tables

        return tables.summarize(self.tensors, self.objects, self.files)

    # -- values ----------------------------------------------------------------------------

    def read(self, key: str):
        """The full tensor ``key`` as a ``torch.Tensor``, assembled from its chunks."""
        return self.reader.read_tensor(self._tensor_entry(key))

    def read_numpy(self, key: str):
        """The full tensor as a numpy array, without torch (bfloat16/fp8 as raw unsigned ints)."""
        return self.reader.read_array(self._tensor_entry(key))

    def read_object(self, key: str) -> Any:
        """The non-tensor value ``key``, decoded safely: unknown classes come back as placeholders."""
        entry = self.entry(key)
        if entry.kind != "object":
            raise KeyNotFoundError(f"{self.url}: {key!r} is a tensor; use read()")
        return self.reader.read_objects([entry])[0]

    def _tensor_entry(self, key: str) -> Entry:
        entry = self.entry(key)
        if entry.kind != "tensor":
            raise KeyNotFoundError(f"{self.url}: {key!r} is an object; use read_object()")
        return entry

    # -- display ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        n_tensors = len(self.catalog.tensors())
        return (
            f"<Checkpoint {self.format} {self.url!r}: {n_tensors} tensors, "
            f"{len(self.catalog.entries) - n_tensors} objects, {len(self.catalog.files)} files>"
        )

    def _repr_html_(self) -> str:
        from .tables import human_bytes

        frame = self.tensors
        groups = frame.groupby("group", sort=False)["nbytes"].sum()
        group_text = ", ".join(f"{html.escape(str(g))} {human_bytes(b)}" for g, b in groups.items())
        top = frame.nlargest(5, "nbytes")[["key", "dtype", "shape", "nbytes", "n_chunks"]]
        return (
            f"<div><b>{html.escape(self.format)}</b> checkpoint <code>{html.escape(self.url)}</code><br>"
            f"{len(frame)} tensors ({human_bytes(int(frame['nbytes'].sum()))}), "
            f"{len(self.catalog.entries) - len(frame)} objects, {len(self.catalog.files)} files; "
            f"groups: {group_text}<br>largest tensors:{top.to_html(index=False)}</div>"
        )
