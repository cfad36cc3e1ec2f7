"""DCP output: ``__0_0.distcp`` records plus a ``.metadata`` that torch's own ``dcp.load`` reads.

Chunks keep their boxes. A record already in torch.save form (any byte transform) is copied
byte for byte; anything else is re-encoded as one torch.save record per chunk. The metadata is
pickled with torch's own classes, since its reader is torch.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ...catalog.model import Chunk, Encoding, Entry
from ...extras import require
from . import torch_save

__all__ = ["DATA_FILE", "METADATA", "WrittenRecord", "write_records", "metadata_bytes"]

DATA_FILE = "__0_0.distcp"
METADATA = ".metadata"
_DESCRIPTORS = {"zstd": "stream.zstd/1"}


@dataclass
class WrittenRecord:
    """Where one chunk (or object) landed in the data file."""

    entry: Entry
    chunk: Chunk | None
    offset: int
    length: int
    transform: str | None = None


def write_records(
    stream: BinaryIO,
    entries: Iterable[Entry],
    *,
    copy_record: Callable[[Entry, Chunk], bytes],
    chunk_bytes: Callable[[Entry, Chunk], Iterable[bytes | memoryview]],
    object_value: Callable[[Entry], Any],
) -> list[WrittenRecord]:
    """Append every entry's records to ``stream``: verbatim when already torch.save records."""
    written = []
    for entry in entries:
        if entry.kind == "object":
            start = stream.tell()
            torch_save.write(stream, object_value(entry), lambda slot: ())
            written.append(WrittenRecord(entry, None, start, stream.tell() - start))
            continue
        for chunk in _boxes(entry):
            start = stream.tell()
            record = chunk.record
            if record is not None and record.encoding is Encoding.TORCH_SAVE:
                stream.write(copy_record(entry, chunk))
                transform = record.transform
            else:
                slot = torch_save.TensorSlot(entry.dtype, chunk.sizes)
                torch_save.write(stream, slot, lambda _slot, c=chunk, e=entry: chunk_bytes(e, c))
                transform = None
            written.append(WrittenRecord(entry, chunk, start, stream.tell() - start, transform))
    return written


def _boxes(entry: Entry) -> list[Chunk]:
    """The chunks to write: replicas dropped, empty ones skipped; flat shards (not boxes in
    DCP's sense) become one chunk covering the whole tensor."""
    if any(c.flat for c in entry.chunks):
        return [Chunk((0,) * len(entry.shape), entry.shape, None)]
    seen: dict[tuple, Chunk] = {}
    for chunk in entry.chunks:
        seen.setdefault((chunk.offsets, chunk.sizes), chunk)
    return [c for c in seen.values() if c.numel or c.record is not None]


def metadata_bytes(records: list[WrittenRecord], entries: list[Entry]) -> bytes:
    """``.metadata`` for the written records, pickled with torch's own classes."""
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
            DATA_FILE,
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
