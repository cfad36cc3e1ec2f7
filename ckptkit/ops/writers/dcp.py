"""DCP output: data files ``__0_0.distcp``, ``__1_0.distcp``… plus a ``.metadata`` that torch's
own ``dcp.load`` reads; every record's place is planned first, so the files are written at once.

Chunks keep their boxes. A record already in torch.save form (any byte transform) is copied
byte for byte; anything else is re-encoded as one torch.save record per chunk. The metadata is
pickled with torch's own classes, since its reader is torch.
"""

from __future__ import annotations

import functools
import io
import pickle
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ...catalog.model import Chunk, Encoding, Entry
from ...dtypes import DType
from ...errors import MismatchError
from ...extras import require
from . import torch_save

__all__ = [
    "METADATA",
    "PlannedRecord",
    "data_file",
    "metadata_bytes",
    "plan_records",
    "write_records",
]

METADATA = ".metadata"
_DESCRIPTORS = {"zstd": "stream.zstd/1"}


def data_file(index: int) -> str:
    """The name of data file ``index`` (``__0_0.distcp`` first)."""
    return f"__{index}_0.distcp"


@dataclass
class PlannedRecord:
    """Where one chunk (or object) goes in a data file, known before anything is written:
    copied byte for byte (``copy``), encoded as a torch.save record of the chunk, or an
    object's pickled ``data``."""

    entry: Entry
    chunk: Chunk | None
    file: str
    offset: int
    length: int
    transform: str | None = None
    copy: bool = False
    data: bytes | None = None


def plan_records(
    files: list[list[Entry]], object_value: Callable[[Entry], Any]
) -> list[list[PlannedRecord]]:
    """The records of each data file's entries (``files[i]`` go to :func:`data_file` ``(i)``),
    each record's offset and length computed up front (a stored torch.save record keeps its
    length, a chunk to encode gets the size of its torch.save record, an object is pickled
    now): so the files may be written at once, by any worker or rank, and the ``.metadata``
    before any of them."""
    planned = []
    for index, entries in enumerate(files):
        name, offset, records = data_file(index), 0, []
        for entry in entries:
            if entry.kind == "object":
                buffer = io.BytesIO()
                torch_save.write(buffer, object_value(entry), lambda slot: ())
                data = buffer.getvalue()
                records.append(PlannedRecord(entry, None, name, offset, len(data), data=data))
                offset += len(data)
                continue
            for chunk in _boxes(entry):
                record = chunk.record
                if record is not None and record.encoding is Encoding.TORCH_SAVE:
                    length, transform, copy = record.length, record.transform, True
                else:
                    length, transform, copy = _encoded_size(entry.dtype, chunk.sizes), None, False
                records.append(PlannedRecord(entry, chunk, name, offset, length, transform, copy))
                offset += length
        planned.append(records)
    return planned


def write_records(
    stream: BinaryIO,
    records: list[PlannedRecord],
    *,
    copy_record: Callable[[Entry, Chunk], bytes],
    chunk_bytes: Callable[[Entry, Chunk], Iterable[bytes | memoryview]],
) -> None:
    """Write one data file's planned ``records`` in order, each checked to land where the
    ``.metadata`` says it is."""
    for planned in records:
        start = stream.tell()
        entry, chunk = planned.entry, planned.chunk
        if planned.data is not None:
            stream.write(planned.data)
        elif planned.copy:
            stream.write(copy_record(entry, chunk))
        else:
            slot = torch_save.TensorSlot(entry.dtype, chunk.sizes)
            torch_save.write(stream, slot, lambda _slot, c=chunk, e=entry: chunk_bytes(e, c))
        if (start, stream.tell() - start) != (planned.offset, planned.length):
            raise MismatchError(
                f"{planned.file}: the record of {entry.key!r} took bytes "
                f"{start}-{stream.tell()}, planned {planned.offset}-"
                f"{planned.offset + planned.length}"
            )


@functools.lru_cache(maxsize=4096)
def _encoded_size(dtype: DType, shape: tuple[int, ...]) -> int:
    """The bytes of one tensor's torch.save record (as :func:`torch_save.write` writes it)."""
    return torch_save.RangedZip(torch_save.TensorSlot(dtype, shape)).size


def _boxes(entry: Entry) -> list[Chunk]:
    """The chunks to write: replicas dropped, empty ones skipped; flat shards (not boxes in
    DCP's sense) become one chunk covering the whole tensor."""
    if any(c.flat for c in entry.chunks):
        return [Chunk((0,) * len(entry.shape), entry.shape, None)]
    seen: dict[tuple, Chunk] = {}
    for chunk in entry.chunks:
        seen.setdefault((chunk.offsets, chunk.sizes), chunk)
    return [c for c in seen.values() if c.numel or c.record is not None]


def metadata_bytes(records: Iterable[PlannedRecord], entries: list[Entry]) -> bytes:
    """``.metadata`` for the planned records, pickled with torch's own classes."""
    torch = require("torch", "writing DCP metadata (convert to='dcp')")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata: dict[str, Any] = {}
    for entry in entries:
        if entry.kind == "object":
            state_dict_metadata[entry.key] = BytesStorageMetadata()
        else:
            dtype = getattr(torch, entry.dtype.name)
            state_dict_metadata[entry.key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(entry.shape), []
            )
    storage_data = {}
    for record in records:
        info = _StorageInfo(
            record.file,
            record.offset,
            record.length,
            transform_descriptors=[_DESCRIPTORS[record.transform]] if record.transform else None,
        )
        key = record.entry.key
        if record.chunk is None:
            storage_data[MetadataIndex(key)] = info
            continue
        chunks = state_dict_metadata[key].chunks
        chunks.append(
            ChunkStorageMetadata(torch.Size(record.chunk.offsets), torch.Size(record.chunk.sizes))
        )
        storage_data[MetadataIndex(key, record.chunk.offsets, len(chunks) - 1)] = info
    metadata = Metadata(
        state_dict_metadata,
        planner_data={e.key: e.path for e in entries},
        storage_data=storage_data,
        storage_meta=StorageMeta(save_id=str(uuid.uuid4())),
        version="1.0.0",
    )
    return pickle.dumps(metadata)
