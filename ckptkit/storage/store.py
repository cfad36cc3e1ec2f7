"""The :class:`Storage` class: one checkpoint location, every read checked and exact.

Names go through :mod:`~ckptkit.storage.names`, local reads through :mod:`~ckptkit.storage.local`,
remote ones through :mod:`~ckptkit.storage.remote`, and every store call through
:mod:`~ckptkit.storage.retry`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import os
import posixpath
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

from .. import tunables
from ..errors import (
    AccessDeniedError,
    CheckpointError,
    CorruptRecordError,
    LimitExceededError,
    MissingFileError,
    StorageError,
    UnsafePathError,
    UsageError,
)
from . import local, remote, retry
from .names import is_http, name_problem
from .remote import Cache

__all__ = ["COALESCE_GAP", "Storage"]

#: Ranges closer than this are fetched in one request (bytes in between are read and dropped).
COALESCE_GAP = 0


class Storage:
    """A directory-like location: ``Storage("s3://bucket/run/step100")`` or a local path.

    ``storage_options`` go to fsspec (as in pandas); ``cache="blocks"`` / ``"files"`` keep what
    is read from a remote store in a local temporary cache (fsspec's ``blockcache`` /
    ``filecache``) for repeated work, at the price of reading whole blocks / files.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        cache: Cache | None = None,
        _fs=None,
        _lock: threading.Lock | None = None,
    ) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        if cache is not None and cache not in remote.CACHE_PROTOCOLS:
            raise UsageError(f"cache must be 'blocks', 'files' or None, not {cache!r}")
        if _fs is None:
            _fs, root, cache = remote.open_filesystem(self.url, self.storage_options, cache)
            if cache is not None:
                _lock = threading.Lock()  # fsspec's caches are not safe for parallel fetches
        else:
            root = self.url
        self.fs = _fs
        self.root = root.rstrip("/") or "/"
        self.cache = cache
        self.local = isinstance(_fs, LocalFileSystem)
        self._lock = _lock
        self._http = is_http(self.url)  # names must stay safe once percent-decoded too

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _sibling(self, root: str, url: str) -> Storage:
        other = Storage(root, self.storage_options, cache=self.cache, _fs=self.fs, _lock=self._lock)
        other.url = url
        other._http = self._http
        return other

    def child(self, rel: str) -> Storage:
        """The sub-directory ``rel`` as a Storage of its own (same filesystem and options);
        ``rel`` must be a safe relative name, as for :meth:`path`."""
        return self._sibling(self._resolve(rel), posixpath.join(self.url.rstrip("/"), rel))

    def parent(self) -> tuple[Storage, str]:
        """The containing directory as a Storage, and this location's name in it."""
        up = self._sibling(
            posixpath.dirname(self.root) or "/", posixpath.dirname(self.url.rstrip("/")) or "."
        )
        return up, posixpath.basename(self.root)

    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (a name relative to this location, ``""`` for the
        location itself); a name that could lead outside raises :class:`UnsafePathError`."""
        return self._resolve(rel, root_ok=True)

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would write it, for messages."""
        return posixpath.join(self.url.rstrip("/"), rel) if rel else self.url

    def _resolve(self, rel: str, *, root_ok: bool = False) -> str:
        """The one place a relative name becomes a path, so names read from a checkpoint (DCP
        ``relative_path``, ``weight_map`` values, rank and config files) cannot lead outside it:
        see :func:`~ckptkit.storage.names.name_problem`; the result lies under :attr:`root`
        (same bucket and prefix)."""
        if root_ok and rel == "":
            return self.root
        problem = name_problem(rel, url=self._http)
        if problem is None:
            path = posixpath.join(self.root, rel)
            under = self.root if self.root.endswith("/") else self.root + "/"
            if path.startswith(under) and len(path) > len(under):
                return path
            problem = "it leads outside"
        raise UnsafePathError(
            f"{self.describe()}: refused the file name {rel!r} ({problem}): a checkpoint may only "
            "name files inside itself"
        )

    # -- local files: regular files inside the root only -----------------------------------

    def _local_file(self, rel: str) -> tuple[str, os.stat_result]:
        """The real path and stat of the regular file ``rel``: a symlink may only lead to a file
        inside the root, and FIFOs, devices, sockets and directories are refused (``/dev/zero``
        never ends, opening a FIFO blocks forever)."""
        path = self._resolve(rel)
        real, real_root = os.path.realpath(path), os.path.realpath(self.root)
        if not real.startswith(real_root.rstrip("/") + "/"):
            raise UnsafePathError(
                f"{self.describe(rel)}: a symlink leading outside {self.describe()} (to {real})"
            )
        status = self._call(rel, os.stat, real)
        if not stat.S_ISREG(status.st_mode):
            raise UnsafePathError(
                f"{self.describe(rel)}: not a regular file: {local.file_kind(status.st_mode)}"
            )
        return real, status

    def _open_local(self, rel: str) -> tuple[int, int]:
        """A read-only descriptor of the regular file ``rel`` and its size (fstat), opened
        without blocking or following a last symlink, so a FIFO or link swapped in after the
        check is refused instead of waited on or followed."""
        real, _ = self._local_file(rel)
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = self._call(rel, os.open, real, flags)
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise UnsafePathError(
                    f"{self.describe(rel)}: not a regular file: {local.file_kind(status.st_mode)}"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, status.st_size

    # -- metadata --------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` (a file or directory) exists: a look-up of that name, not a listing.

        Access denied counts as absent: S3 answers 403 for a missing object to callers who may
        not list its bucket (public mirrors), so probing names must go on past it.
        """
        path = self._resolve(rel, root_ok=True)
        if self.local:
            return os.path.exists(path)
        try:
            self._call(rel, self.fs.info, path)
        except (MissingFileError, AccessDeniedError):
            return False
        return True

    def isdir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a directory (False too when the store refuses to list it)."""
        path = self._resolve(rel, root_ok=True)
        if self.local:
            return os.path.isdir(path)
        try:
            return bool(self._call(rel, self.fs.isdir, path))
        except (MissingFileError, AccessDeniedError):
            return False

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Names directly under ``rel`` mapped to their size in bytes (directories: -1).

        A store that cannot or may not list (plain HTTP, public buckets without ListBucket)
        raises :class:`MissingFileError` too, so format detection falls back to probing names.
        """
        path = self._resolve(rel, root_ok=True)
        try:
            listing = self._call(rel, self.fs.ls, path, detail=True)
        except MissingFileError:
            raise MissingFileError(f"{self.describe(rel)}: no such directory") from None
        except (AccessDeniedError, NotImplementedError) as exc:
            raise MissingFileError(
                f"{self.describe(rel)}: cannot list ({retry.error_summary(exc)})"
            ) from exc
        return {
            posixpath.basename(item["name"].rstrip("/")): (
                int(item.get("size") or 0) if item.get("type") != "directory" else -1
            )
            for item in listing
        }

    def sizes(self, rels: Sequence[str]) -> dict[str, int | None]:
        """Sizes of many files: one listing per directory, a direct look-up for what it misses.

        Missing files map to None. Stores that cannot list (plain HTTP) fall back to look-ups,
        made in parallel. Local files are looked up one by one, so a FIFO, device or symlink
        leading outside raises :class:`UnsafePathError` as reading it would.
        """
        for rel in dict.fromkeys(rels):
            self._resolve(rel)  # every name checked before any look-up

        def look_up(rel: str) -> int | None:
            try:
                return self.size(rel)
            except (MissingFileError, AccessDeniedError):  # 403: absent, see exists()
                return None

        if self.local:
            return {rel: look_up(rel) for rel in rels}
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
        missing = [rel for rel, size in out.items() if size is None or size < 0]
        looked_up = remote.run_parallel(
            [lambda r=r: look_up(r) for r in missing], serial=self._lock is not None
        )
        out.update(zip(missing, looked_up, strict=True))
        return out

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes (locally: of a regular file, see ``_local_file``)."""
        if self.local:
            return self._local_file(rel)[1].st_size
        size = self._size_or_none(rel)
        if size is None:
            raise StorageError(f"{self.describe(rel)}: the store does not report its size")
        return size

    def _size_or_none(self, rel: str) -> int | None:
        size = self._call(rel, self.fs.info, self._resolve(rel)).get("size")
        return None if size is None else int(size)

    # -- reading ---------------------------------------------------------------------------

    def read_file(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """A whole small file (an index, config or metadata file), refused with
        :class:`LimitExceededError` before anything is read when the file itself (fstat, or the
        store's size) holds more than ``max_bytes`` (default: :data:`~ckptkit.tunables.SMALL_FILE_LIMIT`)."""
        limit = tunables.SMALL_FILE_LIMIT if max_bytes is None else max_bytes
        if self.local:
            fd, size = self._open_local(rel)
            try:
                self._refuse_large(rel, size, limit)
                data = self._call(rel, local.pread, fd, 0, size)
            finally:
                os.close(fd)
        else:
            size = self._size_or_none(rel)
            if size is None:
                return self._read_unsized(rel, limit)
            self._refuse_large(rel, size, limit)
            data = self._get(rel, 0, size)
        if len(data) != size:
            raise self._truncated(rel, 0, size, len(data))
        return bytes(data)

    def _refuse_large(self, rel: str, size: int, limit: int) -> None:
        """Refuse a whole-file read of ``size`` bytes beyond ``limit``, before it is allocated."""
        if size > limit:
            raise LimitExceededError(
                f"{self.describe(rel)}: {size} bytes, more than the limit of {limit} bytes for a "
                "small file (index, config, metadata), so it was not read; if the file is genuine, "
                "raise ckptkit.tunables.SMALL_FILE_LIMIT (or pass read_file(..., max_bytes=N))"
            )

    def _read_unsized(self, rel: str, limit: int) -> bytes:
        """A whole file from a store that does not report sizes, streamed and refused as soon as
        it exceeds ``limit`` bytes (so the server, not the file, never sets the allocation)."""
        pieces: list[bytes] = []
        got = 0
        with self._call(rel, self.fs.open, self._resolve(rel), "rb") as handle:
            while got <= limit:
                piece = self._call(
                    rel, handle.read, min(limit + 1 - got, tunables.SEQUENTIAL_PIECE)
                )
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
        if got > limit:
            raise LimitExceededError(
                f"{self.describe(rel)}: more than the limit of {limit} bytes for a small file "
                "(index, config, metadata); if the file is genuine, raise "
                "ckptkit.tunables.SMALL_FILE_LIMIT (or pass read_file(..., max_bytes=N))"
            )
        return b"".join(pieces)

    @contextlib.contextmanager
    def open_sequential(self, rel: str, *, max_bytes: int | None = None) -> Iterator[BinaryIO]:
        """A file object for one front-to-back pass over a whole file (large metadata pickles).

        Remote files are fetched exactly, :data:`~ckptkit.tunables.SEQUENTIAL_PIECE` bytes per request with the
        next piece in flight while the current one is consumed; a file shorter than its listed
        size raises :class:`CorruptRecordError`. Local files must be regular files inside the
        root. ``max_bytes`` refuses larger files (:class:`LimitExceededError`) before reading.
        """
        kwargs = {"block_size": remote.CACHE_BLOCK} if self.cache == "blocks" else {}
        if self.local:
            fd, size = self._open_local(rel)
            try:
                self._refuse_large(rel, size, sys.maxsize if max_bytes is None else max_bytes)
                handle: BinaryIO = builtins.open(fd, "rb")  # noqa: SIM115 (closed below)
            except BaseException:
                os.close(fd)
                raise
        elif self.cache is not None:
            if max_bytes is not None:
                self._refuse_large(rel, self.size(rel), max_bytes)
            handle = self._call(rel, self.fs.open, self._resolve(rel), "rb", **kwargs)
        elif (size := self._size_or_none(rel)) is not None:
            if max_bytes is not None:
                self._refuse_large(rel, size, max_bytes)
            stream = remote.RemoteStream(functools.partial(self._read_exact, rel), size)
            handle = io.BufferedReader(stream, 1 << 20)
        else:  # a server that does not tell sizes: the whole file in one request
            limit = sys.maxsize - 1 if max_bytes is None else max_bytes
            handle = io.BytesIO(self._read_unsized(rel, limit))
        with handle:
            yield handle

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Exactly bytes ``[start, end)`` of ``rel``; a short read is a truncated file."""
        return self.read_ranges([(rel, start, end)])[0]

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Exactly the bytes of each ``(rel, start, end)``, adjacent ranges fetched as one request.

        Names and ranges come from untrusted metadata: every name is checked (see
        :meth:`path`) and every range must have ``0 <= start <= end`` before anything is read,
        and no buffer is larger than what the file holds, whatever length a record claims.
        """
        checked: set[str] = set()
        for rel, start, end in ranges:
            if not (isinstance(rel, str) and rel in checked):
                self._resolve(rel)
                checked.add(rel)
            if not 0 <= start <= end:
                raise CorruptRecordError(
                    f"{self.describe(rel)}: invalid byte range [{start}, {end})"
                )
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
                and max(end, last[2]) - last[1] <= tunables.MAX_REQUEST
            ):
                last[2] = max(last[2], end)
                last[3].append(i)
            else:
                requests.append([rel, start, end, [i]])
        blobs = self._fetch_local(requests) if self.local else self._fetch_remote(requests)
        out: list[bytes] = [b""] * len(ranges)
        for (rel, start, _end, members), blob in zip(requests, blobs, strict=True):
            for i in members:
                _, s, e = ranges[i]
                whole = s == start and len(blob) == e - s  # no copy of a whole request
                piece = blob if whole else blob[s - start : e - start]
                if len(piece) != e - s:
                    raise self._truncated(rel, s, e, start + len(blob))
                out[i] = piece
        return out

    def _truncated(self, rel: str, start: int, end: int, ends_at: int) -> CorruptRecordError:
        """The error for a range past the end of ``rel``, with the file's size as the store
        reports it now (never half a record)."""
        with contextlib.suppress(CheckpointError, OSError):
            if not self.local:
                self.fs.invalidate_cache(self._resolve(rel))
            ends_at = self.size(rel)
        return CorruptRecordError(
            f"{self.describe(rel)}: truncated: bytes [{start}, {end}) requested, "
            f"the file ends at {ends_at}"
        )

    def _fetch_local(self, requests: list[list[Any]]) -> list[bytes | memoryview]:
        """Local fast path: each file opened once (a regular file inside the root, see
        ``_open_local``) and each range read into one buffer of at most what the file holds by
        fstat, whatever length a record claims; a range past the end, or a file that shrinks
        meanwhile, comes back short. The file is never memory-mapped: a mapped file that
        shrinks kills the process with SIGBUS."""
        blobs: list[bytes | memoryview] = []
        current: tuple[str, int, int] | None = None  # (rel, descriptor, size)
        try:
            for rel, start, end, _ in requests:
                if current is None or current[0] != rel:
                    if current is not None:
                        os.close(current[1])
                        current = None
                    current = (rel, *self._open_local(rel))
                _, fd, size = current
                length = min(end, size) - start
                read = local.read_large if length >= local.LARGE_READ_MIN else local.pread
                blobs.append(self._call(rel, read, fd, start, length))
        finally:
            if current is not None:
                os.close(current[1])
        return blobs

    def _fetch_remote(self, requests: list[list[Any]]) -> list[bytes | bytearray]:
        """Every request at once, in bounded pieces fetched in parallel (see
        :func:`~ckptkit.storage.remote.fetch_requests`), large ones clamped to the object's size."""
        return remote.fetch_requests(
            requests, get=self._get, size_of=self._size_or_none, serial=self._lock is not None
        )

    def _get(self, rel: str, start: int, end: int) -> bytes:
        """One ranged request, exactly ``[start, end)`` (shorter only where the file ends)."""
        if end <= start:
            return b""
        kwargs = {"block_size": remote.CACHE_BLOCK} if self.cache == "blocks" else {}
        path = self._resolve(rel)
        try:
            data = self._call(rel, self.fs.cat_file, path, start=start, end=end, **kwargs)
        except retry.RangeNotSatisfiable:
            return b""  # the file ends before ``start``; read_ranges reports it with its size
        if len(data) > end - start:
            raise StorageError(
                f"{self.describe(rel)}: asked for bytes [{start}, {end}), got {len(data)} bytes "
                "(the server does not honour Range requests)"
            )
        return data

    def _read_exact(self, rel: str, start: int, end: int) -> bytes:
        """Exactly bytes ``[start, end)`` of the remote file ``rel`` in one request; a short
        read is a truncated file (what :class:`~ckptkit.storage.remote.RemoteStream` is handed)."""
        data = self._get(rel, start, end)
        if len(data) != end - start:
            raise self._truncated(rel, start, end, start + len(data))
        return data

    # -- the one place that talks to the store ---------------------------------------------

    def _call(self, rel: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the store, retried with exponential backoff while it fails
        transiently; store errors come out as ckptkit errors naming ``rel``'s URL (see
        :func:`~ckptkit.storage.retry.call_with_retries`)."""
        return retry.call_with_retries(
            lambda: fn(*args, **kwargs),
            remote=not self.local,
            lock=self._lock,
            where=lambda: self.describe(rel),
        )
