"""Local file reads: exact ranges with ``os.pread`` into one buffer (huge-page backed for large
ones), never a memory map of the file itself; what a non-regular file is, for messages; folder
listings; and which folders a local location may read (itself, a Hugging Face cache snapshot
with its repository's ``blobs/``, the folders the user allows)."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Sequence

from .anchored import Root

__all__ = [
    "LARGE_READ_MIN",
    "file_kind",
    "folder_sizes",
    "path_sizes",
    "pread",
    "read_large",
    "readable_roots",
]

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


def folder_sizes(fd: int) -> dict[str, int]:
    """The names in the folder ``fd`` mapped to their size in bytes (folders: -1). A link counts
    as what it leads to (0 when broken): a listing gives names and kinds, never bytes, so a
    format is recognised through a link and a read refuses it, naming the link."""
    sizes: dict[str, int] = {}
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                status = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(status.st_mode):
                    status = entry.stat(follow_symlinks=True)
            except FileNotFoundError:  # gone meanwhile
                continue
            except OSError:  # a broken link, or one leading nowhere readable
                sizes[entry.name] = 0
                continue
            sizes[entry.name] = -1 if stat.S_ISDIR(status.st_mode) else status.st_size
    return sizes


def path_sizes(path: str) -> dict[str, int]:
    """:func:`folder_sizes` of the folder ``path`` (links in it followed: the user's, or names
    looked up through a link), or ``{name: size}`` when it is not a folder."""
    status = os.stat(path)
    if not stat.S_ISDIR(status.st_mode):
        return {os.path.basename(path.rstrip("/")): status.st_size}
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return folder_sizes(fd)
    finally:
        os.close(fd)


#: A Hugging Face hub cache: ``…/models--org--name/snapshots/<rev>/…`` (files there are links
#: to ``../../blobs/<sha256>``), beside ``blobs/`` and ``refs/``.
_HF_REPOSITORY = "models--"


def readable_roots(
    location: str, allowed: Sequence[str] = ()
) -> tuple[tuple[Root, ...], tuple[str, ...]]:
    """The folders reads at the local ``location`` may lead into (the first one is where names
    start), and the names from it down to ``location``: the location itself, then ``allowed``.
    Inside a Hugging Face cache snapshot (``models--org--name/snapshots/<rev>``, the repository
    folder holding ``blobs/`` and ``refs/``) it is the snapshot and that repository's
    ``blobs/``, and nothing else of the cache."""
    path = os.path.abspath(location)
    parts = path.split("/")
    extra = tuple(Root(folder) for folder in allowed)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(_HF_REPOSITORY):
            repository = "/".join(parts[:i])
            if all(os.path.isdir(os.path.join(repository, name)) for name in ("blobs", "refs")):
                snapshot = Root("/".join(parts[: i + 2]))
                return (snapshot, Root(repository, ("blobs",)), *extra), tuple(parts[i + 2 :])
            break
    return (Root(path), *extra), ()
