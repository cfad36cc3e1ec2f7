"""All file access, over fsspec: exact byte ranges, coalesced and fetched together.

No other module opens files. A :class:`Storage` is one checkpoint location (a local path or any
fsspec URL: ``s3://``, ``gs://``, ``https://``, ``memory://``…); the rest of ckptkit names files
relative to it.

Local files are read directly. Remote stores get exact ranged requests (``cat_file(path, start,
end)``, never a read-ahead file object), at most :data:`~ckptkit.tunables.MAX_REQUEST` bytes each and
:data:`MAX_IN_FLIGHT` at a time, retried with exponential backoff on transient errors (5xx,
throttling, connection resets) in :meth:`Storage._call`, the one place that also turns store
errors into ckptkit's (404 → :class:`MissingFileError`, 403 → :class:`AccessDeniedError`); for
S3 the client's own retries are switched off so they do not multiply (:func:`_filesystem`).
Nothing needs a listing: names are probed, sizes looked up one by one where a store cannot
list. ``cache=`` puts fsspec's ``blockcache`` / ``filecache`` in front of a remote store.
Writes go through :func:`atomic_output`: nothing appears under a final name before success.

Every name, size and file type a checkpoint holds is untrusted: names are resolved in one
place (``Storage._resolve``: relative, no ``..``, no control characters, under the root, else
:class:`UnsafePathError`); local files are opened only if they are regular files inside the
root (no FIFO, device, or symlink leading outside); whole-file reads are bounded by
:data:`~ckptkit.tunables.SMALL_FILE_LIMIT` and no buffer is larger than what the file holds, whatever length a
record claims; source files are never memory-mapped (a file shrinking under a map is SIGBUS).
Output names follow the same rule (:class:`OutputNameError`) and write errors come out as
:class:`DestinationError`; staging folders of killed runs are removed by the next run.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import mmap
import os
import posixpath
import random
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .. import tunables
from ..errors import (
    AccessDeniedError,
    CheckpointError,
    CorruptRecordError,
    DestinationError,
    LimitExceededError,
    MissingFileError,
    OutputExistsError,
    OutputNameError,
    StorageError,
    UnsafePathError,
    UsageError,
)

#: Ranges closer than this are fetched in one request (bytes in between are read and dropped).
COALESCE_GAP = 0
#: Remote requests in flight at once (a shared pool of this many I/O threads).
MAX_IN_FLIGHT = 8
#: Attempts per remote operation, and the first backoff (doubled after each failure, jittered).
RETRY_ATTEMPTS = 5
#: Block size of the ``cache="blocks"`` local cache (fsspec's ``blockcache``).
CACHE_BLOCK = 4 << 20
#: Local ranges at least this large are read into an anonymous memory map backed by huge pages
#: where the system allows (see :func:`_read_large`); smaller ones into bytes.
LARGE_READ_MIN = 2 << 20
#: Largest single ``os.pread`` (Linux transfers at most 2 GiB - 4 KiB per call).
_PREAD_MAX = 1 << 30

Cache = Literal["blocks", "files"]
_CACHE_PROTOCOLS = {"blocks": "blockcache", "files": "filecache"}


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
        if cache is not None and cache not in _CACHE_PROTOCOLS:
            raise UsageError(f"cache must be 'blocks', 'files' or None, not {cache!r}")
        if _fs is None:
            _fs, root = _filesystem(self.url, self.storage_options)
            _forget_listings(_fs, root)  # each open sees the store as it is now
            if isinstance(_fs, LocalFileSystem):
                cache = None  # nothing to gain on local files
            elif cache is not None:
                _fs = fsspec.filesystem(_CACHE_PROTOCOLS[cache], fs=_fs)
                _lock = threading.Lock()  # fsspec's caches are not safe for parallel fetches
        else:
            root = self.url
        self.fs = _fs
        self.root = root.rstrip("/") or "/"
        self.cache = cache
        self.local = isinstance(_fs, LocalFileSystem)
        self._lock = _lock
        self._http = _is_http(self.url)  # names must stay safe once percent-decoded too

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
        see :func:`_name_problem`; the result lies under :attr:`root` (same bucket and prefix)."""
        if root_ok and rel == "":
            return self.root
        problem = _name_problem(rel, url=self._http)
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
                f"{self.describe(rel)}: not a regular file: {_file_kind(status.st_mode)}"
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
                    f"{self.describe(rel)}: not a regular file: {_file_kind(status.st_mode)}"
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
            raise MissingFileError(f"{self.describe(rel)}: cannot list ({_short(exc)})") from exc
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
        out.update(
            zip(missing, self._parallel([lambda r=r: look_up(r) for r in missing]), strict=True)
        )
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
                data = self._call(rel, _pread, fd, 0, size)
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
        kwargs = {"block_size": CACHE_BLOCK} if self.cache == "blocks" else {}
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
            handle = io.BufferedReader(_RemoteStream(self, rel, size), 1 << 20)
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
                read = _read_large if length >= LARGE_READ_MIN else _pread
                blobs.append(self._call(rel, read, fd, start, length))
        finally:
            if current is not None:
                os.close(current[1])
        return blobs

    def _fetch_remote(self, requests: list[list[Any]]) -> list[bytes | bytearray]:
        """Every request at once, each split into pieces of at most :data:`~ckptkit.tunables.MAX_REQUEST` bytes
        fetched in parallel; a piece that comes back short ends its request there. Before a
        large request is split, the object's size is looked up (once per file and call) and
        the request clamped to it, so a claimed length never becomes an allocation."""
        sizes: dict[str, int | None] = {}
        blobs: list[Any] = []
        pieces: list[tuple[int, str, int, int]] = []  # (request index, rel, start, end)
        for index, (rel, start, end, _) in enumerate(requests):
            known = end - start <= tunables.MAX_REQUEST
            if not known:
                if rel not in sizes:
                    sizes[rel] = self._size_or_none(rel)
                if sizes[rel] is not None:
                    end, known = max(start, min(end, sizes[rel])), True
            if end - start <= tunables.MAX_REQUEST:
                blobs.append(b"")
                pieces.append((index, rel, start, end))
            else:
                blobs.append(_PiecedBlob(start, end, preallocate=known))
                pieces.extend(
                    (index, rel, lo, min(lo + tunables.MAX_REQUEST, end))
                    for lo in range(start, end, tunables.MAX_REQUEST)
                )

        def fetch(index: int, rel: str, start: int, end: int) -> None:
            data = self._get(rel, start, end)
            if isinstance(blobs[index], _PiecedBlob):
                blobs[index].put(start, end, data)
            else:
                blobs[index] = data

        self._parallel([lambda p=p: fetch(*p) for p in pieces])
        return [b.valid() if isinstance(b, _PiecedBlob) else b for b in blobs]

    def _get(self, rel: str, start: int, end: int) -> bytes:
        """One ranged request, exactly ``[start, end)`` (shorter only where the file ends)."""
        if end <= start:
            return b""
        kwargs = {"block_size": CACHE_BLOCK} if self.cache == "blocks" else {}
        path = self._resolve(rel)
        try:
            data = self._call(rel, self.fs.cat_file, path, start=start, end=end, **kwargs)
        except _RangeNotSatisfiable:
            return b""  # the file ends before ``start``; read_ranges reports it with its size
        if len(data) > end - start:
            raise StorageError(
                f"{self.describe(rel)}: asked for bytes [{start}, {end}), got {len(data)} bytes "
                "(the server does not honour Range requests)"
            )
        return data

    def _parallel(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks`` on the I/O pool, at most :data:`MAX_IN_FLIGHT` at a time; the first
        error cancels what has not started and is raised once the rest have finished."""
        if len(tasks) <= 1 or self._lock is not None:
            return [task() for task in tasks]
        futures = [_pool().submit(task) for task in tasks]
        error: BaseException | None = None
        results = []
        for future in futures:
            if error is not None:
                future.cancel()
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 — re-raised below
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results

    # -- the one place that talks to the store ---------------------------------------------

    def _call(self, rel: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the store, retried with exponential backoff while it fails
        transiently; store errors come out as ckptkit errors naming ``rel``'s URL."""
        attempts = 1 if self.local else RETRY_ATTEMPTS
        delay = tunables.RETRY_BACKOFF_S
        for attempt in range(1, attempts + 1):
            try:
                if self._lock is None:
                    return fn(*args, **kwargs)
                with self._lock:
                    return fn(*args, **kwargs)
            except Exception as exc:
                kind = _classify(exc)
                if kind == "transient" and attempt < attempts:
                    time.sleep(delay * (0.5 + random.random()))
                    delay *= 2
                    continue
                error = self._translate(exc, kind, rel, attempt)
                if error is exc:
                    raise
                raise error from exc
        raise AssertionError("unreachable")

    def _translate(self, exc: Exception, kind: str, rel: str, attempts: int) -> Exception:
        where = self.describe(rel)
        if kind == "ours":
            return exc
        if kind == "missing":
            return MissingFileError(f"{where}: no such file")
        if kind == "denied":
            return AccessDeniedError(
                f"{where}: access denied ({_short(exc)}); check credentials / storage_options"
            )
        if kind == "range":
            return _RangeNotSatisfiable(where)
        if kind == "transient":
            return StorageError(
                f"{where}: still failing after {attempts} attempts: {type(exc).__name__}: {_short(exc)}"
            )
        if isinstance(exc, OSError) or _http_status(exc) is not None:
            return StorageError(f"{where}: {type(exc).__name__}: {_short(exc)}")
        return exc


class _RangeNotSatisfiable(Exception):
    """A ranged request starting at or past the end of the file (HTTP 416)."""


class _PiecedBlob:
    """A large range fetched in pieces: valid up to the first short piece. When the range was
    clamped to the object's size the pieces land in one preallocated buffer; otherwise they are
    kept apart and joined at the end, so a length read from metadata is never allocated."""

    def __init__(self, start: int, end: int, *, preallocate: bool = True) -> None:
        self.start = start
        self.buffer = bytearray(end - start) if preallocate else None
        self.pieces: dict[int, bytes] = {}  # offset -> data, when not preallocated
        self.short: list[int] = []  # where pieces that came back short end (append: thread-safe)

    def put(self, start: int, end: int, data: bytes) -> None:
        at = start - self.start
        if self.buffer is not None:
            self.buffer[at : at + len(data)] = data
        else:
            self.pieces[at] = data
        if len(data) < end - start:
            self.short.append(at + len(data))

    def valid(self) -> bytearray:
        stop = min(self.short) if self.short else None
        if self.buffer is not None:
            if stop is not None:
                del self.buffer[stop:]
            return self.buffer
        joined = bytearray()
        for at in sorted(self.pieces):
            if stop is not None and at >= stop:
                break
            joined += self.pieces.pop(at)
        return joined


class _RemoteStream(io.RawIOBase):
    """A remote file read front to back in exact pieces, the next one prefetched."""

    def __init__(self, storage: Storage, rel: str, size: int) -> None:
        self.storage, self.rel, self.size = storage, rel, size
        self.position = 0
        self.piece, self.piece_start = b"", 0
        self.prefetch: tuple[int, Future] | None = None  # (start, the piece being fetched)
        self.prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-prefetch")

    def readable(self) -> bool:
        return True

    def _fetch(self, start: int) -> bytes:
        end = min(start + tunables.SEQUENTIAL_PIECE, self.size)
        data = self.storage._get(self.rel, start, end)
        if len(data) != end - start:
            raise self.storage._truncated(self.rel, start, end, start + len(data))
        return data

    def readinto(self, buffer) -> int:
        if self.position >= self.size:
            return 0
        offset = self.position - self.piece_start
        if not 0 <= offset < len(self.piece):
            prefetch, self.prefetch = self.prefetch, None
            if prefetch is not None and prefetch[0] == self.position:
                self.piece = prefetch[1].result()
            else:
                self.piece = self._fetch(self.position)
            self.piece_start, offset = self.position, 0
            following = self.position + len(self.piece)
            if following < self.size:
                self.prefetch = (following, self.prefetcher.submit(self._fetch, following))
        n = min(len(buffer), len(self.piece) - offset)
        buffer[:n] = memoryview(self.piece)[offset : offset + n]
        self.position += n
        return n

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch[1].cancel()
        self.prefetcher.shutdown(wait=True)
        self.piece = b""
        super().close()


#: Characters no file name from a checkpoint may hold: C0/C1 controls (NUL included) and lone
#: surrogates (not encodable as a file name).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _name_problem(name: object, *, url: bool = False) -> str | None:
    """Why ``name`` is not a safe relative file name, or None: a non-empty ``str``, relative,
    without empty, ``.`` or ``..`` components, control characters or backslashes; for HTTP
    stores (``url``) also no ``?`` / ``#`` and still safe once percent-decoded."""
    if not isinstance(name, str):
        return f"not a string but {type(name).__name__}"
    if not name:
        return "empty"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name:
        return "a backslash in it"
    if (bad := _CONTROL.search(name)) is not None:
        return f"character U+{ord(bad.group()):04X} (a control character or lone surrogate) in it"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an empty, '.' or '..' component"
    if url:
        if "?" in name or "#" in name:
            return "a URL query or fragment in it"
        decoded = urllib.parse.unquote(name)
        if decoded != name and (problem := _name_problem(decoded)) is not None:
            return f"{problem}, once percent-decoded"
    return None


def _is_http(url: str) -> bool:
    """Whether ``url`` (possibly chained, ``simplecache::https://…``) is served over HTTP."""
    return any(fsspec.utils.get_protocol(part) in ("http", "https") for part in url.split("::"))


def _read_large(fd: int, start: int, length: int) -> memoryview:
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


def _file_kind(mode: int) -> str:
    """What a non-regular file is, for messages (``a FIFO``, ``a character device``…)."""
    return next((kind for test, kind in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")


def _pread(fd: int, start: int, length: int) -> bytes | bytearray:
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


def _forget_listings(fs: Any, root: str) -> None:
    """Drop listings fsspec cached for ``root``, its parents and everything under it."""
    dircache = getattr(fs, "dircache", None)
    if dircache is None:
        return
    fs.invalidate_cache(root)
    for path in [p for p in list(dircache) if p.startswith(root.rstrip("/") + "/")]:
        dircache.pop(path, None)


_S3_FILESYSTEMS: dict[str, Any] = {}
_S3_LOCK = threading.Lock()


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """fsspec's filesystem and path for ``url``.

    S3 gets an instance of ckptkit's own (one per set of options) with s3fs's and botocore's
    retries off unless ``config_kwargs`` sets botocore's, so :meth:`Storage._call` is the one
    place that retries: stacked, they multiply (5 × 5 × 5 requests and 200 s before a
    persistent 503 SlowDown is reported, measured on the test server).
    """
    protocol = fsspec.utils.get_protocol(url)
    if protocol not in ("s3", "s3a") or "::" in url:
        return fsspec.core.url_to_fs(url, **options)
    token = fsspec.utils.tokenize(os.getpid(), protocol, options)
    with _S3_LOCK:
        fs = _S3_FILESYSTEMS.get(token)
        if fs is None:
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            fs = fsspec.filesystem(
                protocol, skip_instance_cache=True, **{**options, "config_kwargs": config}
            )
            fs.retries = 1  # s3fs's own retry loop (an attribute, not an option)
            _S3_FILESYSTEMS[token] = fs
    return fs, fs._strip_protocol(url)


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process-wide I/O pool (recreated after a fork, whose child has no pool threads)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (
                os.getpid(),
                ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckptkit-io"),
            )
        return _POOL[1]


#: errno values of failures worth retrying (s3fs maps 503 / SlowDown to EBUSY, 500 to EREMOTEIO).
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
#: Exception classes (by name, so no client library needs importing) of dropped connections.
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "IncompleteRead",
    "ResponseStreamingError",
    "ProtocolError",
}
_THROTTLING = ("SlowDown", "Throttl", "reduce your request rate", "TooManyRequests")


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` or its causes (aiohttp, botocore, gcsfs…), if any."""
    seen = 0
    while exc is not None and seen < 5:
        for attr in ("status", "status_code", "code"):
            value = getattr(exc, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _classify(exc: BaseException) -> str:
    """``ours`` / ``missing`` / ``denied`` / ``range`` / ``transient`` / ``other``."""
    if isinstance(exc, CheckpointError):
        return "ours"
    status = _http_status(exc)
    if status in (401, 403) or isinstance(exc, PermissionError):
        return "denied"
    if status in (404, 410) or isinstance(exc, FileNotFoundError):
        return "missing"
    if status == 416 or "InvalidRange" in str(exc):
        return "range"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "transient"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return "transient"
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return "transient"
    if any(word in str(exc) for word in _THROTTLING):
        return "transient"
    return "other"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


#: Prefix of the staging folder inside a local destination, and of a remote destination's
#: staging folder in the local temporary directory.
STAGING_PREFIX = ".ckptkit-tmp-"
REMOTE_STAGING_PREFIX = "ckptkit-"
#: Inside a staging folder: who owns it (pid, host, process start), so a rerun can remove the
#: folders of killed runs; and where files replaced on commit are kept until it succeeds.
_OWNER_FILE = ".ckptkit-owner"
_REPLACED_DIR = ".ckptkit-replaced"
#: What the usual write errors mean, for messages.
_WRITE_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "name too long for the file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large for the file system",
    errno.EIO: "input/output error",
    errno.EISDIR: "a folder has that name",
}


class _DestinationPermissionError(DestinationError, PermissionError):
    """A :class:`DestinationError` for EACCES / EPERM, still a ``PermissionError`` as before."""


class AtomicOutput:
    """Files written into a destination all-or-nothing: under temporary names, renamed on commit.

    Local destinations get a hidden ``.ckptkit-tmp-*`` folder inside them (so the final rename
    stays on one file system); other stores get a local staging folder whose files are uploaded
    on commit, each appearing whole under its final key (and removed again if a later upload
    fails). Nothing exists under a final name until :meth:`commit`; :meth:`discard` removes every
    temporary file, and so does :meth:`commit` whether it succeeds or not. Each staging folder
    records its owner process, and a new AtomicOutput removes the staging folders of owners that
    are gone (a run killed mid-write). Output names must be safe relative names
    (:class:`OutputNameError`); write errors come out as :class:`DestinationError`.
    """

    def __init__(self, destination: Storage, *, overwrite: bool = False) -> None:
        self.destination = destination
        self.overwrite = overwrite
        self.local = destination.local
        self.names: list[str] = []
        self._dirs: set[str] = set()  # parent folders of the names, for clashes with files
        self._created: list[str] = []  # folders made for the destination, innermost first
        self._lock = threading.Lock()
        try:
            if self.local:
                self._created = _missing_folders(destination.root)
                os.makedirs(destination.root, exist_ok=True)
                parent, prefix = destination.root, STAGING_PREFIX
            else:
                parent, prefix = tempfile.gettempdir(), REMOTE_STAGING_PREFIX
            _remove_stale_staging(
                parent, prefix, restore_into=destination.root if self.local else None
            )
            self.staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError as exc:
            raise self._error("", exc) from exc
        try:
            _write_owner(self.staging)
        except OSError as exc:
            self.discard()
            raise self._error("", exc) from exc

    def _error(self, name: str, exc: OSError) -> DestinationError:
        """``exc`` (raised creating, writing or renaming output ``name``) as a DestinationError
        naming the destination file; its errno is kept."""
        if isinstance(exc, DestinationError):
            return exc
        reason = _WRITE_REASONS.get(exc.errno or 0, "write failed")
        permission = isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM)
        cls = _DestinationPermissionError if permission else DestinationError
        error = cls(
            f"{self.destination.describe(name)}: cannot write the output ({reason}: "
            f"{type(exc).__name__}: {_short(exc)}); nothing was left under a final name"
        )
        error.errno = exc.errno
        return error

    def _check_name(self, name: str) -> None:
        """Refuse an output name that could leave the destination or clash with another."""
        problem = _name_problem(name)
        if problem is None and name.split("/", 1)[0].startswith(".ckptkit-"):
            problem = "reserved for ckptkit's temporary files"
        if problem is not None:
            raise OutputNameError(
                f"{self.destination.describe()}: refused the output name {name!r} ({problem})"
            )

    def refuse_existing(self, names: Sequence[str]) -> None:
        """Fail early, before any work, if a final name exists and ``overwrite`` is off."""
        for name in names:
            self._check_name(name)
        if self.overwrite:
            return
        taken = [n for n in names if self.destination.exists(n)]
        if taken:
            raise OutputExistsError(
                f"{self.destination.describe(taken[0])} already exists (overwrite=True / --overwrite replaces it)"
            )

    def open(self, name: str) -> BinaryIO:
        """A new seekable file that will become ``name`` (relative to the destination); its
        write errors come out as :class:`DestinationError` naming the final file. Threads may
        open files of one output at the same time."""
        with self._lock:
            return self._open(name)

    def _open(self, name: str) -> BinaryIO:
        self._check_name(name)
        if name in self.names:
            raise OutputNameError(f"{self.destination.describe(name)} is written twice")
        parents: set[str] = set()
        up = posixpath.dirname(name)
        while up:
            parents.add(up)
            up = posixpath.dirname(up)
        if name in self._dirs or parents & set(self.names):
            raise OutputNameError(
                f"{self.destination.describe(name)}: a file and a folder of files would share "
                "this name"
            )
        path = os.path.join(self.staging, name)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            stream = builtins.open(path, "wb")  # noqa: SIM115 (the caller closes it)
        except OSError as exc:
            raise self._error(name, exc) from exc
        self.names.append(name)
        self._dirs |= parents
        return _OutputFile(stream, self, name)  # type: ignore[return-value]

    def commit(self) -> None:
        """Move every written file to its final name, all or nothing: if one fails, those
        already in place are taken back (local files they replaced are restored; replaced
        objects in a remote store are not) and the error is raised. The staging folder is
        removed in every case."""
        try:
            self.publish()
        finally:
            self.discard()

    def publish(self) -> list[tuple[str, str | None]]:
        """:meth:`commit` without the clean-up: every file in place or (on error) none, and
        what was published for :meth:`withdraw`, should a later step (another rank's
        publishing) fail. :meth:`discard` must follow."""
        self.refuse_existing(self.names)
        published: list[tuple[str, str | None]] = []  # (name, backup of what it replaced)
        try:
            for name in self.names:
                published.append((name, self._publish(name)))
        except BaseException:
            self.withdraw(published)
            raise
        return published

    def withdraw(self, published: list[tuple[str, str | None]]) -> None:
        """Take back files :meth:`publish` put in place (best effort, newest first)."""
        for name, backup in reversed(published):
            with contextlib.suppress(Exception):
                self._take_back(name, backup)

    def _publish(self, name: str) -> str | None:
        """Put ``name`` in place; the path where a local file it replaced was kept, if any."""
        staged, final = os.path.join(self.staging, name), self.destination.path(name)
        if not self.local:
            try:
                self.destination._call(name, self.destination.fs.put_file, staged, final)
            except AccessDeniedError:
                raise  # already names the file and says to check credentials
            except OSError as exc:
                raise self._error(name, exc) from exc
            return None
        try:
            return self._replace_local(name, staged, final)
        except OSError as exc:
            raise self._error(name, exc) from exc

    def _replace_local(self, name: str, staged: str, final: str) -> str | None:
        """Rename ``staged`` to ``final``; what ``final`` held is kept in the staging folder (a
        hard link where the file system allows, so ``final`` is never absent, even for a
        moment)."""
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.isdir(final) and not os.path.islink(final):
            raise IsADirectoryError(errno.EISDIR, "a folder is not replaced by a file", final)
        backup = None
        if os.path.lexists(final):
            backup = os.path.join(self.staging, _REPLACED_DIR, name)
            os.makedirs(os.path.dirname(backup), exist_ok=True)
            try:
                os.link(final, backup, follow_symlinks=False)
            except OSError:
                os.replace(final, backup)
        try:
            os.replace(staged, final)
        except BaseException:
            if backup is not None:
                os.replace(backup, final)
            raise
        return backup

    def _take_back(self, name: str, backup: str | None) -> None:
        final = self.destination.path(name)
        if not self.local:
            self.destination._call(name, self.destination.fs.rm_file, final)
        elif backup is not None:
            os.replace(backup, final)
        else:
            os.remove(final)

    def discard(self) -> None:
        """Remove the staging folder and everything in it, and the destination folders this
        output created if they stayed empty (an interrupted run leaves nothing behind)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        for folder in self._created:
            try:
                os.rmdir(folder)  # only when empty: never what someone else put there
            except OSError:
                break


def _missing_folders(path: str) -> list[str]:
    """The folders ``os.makedirs(path)`` would create, innermost first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


class _OutputFile:
    """An output file under its staging name whose OSErrors (a full disk, a quota, a read-only
    file system…) come out as :class:`DestinationError` naming the final file."""

    def __init__(self, stream: BinaryIO, output: AtomicOutput, name: str) -> None:
        self._stream, self._output, self.name = stream, output, name

    def _guarded(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except CheckpointError:
            raise
        except OSError as exc:
            raise self._output._error(self.name, exc) from exc

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

    def __enter__(self) -> _OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # the error under way matters more than one from closing
            with contextlib.suppress(OSError):
                self._stream.close()


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


# -- staging folders left behind by killed runs -------------------------------------------------


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks since boot), to
    tell a live owner from a later process that reuses its pid; None where /proc is missing."""
    try:
        with builtins.open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read(4096).decode("ascii", "replace")
        return text[text.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _write_owner(staging: str) -> None:
    """Record in ``staging`` which process on which host owns it."""
    pid = os.getpid()
    owner = {"pid": pid, "host": socket.gethostname(), "start": _process_start(pid)}
    with builtins.open(os.path.join(staging, _OWNER_FILE), "w", encoding="utf-8") as handle:
        json.dump(owner, handle)


def _owner_gone(staging: str) -> bool:
    """Whether the process that owns ``staging`` is known to be gone: it ran on this host and
    its pid is free or now another process's. False when unsure (no or unreadable owner file —
    perhaps being written —, another host, another user's process)."""
    try:
        fd = os.open(
            os.path.join(staging, _OWNER_FILE),
            os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW,
        )
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            owner = json.loads(os.read(fd, 4096))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    started = _process_start(pid)
    return owner.get("start") is not None and started is not None and started != owner["start"]


def _remove_stale_staging(parent: str, prefix: str, *, restore_into: str | None) -> None:
    """Remove the ``prefix*`` staging folders in ``parent`` whose owner is gone. Files they hold
    under ``.ckptkit-replaced/`` (a destination's earlier outputs, moved aside during a commit
    that was killed) go back under ``restore_into`` where their name is free."""
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if not entry.is_dir(follow_symlinks=False) or not _owner_gone(entry.path):
                continue
            if restore_into is not None:
                _restore_replaced(os.path.join(entry.path, _REPLACED_DIR), restore_into)
            shutil.rmtree(entry.path, ignore_errors=True)


def _restore_replaced(replaced: str, destination: str) -> None:
    """Put files kept in ``replaced`` back under ``destination`` where nothing took their name."""
    for folder, _, files in os.walk(replaced):
        for file in files:
            backup = os.path.join(folder, file)
            name = os.path.relpath(backup, replaced).replace(os.sep, "/")
            final = os.path.join(destination, name)
            if _name_problem(name) is None and not os.path.lexists(final):
                with contextlib.suppress(OSError):
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    os.replace(backup, final)
