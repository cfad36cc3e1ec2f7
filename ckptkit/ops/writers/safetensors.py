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

__all__ = ["SafetensorsItem", "header_bytes", "write"]


@dataclass(frozen=True)
class SafetensorsItem:
    """One tensor of a safetensors file: its name, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header_bytes(items: Sequence[SafetensorsItem], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header (padded to 8 bytes) for ``items`` stored in that order."""
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
        written = 0
        for chunk in produce(item):
            stream.write(chunk)
            written += len(chunk)
            del chunk  # else the last piece stays alive while produce() builds the next tensor
        if written != item.nbytes:
            raise FormatError(f"{item.name!r}: {written} bytes produced, {item.nbytes} expected")
        total += written
    return total
