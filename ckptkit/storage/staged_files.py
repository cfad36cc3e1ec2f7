"""Output files under their staging names, whose OSErrors (a full disk, a quota, a read-only
file system…) come out as :class:`DestinationError` naming the final file: a stream written
front to back, or a file written at offsets by several threads (or ranks) at once, each its own
byte ranges with ``os.pwrite`` into the file staged at its full size."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from ..errors import CheckpointError, DestinationError

__all__ = ["RangedFile", "StagedStream", "WritesAtOffsets"]


class WritesAtOffsets:
    """What a file written at offsets (its ``write_at``) adds: a stream writer from a place."""

    write_at: Callable[[int, bytes | memoryview], None]

    def writer_at(self, offset: int) -> Callable[[bytes | memoryview], None]:
        """A ``write`` for a stream of pieces starting at ``offset``, each after the last."""
        position = offset

        def write(data: bytes | memoryview) -> None:
            nonlocal position
            self.write_at(position, data)
            position += memoryview(data).nbytes

        return write


class RangedFile(WritesAtOffsets):
    """An output file under its staging name, pre-sized and written at offsets with
    ``os.pwrite``, so threads write their own byte ranges of it at once; its OSErrors come out
    as :class:`DestinationError` naming the final file."""

    def __init__(
        self,
        fd: int,
        name: str,
        path: str,
        error: Callable[[str, OSError], DestinationError],
        joined: bool = False,
    ) -> None:
        self._fd: int | None = fd
        self.name, self.path, self._error = name, path, error
        self.joined = joined  # another rank's file, opened to write parts of it too
        self._lock = threading.Lock()

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write all of ``data`` at ``offset`` (a range no other thread writes)."""
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.name}: written after it was closed")
        view = memoryview(data).cast("B")
        try:
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as exc:
            raise self._error(self.name, exc) from exc

    @property
    def handle(self) -> str:
        """What another rank passes to join this file: its staged path."""
        return self.path

    def hand_over(self) -> None:
        """Nothing: every rank's bytes are in the file already."""

    def take_over(self, handovers: Iterable[Any]) -> None:
        """Nothing to take: every rank wrote in place."""

    def close(self) -> None:
        """Close the file (again: nothing happens)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                raise self._error(self.name, exc) from exc


class StagedStream:
    """An output file under its staging name whose OSErrors (a full disk, a quota, a read-only
    file system…) come out as :class:`DestinationError` naming the final file."""

    def __init__(
        self, stream: BinaryIO, name: str, error: Callable[[str, OSError], DestinationError]
    ) -> None:
        self._stream, self.name, self._error = stream, name, error

    def _guarded(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except CheckpointError:
            raise
        except OSError as exc:
            raise self._error(self.name, exc) from exc

    def write(self, data: Any) -> int:
        return self._guarded("write", data)

    def writelines(self, lines: Any) -> None:
        return self._guarded("writelines", lines)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._guarded("seek", offset, whence)

    def tell(self) -> int:
        return self._guarded("tell")

    def truncate(self, size: int | None = None) -> int:
        return self._guarded("truncate", size)

    def flush(self) -> None:
        return self._guarded("flush")

    def close(self) -> None:
        return self._guarded("close")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> StagedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the error under way matters more than one from closing
            with contextlib.suppress(OSError):
                self._stream.close()
