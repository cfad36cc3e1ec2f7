"""Stores over fsspec: the filesystem factory (S3 without client-side retries, optional local
caches), the shared I/O pool, large remote ranges fetched in bounded pieces, a sequential stream."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .. import tunables
from ..extras import require_protocols

__all__ = [
    "CACHE_BLOCK",
    "CACHE_PROTOCOLS",
    "MAX_IN_FLIGHT",
    "Cache",
    "RemoteStream",
    "fetch_requests",
    "open_filesystem",
    "run_parallel",
]

#: Remote requests in flight at once (a shared pool of this many I/O threads).
MAX_IN_FLIGHT = 8
#: Block size of the ``cache="blocks"`` local cache (fsspec's ``blockcache``).
CACHE_BLOCK = 4 << 20

Cache = Literal["blocks", "files"]
#: The fsspec protocol of each ``cache=`` choice.
CACHE_PROTOCOLS = {"blocks": "blockcache", "files": "filecache"}


def open_filesystem(
    url: str, options: dict[str, Any], cache: Cache | None
) -> tuple[Any, str, Cache | None]:
    """The fsspec filesystem and path for ``url`` (listings fsspec cached for it dropped, so
    each open sees the store as it is now), behind fsspec's ``cache`` layer if one is asked for
    and the store is remote; and the cache in use (None for local files: nothing to gain)."""
    fs, root = _filesystem(url, options)
    _forget_listings(fs, root)
    if isinstance(fs, LocalFileSystem):
        return fs, root, None
    if cache is not None:
        fs = fsspec.filesystem(CACHE_PROTOCOLS[cache], fs=fs)
    return fs, root, cache


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
    retries off unless ``config_kwargs`` sets botocore's, so
    :func:`~ckptkit.storage.retry.call_with_retries` is the one place that retries: stacked, they
    multiply (5 × 5 × 5 requests and 200 s before a persistent 503 SlowDown is reported, measured
    on the test server).
    """
    require_protocols(url)
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


def run_parallel(tasks: list[Callable[[], Any]], *, serial: bool = False) -> list[Any]:
    """Run ``tasks`` on the I/O pool, at most :data:`MAX_IN_FLIGHT` at a time (one after another
    here when ``serial``: a store behind a lock); the first error cancels what has not started
    and is raised once the rest have finished."""
    if len(tasks) <= 1 or serial:
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


def fetch_requests(
    requests: Sequence[Sequence[Any]],
    *,
    get: Callable[[str, int, int], bytes],
    size_of: Callable[[str], int | None],
    serial: bool = False,
) -> list[bytes | bytearray]:
    """The bytes of every ``(rel, start, end, …)`` request at once, each split into pieces of at
    most :data:`~ckptkit.tunables.MAX_REQUEST` bytes fetched in parallel with ``get(rel, start,
    end)``; a piece that comes back short ends its request there. Before a large request is
    split, the object's size is looked up with ``size_of`` (once per file and call) and the
    request clamped to it, so a claimed length never becomes an allocation."""
    sizes: dict[str, int | None] = {}
    blobs: list[Any] = []
    pieces: list[tuple[int, str, int, int]] = []  # (request index, rel, start, end)
    for index, (rel, start, end, _) in enumerate(requests):
        known = end - start <= tunables.MAX_REQUEST
        if not known:
            if rel not in sizes:
                sizes[rel] = size_of(rel)
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
        data = get(rel, start, end)
        if isinstance(blobs[index], _PiecedBlob):
            blobs[index].put(start, end, data)
        else:
            blobs[index] = data

    run_parallel([lambda p=p: fetch(*p) for p in pieces], serial=serial)
    return [b.valid() if isinstance(b, _PiecedBlob) else b for b in blobs]


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


class RemoteStream(io.RawIOBase):
    """A remote file of ``size`` bytes read front to back in exact pieces of
    :data:`~ckptkit.tunables.SEQUENTIAL_PIECE` bytes, the next one prefetched; ``read_exact(start,
    end)`` fetches one piece, raising for a short one (a truncated file)."""

    def __init__(self, read_exact: Callable[[int, int], bytes], size: int) -> None:
        self.read_exact, self.size = read_exact, size
        self.position = 0
        self.piece, self.piece_start = b"", 0
        self.prefetch: tuple[int, Future] | None = None  # (start, the piece being fetched)
        self.prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-prefetch")

    def readable(self) -> bool:
        return True

    def _fetch(self, start: int) -> bytes:
        return self.read_exact(start, min(start + tunables.SEQUENTIAL_PIECE, self.size))

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
