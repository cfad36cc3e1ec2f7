"""A tar archive read in place as a read-only directory :class:`~ckptkit.storage.Store`.

An uncompressed tar (NeMo's ``.nemo`` files are such archives) is indexed by reading its headers
only (:mod:`~ckptkit.storage.tar_headers`: checked, bounded, every member name checked as any
file name is), and each member is then a byte range of the archive: reads go to the store
holding it (local ``pread`` or exact remote ranges), nothing is extracted or copied, so every
format adapter works unchanged inside an archive. A range past a member's end is a truncated
member, never bytes of the next one. Links, devices and FIFOs inside an archive are listed but
never read or followed.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from .. import tunables
from ..errors import CorruptRecordError, LimitExceededError, MissingFileError, UnsafePathError
from .names import name_problem
from .protocol import Store
from .tar_headers import TarIndex, TarMember, index_tar

__all__ = ["TarArchive", "open_tar_archive"]


def open_tar_archive(container: Store, name: str) -> TarArchive:
    """The tar archive ``name`` of ``container`` as a directory :class:`TarArchive`, its
    headers read and checked (see :mod:`~ckptkit.storage.tar_headers`); raises :class:`CorruptRecordError`
    (:class:`TruncatedFileError`), :class:`UnsafePathError` or :class:`LimitExceededError`
    naming the archive and the member."""
    return TarArchive(container, name, index_tar(container, name))


class TarArchive:
    """The members of a tar archive (or one of its folders) as a read-only directory: a
    :class:`~ckptkit.storage.Store` whose files are byte ranges of the archive in
    ``container``. Made by :func:`open_tar_archive`; :meth:`child` views share the index."""

    def __init__(self, container: Store, name: str, index: TarIndex, prefix: str = "") -> None:
        self.container = container
        self.archive = name
        self.index = index
        self.prefix = prefix
        where = container.describe(name)
        self.url = posixpath.join(where, prefix) if prefix else where
        top = container.path(name)
        self.root = posixpath.join(top, prefix) if prefix else top
        #: as the store holding the archive: a local archive's listing is free (see
        #: :mod:`ckptkit.formats.unread_files`)
        self.local = bool(getattr(container, "local", False))

    def __repr__(self) -> str:
        return f"TarArchive({self.url!r})"

    # -- naming ------------------------------------------------------------------------------

    def _full(self, rel: str) -> str:
        """``rel`` (checked) as a name in the whole archive."""
        self.path(rel)
        return posixpath.join(self.prefix, rel) if self.prefix else rel

    def child(self, rel: str) -> TarArchive:
        """The folder ``rel`` of the archive as a location of its own (same index)."""
        return TarArchive(self.container, self.archive, self.index, self._full(rel))

    def parent(self) -> tuple[Store, str]:
        """The containing folder (for the archive itself: the folder holding it) and this
        location's name in it."""
        if self.prefix:
            up, name = posixpath.split(self.prefix)
            return TarArchive(self.container, self.archive, self.index, up), name
        folder, name = posixpath.split(self.archive)
        return (self.container.child(folder) if folder else self.container), name

    def path(self, rel: str = "") -> str:
        """The path of ``rel`` inside the archive (for messages and name checks); an unsafe
        name raises :class:`UnsafePathError`, as for any store."""
        if rel == "":
            return self.root
        problem = name_problem(rel)
        if problem is not None:
            raise UnsafePathError(
                f"{self.describe()}: refused the file name {rel!r} ({problem}): a checkpoint "
                "may only name files inside itself"
            )
        return posixpath.join(self.root, rel)

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would write it: the archive's path, then the member's."""
        return posixpath.join(self.url, rel) if rel else self.url

    # -- listing and sizes -------------------------------------------------------------------

    def _look_up(self, rel: str) -> TarMember | None:
        """The member ``rel`` names (a folder implied by its members too), None if none."""
        full = self._full(rel) if rel else self.prefix
        member = self.index.members.get(full)
        if member is None and full in self.index.children:
            return TarMember(full, 0, 0, "dir")
        return member

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` (a member or folder) is in the archive."""
        return self._look_up(rel) is not None

    def isdir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a folder of the archive."""
        member = self._look_up(rel)
        return member is not None and member.kind == "dir"

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Names directly under ``rel`` and their sizes (folders -1, links and devices 0); a
        file lists itself, as in fsspec."""
        member = self._look_up(rel)
        if member is None:
            raise MissingFileError(f"{self.describe(rel)}: no such directory")
        if member.kind != "dir":
            return {posixpath.basename(member.name): member.size if member.kind == "file" else 0}
        out = {}
        for full in self.index.children[member.name]:
            inner = self.index.members.get(full)
            kind = "dir" if inner is None else inner.kind
            size = -1 if kind == "dir" else inner.size if kind == "file" else 0
            out[posixpath.basename(full)] = size
        return out

    def size(self, rel: str) -> int:
        """Size of the member ``rel`` in bytes."""
        return self._file(rel).size

    def sizes(self, rels: Sequence[str]) -> dict[str, int | None]:
        """Sizes of many members, None for missing ones (every name checked first)."""
        for rel in rels:
            self.path(rel)
        out: dict[str, int | None] = {}
        for rel in rels:
            try:
                out[rel] = self._file(rel).size
            except MissingFileError:
                out[rel] = None
        return out

    def _file(self, rel: str) -> TarMember:
        """The regular member ``rel``; missing is :class:`MissingFileError`, a folder, link or
        device :class:`UnsafePathError` (never followed, as a local store refuses them)."""
        if rel == "":
            raise UnsafePathError(f"{self.describe()}: not a regular file: a directory")
        member = self._look_up(rel)
        if member is None:
            raise MissingFileError(f"{self.describe(rel)}: no such file in the archive")
        if member.kind == "file":
            return member
        what = "a directory" if member.kind == "dir" else member.kind
        to = f" to {member.target!r}" if member.target else ""
        raise UnsafePathError(
            f"{self.describe(rel)}: not a regular file: {what}{to} inside the archive (links "
            "in archives are never followed)"
        )

    # -- reading -----------------------------------------------------------------------------

    def read_file(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """A whole small member, refused beyond ``max_bytes`` (default
        :data:`~ckptkit.tunables.SMALL_FILE_LIMIT`) before anything is read."""
        member = self._file(rel)
        _refuse_large(self.describe(rel), member.size, max_bytes)
        return bytes(self.read_ranges([(rel, 0, member.size)])[0])

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Exactly the bytes of each ``(rel, start, end)`` of a member, read from the archive
        (the holding store coalesces and bounds the requests). Every name and range is checked
        before anything is read: a range past a member's end is a truncated member, never
        bytes of the next one."""
        looked_up: dict[str, TarMember] = {}
        archive_ranges = []
        for rel, start, end in ranges:
            member = looked_up.get(rel) if isinstance(rel, str) else None
            if member is None:
                member = looked_up[rel] = self._file(rel)
            if not 0 <= start <= end:
                raise CorruptRecordError(
                    f"{self.describe(rel)}: invalid byte range [{start}, {end})"
                )
            if end > member.size:
                raise CorruptRecordError(
                    f"{self.describe(rel)}: truncated: bytes [{start}, {end}) requested, the "
                    f"file ends at {member.size}"
                )
            archive_ranges.append((self.archive, member.offset + start, member.offset + end))
        return self.container.read_ranges(archive_ranges) if archive_ranges else []

    @contextlib.contextmanager
    def open_sequential(self, rel: str, *, max_bytes: int | None = None) -> Iterator[BinaryIO]:
        """A file object for one front-to-back pass over a member, read from the archive
        :data:`~ckptkit.tunables.SEQUENTIAL_PIECE` bytes at a time."""
        member = self._file(rel)
        if max_bytes is not None:
            _refuse_large(self.describe(rel), member.size, max_bytes)
        with io.BufferedReader(_MemberStream(self, rel, member.size), 1 << 20) as handle:
            yield handle


def _refuse_large(where: str, size: int, max_bytes: int | None) -> None:
    """Refuse a whole-member read of ``size`` bytes beyond the limit, before it is allocated
    (the same words as a store's whole-file reads)."""
    limit = tunables.SMALL_FILE_LIMIT if max_bytes is None else max_bytes
    if size > limit:
        raise LimitExceededError(
            f"{where}: {size} bytes, more than the limit of {limit} bytes for a small file "
            "(index, config, metadata), so it was not read; if the file is genuine, raise "
            "ckptkit.tunables.SMALL_FILE_LIMIT (or pass read_file(..., max_bytes=N))"
        )


class _MemberStream(io.RawIOBase):
    """A seekable read-only stream over one member, in bounded ranged reads."""

    def __init__(self, archive: TarArchive, rel: str, size: int) -> None:
        super().__init__()
        self._archive, self._rel, self._size, self._at = archive, rel, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._at = base + offset
        return self._at

    def _read(self, n: int) -> bytes:
        end = min(self._size, self._at + n)
        if end <= self._at:
            return b""
        (data,) = self._archive.read_ranges([(self._rel, self._at, end)])
        self._at = end
        return bytes(data)

    def readinto(self, buffer) -> int:
        with memoryview(buffer) as view:
            data = self._read(min(len(view), tunables.SEQUENTIAL_PIECE))
            view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        pieces = []
        while piece := self._read(tunables.SEQUENTIAL_PIECE):
            pieces.append(piece)
        return b"".join(pieces)
