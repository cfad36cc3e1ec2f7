"""All file access, over fsspec: exact byte ranges, coalesced and fetched together.

No other module opens files. A :class:`Storage` is one checkpoint location (a local path or any
fsspec URL: ``s3://``, ``gs://``, ``https://``, ``memory://``…); the rest of ckptkit names files
relative to it.

Local files are read directly. Remote stores get exact ranged requests (``cat_file(path, start,
end)``, never a read-ahead file object), at most :data:`MAX_REQUEST` bytes each and
:data:`MAX_IN_FLIGHT` at a time, retried with exponential backoff on transient errors (5xx,
throttling, connection resets) in :meth:`Storage._call`, the one place that also turns store
errors into ckptkit's (404 → :class:`MissingFileError`, 403 → :class:`AccessDeniedError`); for
S3 the client's own retries are switched off so they do not multiply (:func:`_filesystem`).
Nothing needs a listing: names are probed, sizes looked up one by one where a store cannot
list. ``cache=`` puts fsspec's ``blockcache`` / ``filecache`` in front of a remote store.
Writes go through :func:`atomic_output`: nothing appears under a final name before success.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import mmap
import os
import posixpath
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import (
    AccessDeniedError,
    CheckpointError,
    CorruptRecordError,
    MissingFileError,
    StorageError,
)

#: Ranges closer than this are fetched in one request (bytes in between are read and dropped).
COALESCE_GAP = 0
#: Upper bound of one request (coalesced ranges, or a piece of a larger range), so the memory a
#: request holds stays bounded; larger ranges are fetched in pieces, in parallel.
MAX_REQUEST = 16 << 20
#: Remote requests in flight at once (a shared pool of this many I/O threads).
MAX_IN_FLIGHT = 8
#: Piece size when streaming a whole remote file front to back (:meth:`Storage.open_sequential`);
#: the next piece is fetched while the current one is consumed.
SEQUENTIAL_PIECE = 8 << 20
#: Attempts per remote operation, and the first backoff (doubled after each failure, jittered).
#: Local ranges at least this large are memory-mapped instead of read (see ``_fetch_local``).
MMAP_MIN = 1 << 20
RETRY_ATTEMPTS = 5
RETRY_BACKOFF_S = 0.25
#: Block size of the ``cache="blocks"`` local cache (fsspec's ``blockcache``).
CACHE_BLOCK = 4 << 20

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
            raise ValueError(f"cache must be 'blocks', 'files' or None, not {cache!r}")
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

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _sibling(self, root: str, url: str) -> Storage:
        other = Storage(root, self.storage_options, cache=self.cache, _fs=self.fs, _lock=self._lock)
        other.url = url
        return other

    def child(self, rel: str) -> Storage:
        """The sub-directory ``rel`` as a Storage of its own (same filesystem and options)."""
        return self._sibling(self.path(rel), posixpath.join(self.url.rstrip("/"), rel))

    def parent(self) -> tuple[Storage, str]:
        """The containing directory as a Storage, and this location's name in it."""
        up = self._sibling(
            posixpath.dirname(self.root) or "/", posixpath.dirname(self.url.rstrip("/")) or "."
        )
        return up, posixpath.basename(self.root)

    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel`` (a name relative to this location)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would write it, for messages."""
        return posixpath.join(self.url.rstrip("/"), rel) if rel else self.url

    # -- metadata --------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` (a file or directory) exists: a look-up of that name, not a listing.

        Access denied counts as absent: S3 answers 403 for a missing object to callers who may
        not list its bucket (public mirrors), so probing names must go on past it.
        """
        if self.local:
            return os.path.exists(self.path(rel))
        try:
            self._call(rel, self.fs.info, self.path(rel))
        except (MissingFileError, AccessDeniedError):
            return False
        return True

    def isdir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a directory (False too when the store refuses to list it)."""
        if self.local:
            return os.path.isdir(self.path(rel))
        try:
            return bool(self._call(rel, self.fs.isdir, self.path(rel)))
        except (MissingFileError, AccessDeniedError):
            return False

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Names directly under ``rel`` mapped to their size in bytes (directories: -1).

        A store that cannot or may not list (plain HTTP, public buckets without ListBucket)
        raises :class:`MissingFileError` too, so format detection falls back to probing names.
        """
        try:
            listing = self._call(rel, self.fs.ls, self.path(rel), detail=True)
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
        made in parallel.
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
        missing = [rel for rel, size in out.items() if size is None or size < 0]

        def look_up(rel: str) -> int | None:
            try:
                return self.size(rel)
            except (MissingFileError, AccessDeniedError):  # 403: absent, see exists()
                return None

        out.update(
            zip(missing, self._parallel([lambda r=r: look_up(r) for r in missing]), strict=True)
        )
        return out

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes."""
        if self.local:
            try:
                return os.path.getsize(self.path(rel))
            except FileNotFoundError as exc:
                raise MissingFileError(f"{self.describe(rel)}: no such file") from exc
        size = self._size_or_none(rel)
        if size is None:
            raise StorageError(f"{self.describe(rel)}: the store does not report its size")
        return size

    def _size_or_none(self, rel: str) -> int | None:
        size = self._call(rel, self.fs.info, self.path(rel)).get("size")
        return None if size is None else int(size)

    # -- reading ---------------------------------------------------------------------------

    def read_file(self, rel: str) -> bytes:
        """A whole (small) file, such as an index or config file."""
        return self._call(rel, self.fs.cat_file, self.path(rel))

    @contextlib.contextmanager
    def open_sequential(self, rel: str) -> Iterator[BinaryIO]:
        """A file object for one front-to-back pass over a whole file (large metadata pickles).

        Remote files are fetched exactly, :data:`SEQUENTIAL_PIECE` bytes per request with the
        next piece in flight while the current one is consumed; a file shorter than its listed
        size raises :class:`CorruptRecordError`.
        """
        size = None if self.local or self.cache is not None else self._size_or_none(rel)
        if size is not None:
            handle = io.BufferedReader(_RemoteStream(self, rel, size), 1 << 20)
        elif self.local or self.cache is not None:
            kwargs = {"block_size": CACHE_BLOCK} if self.cache == "blocks" else {}
            handle = self._call(rel, self.fs.open, self.path(rel), "rb", **kwargs)
        else:  # a server that does not tell sizes: the whole file in one request
            handle = io.BytesIO(self.read_file(rel))
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
        if not self.local:
            with contextlib.suppress(CheckpointError, OSError):
                self.fs.invalidate_cache(self.path(rel))
                ends_at = self.size(rel)
        return CorruptRecordError(
            f"{self.describe(rel)}: truncated: bytes [{start}, {end}) requested, "
            f"the file ends at {ends_at}"
        )

    def _fetch_local(self, requests: list[list[Any]]) -> list[bytes | memoryview]:
        """Local fast path: each file opened once. Large ranges come back as read-only views of
        a memory map (no copy through read(), no fresh zero-filled pages: 4x less CPU when
        unsharding), small ones as bytes; a range past the end of the file comes back short."""
        blobs: list[bytes | memoryview] = []
        current: tuple[str, BinaryIO, int] | None = None
        try:
            for rel, start, end, _ in requests:
                if current is None or current[0] != rel:
                    if current is not None:
                        current[1].close()
                    handle = self._call(rel, builtins.open, self.path(rel), "rb")
                    current = (rel, handle, os.fstat(handle.fileno()).st_size)
                _, handle, size = current
                stop = min(end, size)  # never map past the end: that page would be SIGBUS
                if stop - start >= MMAP_MIN:
                    base = start - start % mmap.ALLOCATIONGRANULARITY
                    mapped = mmap.mmap(
                        handle.fileno(), stop - base, offset=base, access=mmap.ACCESS_READ
                    )
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                    blobs.append(memoryview(mapped)[start - base :])
                else:
                    handle.seek(start)
                    blobs.append(handle.read(end - start))
        finally:
            if current is not None:
                current[1].close()
        return blobs

    def _fetch_remote(self, requests: list[list[Any]]) -> list[bytes | bytearray]:
        """Every request at once, each split into pieces of at most :data:`MAX_REQUEST` bytes
        fetched in parallel; a piece that comes back short ends its request there."""
        blobs: list[Any] = []
        pieces: list[tuple[int, str, int, int]] = []  # (request index, rel, start, end)
        for index, (rel, start, end, _) in enumerate(requests):
            if end - start <= MAX_REQUEST:
                blobs.append(b"")
                pieces.append((index, rel, start, end))
            else:
                blobs.append(_PiecedBlob(start, end))
                pieces.extend(
                    (index, rel, lo, min(lo + MAX_REQUEST, end))
                    for lo in range(start, end, MAX_REQUEST)
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
        try:
            data = self._call(rel, self.fs.cat_file, self.path(rel), start=start, end=end, **kwargs)
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
        delay = RETRY_BACKOFF_S
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
    """A large range fetched in pieces into one buffer: valid up to the first short piece."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.buffer = bytearray(end - start)
        self.short: list[int] = []  # where pieces that came back short end (append: thread-safe)

    def put(self, start: int, end: int, data: bytes) -> None:
        at = start - self.start
        self.buffer[at : at + len(data)] = data
        if len(data) < end - start:
            self.short.append(at + len(data))

    def valid(self) -> bytearray:
        if self.short:
            del self.buffer[min(self.short) :]
        return self.buffer


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
        end = min(start + SEQUENTIAL_PIECE, self.size)
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


