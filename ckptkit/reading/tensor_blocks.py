"""Tensors streamed as fixed-size blocks whatever their chunking, and block bytes as float64:
what diff, stats, plots and the browser share to walk a tensor in bounded memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .. import dtypes, tunables
from ..catalog.model import Entry
from ..dtypes import DType
from ..errors import CorruptRecordError
from ..extras import require
from .reader import Reader

__all__ = ["blocks", "aligned_blocks", "ByteStream", "bytes_equal", "as_float"]


def blocks(reader: Reader, entry: Entry) -> Iterator[memoryview]:
    """The tensor's canonical bytes (row-major, little-endian) in blocks of at most
    :data:`~ckptkit.tunables.BLOCK_ELEMENTS` elements, whatever its chunking; a record holding
    more or fewer bytes than the shape needs raises :class:`CorruptRecordError`."""
    stream = ByteStream(reader.iter_bytes(entry), entry.key)
    remaining = entry.numel
    while remaining:
        n = min(tunables.BLOCK_ELEMENTS, remaining)
        yield stream.take(n * entry.dtype.itemsize)
        remaining -= n
    stream.finish()


def aligned_blocks(
    ra: Reader, ea: Entry, rb: Reader, eb: Entry
) -> Iterator[tuple[int, memoryview, memoryview]]:
    """``(n, a_bytes, b_bytes)``: the same ``n`` row-major elements of both tensors, in order."""
    block = tunables.BLOCK_ELEMENTS  # read at call time: tests shrink it
    sa = ByteStream(ra.iter_bytes(ea), ea.key)
    sb = ByteStream(rb.iter_bytes(eb), eb.key)
    remaining = ea.numel
    while remaining:
        n = min(block, remaining)
        yield n, sa.take(n * ea.dtype.itemsize), sb.take(n * eb.dtype.itemsize)
        remaining -= n
    sa.finish()
    sb.finish()


class ByteStream:
    """Fixed-size takes from a stream of byte pieces (copies only when a take spans pieces)."""

    def __init__(self, pieces: Iterator[memoryview], key: str) -> None:
        self.pieces, self.key = pieces, key
        self.piece: memoryview = memoryview(b"")
        self.pos = 0

    def _advance(self) -> None:
        for piece in self.pieces:
            if len(piece):
                self.piece, self.pos = piece.cast("B") if piece.format != "B" else piece, 0
                return
        raise CorruptRecordError(f"{self.key!r}: records hold fewer bytes than the tensor needs")

    def take(self, n: int) -> memoryview:
        if self.pos == len(self.piece):
            self.piece = memoryview(b"")  # drop the spent piece before reading the next
            self._advance()
        if len(self.piece) - self.pos >= n:
            out = self.piece[self.pos : self.pos + n]
            self.pos += n
            return out
        buf = memoryview(np.empty(n, np.uint8))  # fresh: the caller may keep it; not zeroed
        filled = 0
        while filled < n:
            if self.pos == len(self.piece):
                self.piece = memoryview(b"")
                self._advance()
            k = min(n - filled, len(self.piece) - self.pos)
            buf[filled : filled + k] = self.piece[self.pos : self.pos + k]
            filled += k
            self.pos += k
        return buf

    def finish(self) -> None:
        if self.pos != len(self.piece) or any(len(p) for p in self.pieces):
            raise CorruptRecordError(f"{self.key!r}: records hold more bytes than the tensor needs")


def bytes_equal(a: memoryview, b: memoryview) -> bool:
    if len(a) != len(b):
        return False
    word = np.uint64 if len(a) % 8 == 0 else np.uint8
    return bool(np.array_equal(np.frombuffer(a, word), np.frombuffer(b, word)))


_FP8_TABLES: dict[str, np.ndarray] = {}


def as_float(buf: memoryview, dt: DType) -> np.ndarray:
    """Elements of ``dt`` as float64 (complex128 for complex types), exactly."""
    if dt.name == "bfloat16":
        bits = np.frombuffer(buf, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if dt.numpy is None:  # fp8: a 256-entry table made by torch once
        table = _FP8_TABLES.get(dt.name)
        if table is None:
            torch = require("torch", f"decoding {dt.name} values")
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
            table = codes.view(dtypes.to_torch(dt)).to(torch.float64).numpy()
            _FP8_TABLES[dt.name] = table
        return table[np.frombuffer(buf, np.uint8)]
    values = np.frombuffer(buf, dtypes.to_numpy(dt))
    return values.astype(np.complex128 if values.dtype.kind == "c" else np.float64)
