"""Local file reads: exact ranges with ``os.pread`` into one buffer (huge-page backed for large
ones), never a memory map of the file itself; and what a non-regular file is, for messages."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat

__all__ = ["LARGE_READ_MIN", "file_kind", "pread", "read_large"]

#: Local ranges at least this large are read into an anonymous memory map backed by huge pages
#: where the system allows (see :func:`read_large`); smaller ones into bytes.
LARGE_READ_MIN = 2 << 20
#: Largest single ``os.pread`` (Linux transfers at most 2 GiB - 4 KiB per call).
_PREAD_MAX = 1 << 30


def read_large(fd: int, start: int, length: int) -> memoryview:
    """``length`` bytes of ``fd`` from ``start`` (shorter only where the file ends now), read
    with ``os.preadv`` into an anonymous private memory map asked for huge pages. Not backed by
    the file, so a file that shrinks cannot SIGBUS; measured on the 1.5 GiB unshard benchmark,
    2 MiB pages cut the cost of faulting in fresh memory (bytes / bytearray) about 4-fold."""
    buffer = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buffer)
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got : got + _PREAD_MAX]], start + got)
        if n == 0:
            break
        got += n
    return view if got == length else view[:got]


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages (``a FIFO``, ``a character device``…)."""
    return next((kind for test, kind in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")


def pread(fd: int, start: int, length: int) -> bytes | bytearray:
    """``length`` bytes of ``fd`` from ``start`` into one buffer, shorter only where the file
    ends now. Up to 1 GiB it is one ``os.pread`` into fresh bytes (no zero-filling, no second
    copy); larger ranges fill one bytearray with ``os.preadv`` (Linux moves < 2 GiB per call)."""
    if length <= 0:
        return b""
    if length <= _PREAD_MAX:
        data = os.pread(fd, length, start)
        if len(data) == length or not data:
            return data
        pieces, got = [data], len(data)  # a short read: the file ended, or a partial transfer
        while got < length and (more := os.pread(fd, length - got, start + got)):
            pieces.append(more)
            got += len(more)
        return b"".join(pieces) if len(pieces) > 1 else data
    buffer = bytearray(length)
    got = 0
    with memoryview(buffer) as view:
        while got < length:
            n = os.preadv(fd, [view[got : got + _PREAD_MAX]], start + got)
            if n == 0:
                break
            got += n
    del buffer[got:]
    return buffer
