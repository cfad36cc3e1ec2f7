"""Local file reads: exact ranges with ``os.pread`` into one buffer, large ones with
``os.preadv`` into reused buffers (:class:`ReadBuffers`, a reader's pool) or huge-page backed
fresh ones, never a memory map of the file itself; what a non-regular file is, for messages;
folder listings; and which folders a local location may read (itself, a Hugging Face cache
snapshot with its repository's ``blobs/``, the folders the user allows)."""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
import stat
import sys
import threading
from collections.abc import Iterator, Sequence

from .anchored import Root

__all__ = [
    "LARGE_READ_MIN",
    "POOL_BYTES",
    "ReadBuffers",
    "file_kind",
    "folder_sizes",
    "path_sizes",
    "pread",
    "read_large",
    "readable_roots",
]

#: Local ranges at least this large are read into a reused buffer of the calling reader's
#: pool, or an anonymous memory map backed by huge pages where the system allows (see
#: :func:`read_large`); smaller ones into bytes.
LARGE_READ_MIN = 2 << 20
#: Bytes of buffers one :class:`ReadBuffers` pool keeps at most, in use or idle: two batches
#: of records (:data:`~ckptkit.tunables.BATCH_BYTES`), e.g. both column shards of a 64 MiB
#: tensor. A read that does not fit gets a buffer of its own, freed with its last view.
POOL_BYTES = 128 << 20
#: Pooled buffers are sized in steps of this (one huge page), so records of nearly equal
#: lengths (one per rank) share a buffer.
_GRAIN = 2 << 20
#: Largest single ``os.pread`` (Linux transfers at most 2 GiB - 4 KiB per call).
_PREAD_MAX = 1 << 30


def _anonymous(size: int) -> mmap.mmap:
    """Fresh anonymous private memory of ``size`` bytes (page-aligned), asked for huge pages:
    measured on the 1.5 GiB unshard benchmark, 2 MiB pages cut the cost of faulting in fresh
    memory (bytes / bytearray) about 4-fold. Not backed by any file, so nothing can SIGBUS."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def _unviewed_refcount() -> int:
    """What ``sys.getrefcount(buffers[i])`` says of a pooled buffer nothing views (the list's
    reference and the call's), measured the way :meth:`ReadBuffers.lease` asks."""
    buffers = [_anonymous(mmap.PAGESIZE)]
    return sys.getrefcount(buffers[0])


_UNVIEWED = _unviewed_refcount()


class ReadBuffers:
    """A reader's small pool of reused read buffers (page-aligned anonymous memory, asked for
    huge pages), so the hot path does not fault in and unmap fresh memory for every record.

    Lifetime: :meth:`lease` hands out a memoryview of a pooled buffer, and the lease lasts as
    long as any view of that buffer is alive (the memoryview, its slices and casts, numpy
    arrays or tensors over them: each keeps the buffer referenced). A buffer is leased again
    only when nothing but the pool refers to it, so bytes handed out never change under their
    holder, however long it keeps them or whichever thread it hands them to; a holder that
    keeps its view merely makes the next read take another buffer. The pool keeps at most
    ``limit`` bytes of buffers; a read beyond that gets a buffer of its own.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = POOL_BYTES if limit is None else limit
        self._buffers: list[mmap.mmap] = []
        # a reader belongs to one thread, but a lease must never be handed out twice even if
        # one is shared: choosing a buffer and viewing it happen under this lock
        self._lock = threading.Lock()

    def lease(self, length: int) -> memoryview:
        """A writable view of ``length`` bytes (contents undefined) that nothing else views:
        the smallest idle pooled buffer that fits, else a new one (pooled while within
        :attr:`limit`: idle buffers too small for it are dropped first to make room)."""
        with self._lock:
            buffers = self._buffers
            best = -1
            for i in range(len(buffers)):
                if (
                    len(buffers[i]) >= length
                    and sys.getrefcount(buffers[i]) == _UNVIEWED
                    and (best < 0 or len(buffers[i]) < len(buffers[best]))
                ):
                    best = i
            if best >= 0:
                return memoryview(buffers[best])[:length]
            return memoryview(self._new(length))[:length]

    def _new(self, length: int) -> mmap.mmap:
        """A fresh buffer for ``length`` bytes, kept in the pool when it fits within the limit."""
        size = max(_GRAIN, -(-length // _GRAIN) * _GRAIN)
        buffers = self._buffers
        held = sum(len(b) for b in buffers)
        i = 0
        while held + size > self.limit and i < len(buffers):
            if sys.getrefcount(buffers[i]) == _UNVIEWED:  # idle, and too small (else leased)
                held -= len(buffers.pop(i))
            else:
                i += 1
        buffer = _anonymous(size)
        if held + size <= self.limit:
            buffers.append(buffer)
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes of buffers the pool holds (in use or idle)."""
        return sum(len(b) for b in self._buffers)

    @contextlib.contextmanager
    def reading(self) -> Iterator[ReadBuffers]:
        """Within the block, large local reads of this thread (or task) lease from this pool
        (:func:`read_large`), whichever :class:`~ckptkit.storage.Storage` makes them."""
        token = _READING_INTO.set(self)
        try:
            yield self
        finally:
            _READING_INTO.reset(token)


#: The pool large local reads of the current thread lease from (see :meth:`ReadBuffers.reading`).
_READING_INTO: contextvars.ContextVar[ReadBuffers | None] = contextvars.ContextVar(
    "ckptkit_read_buffers", default=None
)


def read_large(fd: int, start: int, length: int) -> memoryview:
    """``length`` bytes of ``fd`` from ``start`` (shorter only where the file ends now), read
    with ``os.preadv`` into a buffer leased from the pool the calling reader made current
    (:meth:`ReadBuffers.reading`), else into fresh anonymous memory (:func:`_anonymous`). Never
    a map of the file, so a file that shrinks cannot SIGBUS."""
    pool = _READING_INTO.get()
    view = memoryview(_anonymous(length)) if pool is None else pool.lease(length)
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
