"""A pickle read from a stream in pieces: the pieces are scanned (see
:func:`~ckptkit.decoding.pickle_limits.scan_pieces`), then fed to the unpickler, which lets go
of each piece once it has consumed it, so a large pickle is never held whole next to what it
builds."""

from __future__ import annotations

import collections
import io
from typing import Any, BinaryIO

__all__ = ["PIECE", "STREAM_BUFFER", "PiecesReader", "read_pieces", "stream_over"]

#: Bytes read from a stream at a time (the unit the unpickler releases), and buffered for it.
PIECE = 4 << 20
STREAM_BUFFER = 1 << 20


def read_pieces(stream: BinaryIO, limit: int) -> list[bytes]:
    """At most ``limit`` bytes of ``stream``, in pieces of :data:`PIECE` bytes
    (``read(limit)`` would allocate the whole limit up front)."""
    pieces, total = [], 0
    while total < limit:
        piece = stream.read(min(PIECE, limit - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return pieces


class PiecesReader(io.RawIOBase):
    """A raw stream over scanned pieces that lets go of each piece once it has been read."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = collections.deque(pieces)
        self.at = 0  # read position in the first piece

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view) and self.pieces:
            piece = self.pieces[0]
            n = min(len(view) - done, len(piece) - self.at)
            view[done : done + n] = memoryview(piece)[self.at : self.at + n]
            done, self.at = done + n, self.at + n
            if self.at == len(piece):
                self.pieces.popleft()
                self.at = 0
        return done


def stream_over(pieces: list[bytes]) -> BinaryIO:
    """A binary stream of the pieces joined: one piece shared as it is (no copy), several read
    through a :class:`PiecesReader` (each dropped once read)."""
    if len(pieces) == 1:
        return io.BytesIO(pieces[0])
    return io.BufferedReader(PiecesReader(pieces), STREAM_BUFFER)
