"""The user-facing :class:`Checkpoint`: tables over the catalog plus lazy reads."""

from __future__ import annotations

import dataclasses
import html
import os
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from . import formats
from .catalog.model import Entry
from .errors import KeyNotFoundError
from .formats import Detection
from .ops.source import Source, open_location
from .storage import Storage

if TYPE_CHECKING:  # pandas is imported on first use: opening a checkpoint does not need it
    import pandas as pd

    from .catalog.accounting import ByteAccount
    from .catalog.tables import Summary


__all__ = ["open", "detect", "Checkpoint"]


def open(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    format: str | None = None,
    cache: Literal["blocks", "files"] | None = None,
    verify_crc: bool = True,
    allow_roots: Sequence[str | os.PathLike[str]] | None = None,
) -> Checkpoint:  # noqa: A001
    """Open the checkpoint at ``url`` (a path or fsspec URL), reading only its metadata.

    ``format`` forces an adapter instead of detecting one; ``storage_options`` go to fsspec.
    ``cache="blocks"`` / ``"files"`` keep what is fetched from a remote store in a local
    temporary cache (fsspec's blockcache / filecache) for repeated reads; None fetches exactly.
    ``verify_crc`` checks every record read against the CRC-32 stored with it (torch.save zip
    members: DCP records, ``*.pt`` storages) and raises :class:`ChecksumError` on a mismatch;
    False skips that for speed (see ``benchmarks/bench_crc.py`` for its cost).
    A symlink in a local checkpoint may lead only inside it (in a Hugging Face cache snapshot:
    or to that repository's ``blobs/``); ``allow_roots`` names more folders links may lead into,
    e.g. ``allow_roots=["/data/ckpts"]`` for a step folder moved there and linked.

    Args:
        url: the checkpoint: a local path or fsspec URL, of its directory or of its files
            (``model.pt``, ``model.safetensors.index.json``).
        storage_options: fsspec options (credentials, endpoint…) for ``url``.
        format: an adapter name (``"dcp"``, ``"safetensors"``, ``"torch_save"``…) to use
            instead of detecting one; None detects.
        cache: ``"blocks"`` or ``"files"`` to cache remote reads locally; None (default) fetches
            exactly what is read.
        verify_crc: check each record read against its stored CRC-32 (default True).
        allow_roots: more local folders that symlinks in the checkpoint may lead into.

    Returns:
        A :class:`Checkpoint`: its metadata as tables (``tensors``, ``chunks``…), tensors read on
        demand.

    Example:
        >>> ckpt = ckptkit.open("s3://bucket/run/step_1000", storage_options={"anon": False})
        >>> ckpt.format
        'dcp'
        >>> ckpt.tensors.head()
    """
    return open_location(
        Checkpoint,
        url,
        storage_options=storage_options,
        format=format,
        cache=cache,
        verify_crc=verify_crc,
        allow_roots=allow_roots,
    )


def detect(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_roots: Sequence[str | os.PathLike[str]] | None = None,
) -> Detection:
    """Which format is at ``url`` and why (``Detection(format, evidence)``), reading only a
    listing and a few bytes; a location that fits no format raises :class:`FormatError`
    listing what was looked for and what was found.

    Args:
        url: a local path or fsspec URL, of a checkpoint's directory or of its files.
        storage_options: fsspec options (credentials, endpoint…) for ``url``.
        allow_roots: more local folders that symlinks in the checkpoint may lead into.

    Returns:
        A :class:`Detection`: the ``format`` name, the ``evidence`` lines that decided it, and
        the ``files`` named when ``url`` names files rather than a directory.

    Example:
        >>> found = ckptkit.detect("ckpt/step_1000")
        >>> found.format, found.evidence[0]
    """
    return formats.detect(Storage(url, storage_options, allow_roots=allow_roots))


