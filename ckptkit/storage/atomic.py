"""All-or-nothing outputs: files staged under temporary names and renamed (or uploaded) into
place on commit, and the staging folders of killed runs removed by the next run."""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import posixpath
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from ..errors import (
    AccessDeniedError,
    CheckpointError,
    DestinationError,
    OutputExistsError,
    OutputNameError,
)
from .names import name_problem
from .retry import error_summary
from .store import Storage

__all__ = ["REMOTE_STAGING_PREFIX", "STAGING_PREFIX", "AtomicOutput", "atomic_output"]

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
            f"{type(exc).__name__}: {error_summary(exc)}); nothing was left under a final name"
        )
        error.errno = exc.errno
        return error

    def _check_name(self, name: str) -> None:
        """Refuse an output name that could leave the destination or clash with another."""
        problem = name_problem(name)
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
            if name_problem(name) is None and not os.path.lexists(final):
                with contextlib.suppress(OSError):
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    os.replace(backup, final)
