"""UNSAFE, kept apart on purpose: an object entry loaded by torch itself
(``torch.load(weights_only=False)``) or by ``pickle.loads``, which EXECUTES whatever code the
checkpoint's pickle names. Everything else in ckptkit decodes pickles without running them;
this is only for checkpoints whose origin you trust (``read_object(trust=True)``, see
:meth:`ckptkit.Checkpoint.read_object`)."""

from __future__ import annotations

from typing import Any

from ..catalog.model import Encoding, Entry, leaf_path
from ..decoding.pickle_limits import OBJECT_LIMITS
from ..decoding.records import undo_transform
from ..decoding.run_config import parse_document
from ..errors import FormatError
from ..extras import require
from .fetch import RecordFetcher
from .objects import walk

__all__ = ["TRUSTED_FILE_LIMIT", "read_object_trusted"]

#: ``read_object(trust=True)`` loads a whole torch.save file: bounded by its real size only.
TRUSTED_FILE_LIMIT = 1 << 62


def read_object_trusted(reader: RecordFetcher, entry: Entry) -> Any:
    """UNSAFE: ``entry``'s value as torch itself loads it (``torch.load(weights_only=False)``
    or ``pickle.loads``), which runs whatever code the pickle names. Only for checkpoints
    whose origin you trust; see :meth:`ckptkit.Checkpoint.read_object`."""
    import io
    import pickle

    torch = require("torch", "read_object(trust=True)")

    record = entry.chunks[0].record if entry.kind == "object" and entry.chunks else None
    if record is None:
        raise FormatError(f"{entry.key!r} is not an object entry")
    source = f"{reader.storage.describe(record.file)} @{record.offset} ({entry.key})"
    if record.encoding is Encoding.TORCH_SAVE:
        (blob,) = reader.read_ranges(
            [(record.file, record.offset, record.offset + record.length)], entry.key
        )
        raw = undo_transform(blob, record.transform, source, limit=OBJECT_LIMITS.max_bytes)
        return torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")
    if record.encoding is Encoding.PICKLE_LEAF:
        whole = torch.load(
            io.BytesIO(reader.storage.read_file(record.file, max_bytes=TRUSTED_FILE_LIMIT)),
            weights_only=False,
            map_location="cpu",
        )
        return walk(whole, leaf_path(record), source)
    if record.encoding is Encoding.PICKLE_BYTES:
        (blob,) = reader.read_ranges(
            [(record.file, record.offset, record.offset + record.length)], entry.key
        )
        path = leaf_path(record)
        return walk(pickle.loads(blob), path, source)
    if record.encoding is Encoding.DOCUMENT:  # nothing to run: parsed as always
        (blob,) = reader.read_ranges(
            [(record.file, record.offset, record.offset + record.length)], entry.key
        )
        return walk(parse_document(blob, record.file, source), leaf_path(record), source)
    raise FormatError(f"{source}: no trusted loader for {record.encoding.value} records")
