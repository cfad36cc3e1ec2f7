"""The :class:`Storage` class: one checkpoint location, every read checked and exact.

Names go through :mod:`~ckptkit.storage.names`, local reads through :mod:`~ckptkit.storage.local`,
remote ones through :mod:`~ckptkit.storage.remote`, and every store call through
:mod:`~ckptkit.storage.retry`. Local names are resolved by :class:`~ckptkit.storage.anchored.Beneath`
(folder by folder from the location's descriptor, links followed by ckptkit only while they stay
inside the folders the location may read), never by a path check apart from the use.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO, TypeVar

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
from .anchored import Beneath, Located, NotRegular, OutsideRoots, Root
from .names import is_http, name_problem
from .remote import Cache

__all__ = ["COALESCE_GAP", "Storage"]

#: Ranges closer than this are fetched in one request (bytes in between are read and dropped).
COALESCE_GAP = 0
_T = TypeVar("_T")


class Storage:
    """A directory-like location: ``Storage("s3://bucket/run/step100")`` or a local path.

    ``storage_options`` go to fsspec (as in pandas); ``cache="blocks"`` / ``"files"`` keep what
    is read from a remote store in a local temporary cache (fsspec's ``blockcache`` /
    ``filecache``) for repeated work, at the price of reading whole blocks / files.

    Locally, a symlink may lead only to a file inside the location (in a Hugging Face cache
    snapshot: or to its repository's ``blobs/``); ``allow_roots`` names more folders links may
    lead into (``allow_roots=["/data/ckpts"]``, links the user made to move a step elsewhere).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        cache: Cache | None = None,
        allow_roots: Iterable[str | os.PathLike[str]] | str | os.PathLike[str] | None = None,
        _fs=None,
        _lock: threading.Lock | None = None,
        _within: tuple[tuple[Root, ...], tuple[str, ...]] | None = None,
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
        #: More folders local links may lead into (absolute paths), as given to the constructor.
        self.allow_roots = _folders(allow_roots)
        if _within is None:
            _within = local.readable_roots(self.root, self.allow_roots) if self.local else ((), ())
        # the folders local reads may lead into (the first: where names start), and the names
        # from it down to this location (a sub-directory, or a file of a cache snapshot)
        self._roots, self._prefix = _within

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _sibling(self, root: str, url: str, prefix: tuple[str, ...] | None = None) -> Storage:
        """A Storage at ``root`` on the same filesystem; ``prefix``: names from this one's first
        readable folder down to it (it then reads inside the same folders), else its own."""
        other = Storage(
            root,
            self.storage_options,
            cache=self.cache,
            allow_roots=self.allow_roots,
            _fs=self.fs,
            _lock=self._lock,
            _within=None if prefix is None else (self._roots, prefix),
        )
        other.url = url
        other._http = self._http
        return other

    def child(self, rel: str) -> Storage:
        """The sub-directory ``rel`` as a Storage of its own (same filesystem and options),
        reading inside the same folders as this one; ``rel`` must be a safe relative name, as
        for :meth:`path`, and locally not a link leading outside (:class:`UnsafePathError`)."""
        path = self._resolve(rel)
        other = self._sibling(
            path, posixpath.join(self.url.rstrip("/"), rel), (*self._prefix, *rel.split("/"))
        )
        if self.local:
            with contextlib.suppress(OSError):  # missing or not a folder: found out on use
                other._local("", lambda: other._locate("", folder=True).close())
        return other

    def parent(self) -> tuple[Storage, str]:
        """The containing directory as a Storage, and this location's name in it."""
        root, url = posixpath.dirname(self.root) or "/", posixpath.dirname(self.url.rstrip("/"))
        up = self._sibling(root, url or ".", self._prefix[:-1] if self._prefix else None)
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

    # -- local files: regular files inside the readable folders only --------------------

    def _locate(self, rel: str, *, folder: bool = False) -> Located:
        """Where the local name ``rel`` leads (see :meth:`Beneath.locate`): walked from this
        location's first readable folder, links resolved by ckptkit and only inside them."""
        if rel:
            base, parts = self._prefix, rel.split("/")
        else:
            base, parts = self._prefix[:-1], self._prefix[-1:]
        with Beneath(self._roots, base) as walk:
            return walk.locate(parts, folder=folder)

    def _local(self, rel: str, call: Callable[[], _T]) -> _T:
        """``call()`` (a local look-up of ``rel``) with its errors as ckptkit's: a link leading
        outside or a file that is not a regular one is :class:`UnsafePathError` (FIFOs, devices
        and sockets are refused: ``/dev/zero`` never ends, opening a FIFO blocks forever)."""
        try:
            return self._call(rel, call)
        except OutsideRoots as exc:
            raise UnsafePathError(self._outside(rel, exc)) from None
        except NotRegular as exc:
            raise UnsafePathError(
                f"{self.describe(rel)}: not a regular file: {local.file_kind(exc.mode)}"
            ) from None

    def _outside(self, rel: str, exc: OutsideRoots) -> str:
        """The message for a link leading outside: which link, where to, and how to allow it."""
        top = str(self._roots[0])
        link = exc.link[len(top) + 1 :] if exc.link.startswith(top + "/") else exc.link
        allow = exc.target if exc.folder else posixpath.dirname(exc.target)
        where = ", ".join(str(root) for root in self._roots)
        return (
            f"{self.describe(rel)}: a symlink leading outside {where} ({link} leads to "
            f"{exc.target}); if that folder is yours, allow it: ckptkit.open(..., "
            f"allow_roots=[{allow!r}]), or --allow-root {allow} on the command line"
        )

    def _open_local(self, rel: str, walk: Beneath | None = None) -> tuple[int, int]:
        """A read-only descriptor of the regular file ``rel`` and its size (fstat), opened
        without blocking and without the system following any link (see :meth:`_locate`), so
        a FIFO or a link swapped in meanwhile is refused instead of waited on or followed.
        ``walk``: the batch's :class:`Beneath`, whose names are checked (one is made and ``rel``
        checked otherwise)."""
        if walk is None:
            self._resolve(rel)
            with Beneath(self._roots, self._prefix) as walk:
                return self._open_local(rel, walk)
        fd, status = self._local(rel, lambda: walk.open_file(rel.split("/")))
        return fd, status.st_size

    def _local_size(self, rel: str, walk: Beneath) -> int:
        """The size of the regular file ``rel`` (as :meth:`_open_local` would open it)."""

        def look_up() -> int:
            with walk.locate(rel.split("/")) as found:
                if found.name is None or not stat.S_ISREG(found.status.st_mode):
                    raise NotRegular(found.status.st_mode)
                return found.status.st_size

        return self._local(rel, look_up)

    def _local_listing(self, rel: str) -> dict[str, int]:
        """:meth:`listdir` of a local folder: names and kinds, looked up through any link (see
        :func:`~ckptkit.storage.local.folder_sizes`); a file lists itself, as in fsspec."""

        def listing() -> dict[str, int]:
            try:
                with self._locate(rel, folder=True) as found:
                    return local.folder_sizes(found.folder)
            except OutsideRoots:
                return local.path_sizes(self._resolve(rel, root_ok=True))
            except NotADirectoryError:
                if not rel and not self._prefix:
                    return local.path_sizes(self.root)  # the file the user named
                with self._locate(rel) as found:
                    return {posixpath.basename(rel or self.root): found.status.st_size}

        return self._local(rel, listing)

    def _local_kind(self, rel: str) -> int | None:
        """The ``st_mode`` of what the local name ``rel`` leads to, None when nothing is there;
        through a link leading outside as the system sees it (names and kinds, not bytes)."""
        if not rel and not self._prefix:  # the location itself, as the user named it
            with contextlib.suppress(OSError, ValueError):
                return os.stat(self.root).st_mode
            return None
        try:
            with self._locate(rel) as found:
                return found.status.st_mode
        except OutsideRoots:
            with contextlib.suppress(OSError, ValueError):
                return os.stat(self._resolve(rel, root_ok=True)).st_mode
        except OSError:
            pass
        return None

    # -- metadata --------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` (a file or directory) exists: a look-up of that name, not a listing.

        Access denied counts as absent: S3 answers 403 for a missing object to callers who may
        not list its bucket (public mirrors), so probing names must go on past it.
        """
        path = self._resolve(rel, root_ok=True)
        if self.local:
            return self._local_kind(rel) is not None
        try:
            self._call(rel, self.fs.info, path)
        except (MissingFileError, AccessDeniedError):
            return False
        return True

    def isdir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a directory (False too when the store refuses to list it)."""
        path = self._resolve(rel, root_ok=True)
        if self.local:
            return stat.S_ISDIR(self._local_kind(rel) or 0)
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
            if self.local:
                return self._local_listing(rel)
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

        def look_up(rel: str, walk: Beneath | None = None) -> int | None:
            try:
                return self.size(rel) if walk is None else self._local_size(rel, walk)
            except (MissingFileError, AccessDeniedError):  # 403: absent, see exists()
                return None

        if self.local:
            with Beneath(self._roots, self._prefix) as walk:
                return {rel: look_up(rel, walk) for rel in rels}
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
        """Size of the file ``rel`` in bytes (locally: of a regular file, see ``_open_local``)."""
        if self.local:
            self._resolve(rel)
            with Beneath(self._roots, self._prefix) as walk:
                return self._local_size(rel, walk)
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
        fstat, whatever length a record claims (large ranges: a reused one of the calling
        reader's pool, see :class:`~ckptkit.storage.local.ReadBuffers`); a range past the end,
        or a file that shrinks meanwhile, comes back short. The file is never memory-mapped: a
        mapped file that shrinks kills the process with SIGBUS."""
        blobs: list[bytes | memoryview] = []
        current: tuple[str, int, int] | None = None  # (rel, descriptor, size)
        walk = Beneath(self._roots, self._prefix)  # the folders opened once for the batch
        try:
            for rel, start, end, _ in requests:
                if current is None or current[0] != rel:
                    if current is not None:
                        os.close(current[1])
                        current = None
                    current = (rel, *self._open_local(rel, walk))
                _, fd, size = current
                length = min(end, size) - start
                read = local.read_large if length >= local.LARGE_READ_MIN else local.pread
                blobs.append(self._call(rel, read, fd, start, length))
        finally:
            if current is not None:
                os.close(current[1])
            walk.close()
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


def _folders(
    given: Iterable[str | os.PathLike[str]] | str | os.PathLike[str] | None,
) -> tuple[str, ...]:
    """``allow_roots`` as absolute paths (one folder may be given alone)."""
    if given is None:
        return ()
    if isinstance(given, (str, os.PathLike)):
        given = [given]
    folders = []
    for folder in given:
        if not isinstance(folder, (str, os.PathLike)):
            raise UsageError(f"allow_roots takes folder paths, got {folder!r}")
        folders.append(os.path.abspath(os.path.expanduser(os.fspath(folder))))
    return tuple(folders)