class AtomicOutput:
    """Files written into a destination all-or-nothing: under temporary names, renamed on commit.

    Local destinations get a hidden ``.ckptkit-tmp-*`` folder inside them (so the final rename
    stays on one file system); other stores get a local staging folder whose files are uploaded
    on commit, each appearing whole under its final key (and removed again if a later upload
    fails). Nothing exists under a final name until :meth:`commit`; :meth:`discard` removes every
    temporary file.
    """

    def __init__(self, destination: Storage, *, overwrite: bool = False) -> None:
        self.destination = destination
        self.overwrite = overwrite
        self.local = destination.local
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
        """Move every written file to its final name, all or nothing: if one fails, those
        already in place are taken back (local files they replaced are restored; replaced
        objects in a remote store are not) and the error is raised."""
        self.refuse_existing(self.names)
        published: list[tuple[str, str | None]] = []  # (name, backup of what it replaced)
        try:
            for name in self.names:
                published.append((name, self._publish(name)))
        except BaseException:
            for name, backup in reversed(published):
                with contextlib.suppress(Exception):
                    self._take_back(name, backup)
            raise
        finally:
            self.discard()

    def _publish(self, name: str) -> str | None:
        """Put ``name`` in place; the path where a local file it replaced was kept, if any."""
        staged, final = os.path.join(self.staging, name), self.destination.path(name)
        if not self.local:
            self.destination._call(name, self.destination.fs.put_file, staged, final)
            return None
        os.makedirs(os.path.dirname(final), exist_ok=True)
        backup = None
        if os.path.lexists(final):
            backup = os.path.join(self.staging, ".replaced", name)
            os.makedirs(os.path.dirname(backup), exist_ok=True)
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
