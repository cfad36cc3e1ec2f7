"""All file access, over fsspec: exact byte ranges, coalesced and fetched together.

No other module opens files. A :class:`Storage` is one checkpoint location (a local path or any
fsspec URL); the rest of ckptkit names files relative to it.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CorruptRecordError, MissingFileError

#: Ranges closer than this are fetched in one request (bytes in between are read and dropped).
COALESCE_GAP = 0
#: Upper bound of one coalesced request, so memory per request stays bounded.
MAX_REQUEST = 64 << 20


class Storage:
    """A directory-like location: ``Storage("s3://bucket/run/step100")`` or a local path."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, _fs=None
    ) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        if _fs is None:
            _fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        else:
            root = self.url
        self.fs = _fs
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def child(self, rel: str) -> Storage:
        """The sub-directory ``rel`` as a Storage of its own (same filesystem and options)."""
        sub = Storage(self.path(rel), self.storage_options, _fs=self.fs)
        sub.url = posixpath.join(self.url.rstrip("/"), rel)
        return sub

    def parent(self) -> tuple[Storage, str]:
        """The containing directory as a Storage, and this location's name in it."""
        up = Storage(posixpath.dirname(self.root) or "/", self.storage_options, _fs=self.fs)
        up.url = posixpath.dirname(self.url.rstrip("/")) or "."
        return up, posixpath.basename(self.root)

    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (a name relative to this location)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would write it, for messages."""
        return posixpath.join(self.url.rstrip("/"), rel) if rel else self.url

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def isdir(self, rel: str = "") -> bool:
        return self.fs.isdir(self.path(rel))

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Names directly under ``rel`` mapped to their size in bytes (directories: -1)."""
        try:
            listing = self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError as exc:
            raise MissingFileError(f"{self.describe(rel)}: no such directory") from exc
        return {
            posixpath.basename(item["name"].rstrip("/")): (
                int(item.get("size") or 0) if item.get("type") != "directory" else -1
            )
            for item in listing
        }

    def sizes(self, rels: Sequence[str]) -> dict[str, int | None]:
        """Sizes of many files: one listing per directory, a direct look-up for what it misses.

        Missing files map to None. Stores that cannot list (plain HTTP) fall back to look-ups.
        """
        out: dict[str, int | None] = {}
        for directory in sorted({posixpath.dirname(rel) for rel in rels}):
            try:
                listing = self.listdir(directory)
            except (MissingFileError, NotImplementedError, OSError):
                listing = {}
            out.update(
                {
                    rel: listing.get(posixpath.basename(rel))
                    for rel in rels
                    if posixpath.dirname(rel) == directory
                }
            )
        for rel, size in out.items():
            if size is None:
                with contextlib.suppress(MissingFileError):
                    out[rel] = self.size(rel)
        return out

    def size(self, rel: str) -> int:
        try:
            return int(self.fs.size(self.path(rel)))
        except FileNotFoundError as exc:
            raise MissingFileError(f"{self.describe(rel)}: no such file") from exc

    def read_file(self, rel: str) -> bytes:
        """A whole (small) file, such as ``.metadata``."""
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError as exc:
            raise MissingFileError(f"{self.describe(rel)}: no such file") from exc

    @contextlib.contextmanager
    def open_sequential(self, rel: str) -> Iterator[BinaryIO]:
        """A file object for one front-to-back pass over a whole file (large metadata pickles)."""
        try:
            handle = self.fs.open(self.path(rel), "rb")
        except FileNotFoundError as exc:
            raise MissingFileError(f"{self.describe(rel)}: no such file") from exc
        with handle:
            yield handle

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Exactly bytes ``[start, end)`` of ``rel``; a short read is a truncated file."""
        return self.read_ranges([(rel, start, end)])[0]

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Exactly the bytes of each ``(rel, start, end)``, adjacent ranges fetched as one request."""
        order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
        requests: list[list[Any]] = []  # [rel, start, end, [indices]]
        for i in order:
            rel, start, end = ranges[i]
            last = requests[-1] if requests else None
            if (
                last is not None
                and last[0] == rel
                and start - last[2] <= COALESCE_GAP
                and start >= last[1]
                and max(end, last[2]) - last[1] <= MAX_REQUEST
            ):
                last[2] = max(last[2], end)
                last[3].append(i)
            else:
                requests.append([rel, start, end, [i]])
        blobs = self._fetch(requests)
        out: list[bytes] = [b""] * len(ranges)
        for (rel, start, _end, members), blob in zip(requests, blobs, strict=True):
            for i in members:
                _, s, e = ranges[i]
                piece = blob[s - start : e - start]
                if len(piece) != e - s:
                    raise CorruptRecordError(
                        f"{self.describe(rel)}: truncated: bytes [{s}, {e}) requested, "
                        f"the file ends at {start + len(blob)}"
                    )
                out[i] = piece
        return out

    def _fetch(self, requests: list[list[Any]]) -> list[bytes]:
        paths = [self.path(r[0]) for r in requests]
        starts = [r[1] for r in requests]
        ends = [r[2] for r in requests]
        blobs = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        for req, blob in zip(requests, blobs, strict=True):
            if isinstance(blob, FileNotFoundError):
                raise MissingFileError(f"{self.describe(req[0])}: no such file") from blob
            if isinstance(blob, BaseException):
                raise blob
        return blobs