class Checkpoint(Source):
    """A checkpoint described by its metadata: DataFrames, and tensors read on demand.

    A :class:`~ckptkit.source.Source` (``catalog``, ``reader``, ``storage``, ``detection``,
    ``url``, ``format``, ``entry()``), so every operation takes it as it is.
    """

    # -- identity --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every entry's dotted key, tensors and objects, in checkpoint order."""
        return list(self.catalog.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.catalog.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.catalog.entries

    def __len__(self) -> int:
        return len(self.catalog.entries)

    # -- tables ----------------------------------------------------------------------------

    @cached_property
    def tensors(self) -> pd.DataFrame:
        """One row per tensor: key, group, dtype, shape, numel, nbytes, n_chunks, sharded_dims."""
        from .catalog import tables

        return tables.tensors_table(self.catalog)

    @cached_property
    def chunks(self) -> pd.DataFrame:
        """One row per stored tensor chunk: offsets/sizes in the tensor, file, byte range, rank."""
        from .catalog import tables

        return tables.chunks_table(self.catalog)

    @cached_property
    def files(self) -> pd.DataFrame:
        """One row per data file: size on disk, records, tensor/object bytes, framing overhead."""
        from .catalog import tables

        return tables.files_table(self.catalog, self._byte_account)

    @cached_property
    def objects(self) -> pd.DataFrame:
        """One row per non-tensor entry: key, file, nbytes, type and a safe preview (reads them)."""
        from .catalog import tables

        entries = self.catalog.objects()
        values = self.reader.read_objects(entries, tensors="ref") if entries else []
        return tables.objects_table(self.catalog, values)

    def summary(self) -> Summary:
        """Bytes by group, dtype, file and rank, and the parameter count, from the metadata
        alone (no value is read: a missing data file is a line of it, not an error), with the
        files ckptkit does not read."""
        from .catalog import tables
        from .catalog.model import left_as_objects_warning

        warning = left_as_objects_warning(self.catalog.entries.values())
        objects = tables.objects_table(self.catalog, None)  # keys and groups, no values
        return tables.summarize(
            self.tensors,
            objects,
            self.files,
            self._byte_account,
            warning=warning,
            skipped=self.catalog.facts.skipped_files,
            notes=self.catalog.facts.notes,
        )

    @cached_property
    def _byte_account(self) -> ByteAccount:
        """Files and bytes (:func:`~ckptkit.ops.sizes.byte_account`), looked up once for the
        files table, the summary and the HTML repr."""
        from .ops.sizes import byte_account

        return byte_account(self)

    # -- values ----------------------------------------------------------------------------

    def read(self, key: str, *, rank: int | None = None):
        """The full tensor ``key`` as a ``torch.Tensor``, assembled from its chunks.

        ``rank`` picks one rank's copy of a value every rank saved (per-rank files hold e.g.
        their own ``step``); by default the first copy (rank 0's) is read.
        """
        return self.reader.read_tensor(self._on_rank(self._tensor_entry(key), rank))

    def read_numpy(self, key: str, *, rank: int | None = None):
        """The full tensor as a numpy array, without torch (bfloat16/fp8 as raw unsigned ints)."""
        return self.reader.read_array(self._on_rank(self._tensor_entry(key), rank))

    def read_object(self, key: str, *, rank: int | None = None, trust: bool = False) -> Any:
        """The non-tensor value ``key``, decoded safely: common classes as real values
        (``argparse.Namespace``, ``SimpleNamespace``, ``collections`` types, numpy values,
        OmegaConf configs as dicts and lists, ``torch.device`` as a
        :class:`~ckptkit.known_objects.Device`), other classes as placeholders naming them
        (:class:`~ckptkit.unpickler.Opaque`), reference cycles as
        :class:`~ckptkit.known_objects.CycleRef`. Nothing the pickle names is run. Keys of one
        torch.save file are served from its pickle, decoded once.

        ``rank`` picks one rank's copy (e.g. its RNG state in per-rank trainer state).

        ``trust=True`` is an escape hatch for objects the allowlist cannot decode (a custom
        class you need for real): the value is loaded the way torch loads it,
        ``torch.load(weights_only=False)`` / ``pickle.loads``. **WARNING: this runs any code the
        pickle contains** (``os.system``, ``exec``…); a malicious checkpoint then owns your
        process. Use it only on checkpoints you made or whose origin you trust. It applies to
        this one object only: metadata is never loaded this way.
        """
        entry = self.entry(key)
        if entry.kind != "object":
            raise KeyNotFoundError(f"{self.url}: {key!r} is a tensor; use read()")
        if trust:
            return self.reader.read_object_trusted(self._on_rank(entry, rank))
        return self.reader.read_objects([self._on_rank(entry, rank)])[0]

    def _tensor_entry(self, key: str) -> Entry:
        entry = self.entry(key)
        if entry.kind != "tensor":
            raise KeyNotFoundError(f"{self.url}: {key!r} is an object; use read_object()")
        return entry

    def _on_rank(self, entry: Entry, rank: int | None) -> Entry:
        """``entry`` restricted to the copy ``rank`` saved (all of it when ``rank`` is None)."""
        if rank is None:
            return entry
        chunks = tuple(c for c in entry.chunks if c.rank == rank)
        if not chunks:
            ranks = sorted({c.rank for c in entry.chunks if c.rank is not None})
            raise KeyNotFoundError(
                f"{self.url}: rank {rank} saved no copy of {entry.key!r} (ranks: {ranks})"
            )
        if entry.kind == "tensor" and sum(c.numel for c in chunks) < entry.numel:
            raise KeyNotFoundError(
                f"{self.url}: rank {rank} holds only a shard of {entry.key!r}; read it "
                "without rank= to assemble it"
            )
        return dataclasses.replace(entry, chunks=chunks)

    # -- run config ------------------------------------------------------------------------

    @cached_property
    def config(self) -> Any:
        """The run's config saved beside the checkpoint (OLMo ``config.yaml``, OLMo-core or HF
        ``config.json``), parsed; None when there is none."""
        from .decoding.run_config import read_config

        return read_config(self.storage, self.catalog.facts.config_file)

    @cached_property
    def config_table(self) -> pd.DataFrame:
        """:attr:`config` flattened: one row per value, ``key`` dotted (``model.d_model``)."""
        from .decoding.run_config import config_table

        return config_table(self.config)

    def verify(self, *, crc: bool = True, workers: int = 1) -> pd.DataFrame:
        """Check the whole checkpoint for damage: every file there with the sizes its records
        need, every record parsing and matching the metadata, CRC-32 of every stored record
        (``crc=False`` skips that), every tensor covered once by its chunks. Reads all data,
        on ``workers`` threads (and across the ranks of an initialised process group).

        Returns one row per problem (``file, key, problem, detail``); empty when it is sound.
        """
        from .ops.verify import verify_checkpoint

        return verify_checkpoint(self, crc=crc, workers=workers)

    # -- display ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        from .catalog.accounting import counted_files
        from .units import plural

        n_tensors = len(self.catalog.tensors())
        n_files = sum(map(len, counted_files(self.catalog)))
        return (
            f"<Checkpoint {self.format} {self.url!r}: {plural(n_tensors, 'tensor')}, "
            f"{plural(len(self.catalog.entries) - n_tensors, 'object')}, "
            f"{plural(n_files, 'file')}>"
        )

    def _repr_html_(self) -> str:
        from .catalog.tables import alternates_text, bytes_text, files_text
        from .units import human_bytes, plural

        account = self._byte_account
        frame = self.tensors
        alternates = account.alternate_groups
        groups = ", ".join(
            f"{html.escape(str(group))} {human_bytes(owned.tensor_bytes + owned.object_bytes)}"
            for group, owned in account.by_group.items()
        )
        stored = frame[~frame["group"].isin(alternates)]
        top = stored.nlargest(5, "nbytes")[["key", "dtype", "shape", "nbytes", "n_chunks"]]
        note = f"<br>{html.escape(alternates_text(alternates))}" if alternates else ""
        bytes_line = bytes_text(
            account.tensor_bytes, account.object_bytes, account.overhead_bytes,
            account.metadata_bytes,
        )  # fmt: skip
        return (
            f"<div><b>{html.escape(self.format)}</b> checkpoint <code>{html.escape(self.url)}</code><br>"
            f"{plural(len(frame), 'tensor')}, "
            f"{plural(len(self.catalog.entries) - len(frame), 'object')}, "
            f"{files_text(len(account.files), account.size)} ({bytes_line}); "
            f"stored by group: {groups}{note}<br>largest tensors:{top.to_html(index=False)}</div>"
        )
