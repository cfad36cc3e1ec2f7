"""Streaming safetensors output: the header from metadata alone, then tensor bytes in order."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from ...dtypes import DType
from ...errors import FormatError

__all__ = ["SafetensorsItem", "data_starts", "header_bytes", "write", "write_item"]


@dataclass(frozen=True)
class SafetensorsItem:
    """One tensor of a safetensors file: its name, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # computed once: plans ask for it several times per tensor (not a field: equality,
        # hashing and repr stay the three fields')
        object.__setattr__(self, "_nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self._nbytes


def header_bytes(items: Sequence[SafetensorsItem], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header (padded to 8 bytes) for ``items`` stored in that order:
    each item's entry formatted directly (what ``json.dumps`` of the header dict writes, a
    fifth of its time), the dict only where it would differ (repeated names)."""
    names = [item.name for item in items]
    if (
        "__metadata__" in names
        or len(set(names)) != len(names)
        or {type(size) for item in items for size in item.shape} - {int}
    ):
        return _header_bytes_by_dict(items, metadata)
    parts = []
    if metadata:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    offset = 0
    for item in items:
        code = item.dtype.safetensors
        if code is None:
            raise FormatError(f"{item.name!r}: safetensors has no {item.dtype.name} dtype")
        end = offset + item.nbytes
        parts.append(
            f'{_json_string(item.name)}:{{"dtype":{_json_string(code)},'
            f'"shape":[{",".join(map(str, item.shape))}],"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


#: A string as ``json.dumps`` writes it (ASCII, escaped).
_json_string = json.encoder.encode_basestring_ascii


def _header_bytes_by_dict(
    items: Sequence[SafetensorsItem], metadata: dict[str, str] | None
) -> bytes:
    """:func:`header_bytes` through the header dict (a later item of the same name replacing
    an earlier one's entry in its place, as the dict does)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for item in items:
        if item.dtype.safetensors is None:
            raise FormatError(f"{item.name!r}: safetensors has no {item.dtype.name} dtype")
        header[item.name] = {
            "dtype": item.dtype.safetensors,
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(
    stream: BinaryIO,
    items: Sequence[SafetensorsItem],
    produce: Callable[[SafetensorsItem], Iterable[bytes | memoryview]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write one safetensors file; ``produce(item)`` yields each tensor's row-major bytes."""
    stream.write(header_bytes(items, metadata))
    total = 0
    for item in items:
        total += write_item(stream.write, item, produce(item))
    return total


def data_starts(header: bytes, items: Sequence[SafetensorsItem]) -> list[int]:
    """Where each item's bytes start in the file ``header`` begins (items in stored order):
    what lets workers write a file's tensors at once, each at its place."""
    starts, offset = [], len(header)
    for item in items:
        starts.append(offset)
        offset += item.nbytes
    return starts


def write_item(
    write: Callable[[bytes | memoryview], object],
    item: SafetensorsItem,
    pieces: Iterable[bytes | memoryview],
) -> int:
    """``write`` each of an item's ``pieces``, in order; refused unless they are exactly its
    bytes."""
    written = 0
    for piece in pieces:
        write(piece)
        written += len(piece)
        del piece  # else the last piece stays alive while the producer builds the next tensor
    if written != item.nbytes:
        raise FormatError(f"{item.name!r}: {written} bytes produced, {item.nbytes} expected")
    return written