class AtomicOutput:
    """Files written into a destination all-or-nothing: under temporary names, renamed on commit.

    Local destinations get a hidden ``.ckptkit-tmp-*`` folder inside them (so the final rename
    stays on one file system); other stores get a local staging folder whose files are uploaded
    on commit, each appearing whole under its final key. Nothing exists under a final name until
    :meth:`commit`; :meth:`discard` removes every temporary file.
    """

    def __init__(self, destination: Storage, *, overwrite: bool = False) -> None:
        self.destination = destination
        self.overwrite = overwrite
        self.local = isinstance(destination.fs, LocalFileSystem)
        if self.local:
            os.makedirs(destination.root, exist_ok=True)
            self.staging = tempfile.mkdtemp(prefix=".ckptkit-tmp-", dir=destination.root)
        else:
            self.staging = tempfile.mkdtemp(prefix="ckptkit-")
        self.names: list[str] = []

    def refuse_existing(self, names: Sequence[str]) -> None:
        """Fail early, before any work, if a final name exists and ``overwrite`` is off."""
        if self.overwrite:
            return
        taken = [n for n in names if self.destination.exists(n)]
        if taken:
            raise FileExistsError(
                f"{self.destination.describe(taken[0])} already exists (overwrite=True / --overwrite replaces it)"
            )

    def open(self, name: str) -> BinaryIO:
        """A new seekable file that will become ``name`` (relative to the destination)."""
        if name in self.names:
            raise ValueError(f"{name!r} is written twice")
        self.names.append(name)
        path = os.path.join(self.staging, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return builtins.open(path, "wb")

    def commit(self) -> None:
        """Move every written file to its final name."""
        self.refuse_existing(self.names)
        for name in self.names:
            staged = os.path.join(self.staging, name)
            if self.local:
                final = self.destination.path(name)
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.replace(staged, final)
            else:
                self.destination.fs.put_file(staged, self.destination.path(name))
        self.discard()

    def discard(self) -> None:
        """Remove the staging folder and everything in it."""
        shutil.rmtree(self.staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_output(destination: Storage, *, overwrite: bool = False) -> Iterator[AtomicOutput]:
    """An :class:`AtomicOutput` committed when the block succeeds and discarded when it raises."""
    output = AtomicOutput(destination, overwrite=overwrite)
    try:
        yield output
    except BaseException:
        output.discard()
        raise
    output.commit()
