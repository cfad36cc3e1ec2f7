"""All-or-nothing outputs: files staged under temporary names and put in place on commit, so a
killed, failing or refused run leaves the destination as it was, or complete.

Local destinations stage in a hidden ``.ckptkit-tmp-*`` folder inside them; on commit a journal
beside it lists the files first, each file is renamed into place (what it replaces kept by a hard
link until the end), and the journal goes last. Remote destinations stage in the local
temporary folder and upload on commit, the journal there; a large file to S3 goes up as
multipart-upload parts while it is written (:mod:`.multipart`), and commit completes the upload.
A later run settles what a killed one left (:mod:`.recovery`): rolled back if its journal is
still there, else just removed, its uploads aborted. Every
rename, link and removal in the destination or a staging folder goes through
:mod:`.anchored`: never through a symbolic link.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import posixpath
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from ..errors import (
    AccessDeniedError,
    DestinationError,
    OutputExistsError,
    OutputNameError,
)
from . import multipart, recovery
from .anchored import entry_status, folder_of, fsync_file, open_anchor, open_folder, remove_tree
from .multipart import RangedUpload
from .names import name_problem
from .protocol import RangedOutput
from .recovery import REPLACED_DIR
from .retry import error_summary
from .staged_files import RangedFile, StagedStream
from .store import Storage

__all__ = [
    "REMOTE_STAGING_PREFIX",
    "STAGING_PREFIX",
    "AtomicOutput",
    "atomic_output",
]

#: Prefix of the staging folder inside a local destination, and of a remote destination's
#: staging folder in the local temporary directory.
STAGING_PREFIX = ".ckptkit-tmp-"
REMOTE_STAGING_PREFIX = "ckptkit-"
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
    errno.ELOOP: "a symbolic link is in the way, and is not followed",
    errno.ENOTDIR: "a file is where a folder should be",
}

#: When a process started, as the owner checks tell (looked up here by older callers).
_process_start = recovery.process_start
#: ``published`` entries: a name and where the file it replaced was kept (local), if any.
_Published = list[tuple[str, str | None]]


class _DestinationPermissionError(DestinationError, PermissionError):
    """A :class:`DestinationError` for EACCES / EPERM, still a ``PermissionError`` as before."""


class AtomicOutput:
    """Files written into a destination all-or-nothing: under temporary names, put in place on
    commit.

    Local destinations get a hidden ``.ckptkit-tmp-*`` folder inside them (so the final rename
    stays on one file system); other stores get a local staging folder whose files are uploaded
    on commit (a large one to S3 is a multipart upload, completed then), each appearing whole
    under its final key (and removed again if a later upload fails). Nothing exists under a
    final name until :meth:`commit`; :meth:`discard` removes every temporary file and aborts
    every upload, and so does :meth:`commit` whether it succeeds or not. A staging folder's
    name records its owner process, and a new AtomicOutput first settles what owners that are
    gone left (a run killed mid-write or mid-commit, see :mod:`.recovery`). Output names must be
    safe relative names (:class:`OutputNameError`); write errors come out as
    :class:`DestinationError`.
    """

    def __init__(self, destination: Storage, *, overwrite: bool = False) -> None:
        self.destination = destination
        self.overwrite = overwrite
        self.local = destination.local
        self.names: list[str] = []
        self._dirs: set[str] = set()  # parent folders of the names, for clashes with files
        self._created: list[str] = []  # folders made for the destination, innermost first
        self._lock = threading.Lock()
        self._journal: str | None = None  # beside the staging folder while publishing
        self._stuck = False  # a take-back failed: the journal stays for the next run
        self._uploads: dict[str, RangedUpload] = {}  # files going up as multipart uploads
        self._sender = multipart.PartSender()  # their parts on the way, all files together
        try:
            if self.local:
                self._created = _missing_folders(destination.root)
                os.makedirs(destination.root, exist_ok=True)
                parent, prefix = destination.root, STAGING_PREFIX
            else:
                parent, prefix = tempfile.gettempdir(), REMOTE_STAGING_PREFIX
            self._parent = parent
            recovery.settle_stale(parent, prefix, destination)
            self.staging = tempfile.mkdtemp(prefix=recovery.owned_prefix(prefix), dir=parent)
        except OSError as exc:
            raise self._error("", exc) from exc
        self._staging_name = os.path.basename(self.staging)
        try:
            recovery.write_owner(self.staging)
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

    def open_ranges(self, name: str, size: int) -> RangedOutput:
        """A new file of ``size`` bytes that will become ``name``, written at offsets
        (:meth:`RangedFile.write_at`) by several threads at once: one output file spread over
        workers, each writing its own byte ranges. To an object store (S3), a file of two parts
        or more is a :class:`RangedUpload`: its parts go up as they are written, nothing is
        staged on local disk, and publishing completes the upload."""
        if self.uploads(size):
            return self._open_upload(name, size)
        with self._lock:
            path = self._staged_path(name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise self._error(name, exc) from exc
            self._register(name)
        file = RangedFile(fd, name, path, self._error)
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            file.close()
            raise self._error(name, exc) from exc
        return file

    def uploads(self, size: int) -> bool:
        """Whether a file of ``size`` bytes opened by :meth:`open_ranges` goes up to the object
        store as parts while it is written (two parts or more, to S3), never staged locally."""
        return (
            not self.local
            and multipart.supported(self.destination)
            and size >= 2 * multipart.part_bytes(size)
        )

    def _open_upload(self, name: str, size: int) -> RangedUpload:
        with self._lock:
            self._check_new(name)
            self._register(name)
        try:
            upload = multipart.RangedUpload(self.destination, name, size, self._sender)
        except OSError as exc:
            raise self._error(name, exc) from exc
        with self._lock:
            self._uploads[name] = upload
            try:  # before any part goes up: a run that finds this one killed aborts it
                destination = recovery.destination_id(self.destination)
                multipart.record_uploads(self.staging, self._uploads.values(), destination)
            except OSError as exc:
                upload.abort()
                raise self._error(name, exc) from exc
        return upload

    def join_ranges(self, name: str, handle: str, size: int) -> RangedOutput:
        """The file ``name`` that another process of the same job opened with
        :meth:`open_ranges` (another rank's output into this destination), opened to write
        byte ranges of it too, by its ``handle``: the multipart upload of that id, or locally
        the file staged at that path (refused unless it is a regular file of ``size`` bytes,
        never through a link). It stays the other process's to publish."""
        if self.uploads(size):
            try:
                return multipart.RangedUpload(
                    self.destination, name, size, self._sender, upload_id=handle
                )
            except OSError as exc:
                raise self._error(name, exc) from exc
        path = handle
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise self._error(name, exc) from exc
        file = RangedFile(fd, name, path, self._error, joined=True)
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size != size:
            file.close()
            raise DestinationError(
                f"{self.destination.describe(name)}: the file another rank staged at {path} "
                f"is not a file of {size} bytes here (does every rank see this destination?)"
            )
        return file

    def _open(self, name: str) -> BinaryIO:
        path = self._staged_path(name)
        try:
            stream = builtins.open(path, "wb")  # noqa: SIM115 (the caller closes it)
        except OSError as exc:
            raise self._error(name, exc) from exc
        self._register(name)
        return StagedStream(stream, name, self._error)  # type: ignore[return-value]

    def _staged_path(self, name: str) -> str:
        """Where ``name`` is staged (its folders made), once checked: a safe name, not written
        before, not a file where another name needs a folder or the other way round."""
        self._check_new(name)
        path = os.path.join(self.staging, name)  # in a folder of our own (mode 0700)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            raise self._error(name, exc) from exc
        return path

    def _check_new(self, name: str) -> None:
        """Refuse ``name`` unless it is a safe name, not written before, and no file where
        another name needs a folder or the other way round."""
        self._check_name(name)
        if name in self.names:
            raise OutputNameError(f"{self.destination.describe(name)} is written twice")
        if name in self._dirs or _parent_folders(name) & set(self.names):
            raise OutputNameError(
                f"{self.destination.describe(name)}: a file and a folder of files would share "
                "this name"
            )

    def _register(self, name: str) -> None:
        """Record ``name`` (now staged) as an output and its parents as folders."""
        self.names.append(name)
        self._dirs |= _parent_folders(name)

    def commit(self) -> None:
        """Put every written file under its final name, all or nothing: if one fails, those
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
        publishing) fail. :meth:`discard` must follow; until then a journal lists the files,
        so a run killed meanwhile is rolled back by the next one."""
        self.refuse_existing(self.names)
        self._write_journal()
        published: _Published = []
        try:
            for name in self.names:
                published.append((name, self._publish(name)))
            if self.local:
                self._flush_folders()
        except BaseException:
            self.withdraw(published)
            raise
        return published

    def _anchors_opened(self) -> tuple[int, int]:
        """Descriptors of the staging folder's parent (the destination, or the temporary
        folder) and of the staging folder, opened without following a link; the caller
        closes them."""
        parent = open_anchor(self._parent)
        try:
            return parent, open_folder(self._staging_name, parent)
        except BaseException:
            os.close(parent)
            raise

    @contextlib.contextmanager
    def _anchors(self) -> Iterator[tuple[int, int]]:
        """:meth:`_anchors_opened`, closed after the block."""
        parent, staging = self._anchors_opened()
        try:
            yield parent, staging
        finally:
            os.close(staging)
            os.close(parent)

    def _write_journal(self) -> None:
        """Flush the staged files and write the journal listing them (for a local destination:
        each staged file's identity, and whether it replaces one; for a remote one: whether the
        names were free, so a rollback may delete them)."""
        files: list[dict[str, Any]] = []
        name = ""
        try:
            parent, staging = self._anchors_opened()
        except OSError as exc:
            raise self._error("", exc) from exc
        try:
            if self.local:
                root = parent
                for name in self.names:
                    with folder_of(staging, name) as (folder, leaf):
                        status = entry_status(leaf, folder)
                        if status is None or not stat.S_ISREG(status.st_mode):
                            raise FileNotFoundError(
                                errno.ENOENT, "the staged file is gone", self.destination.path(name)
                            )
                        fsync_file(leaf, folder)
                    files.append(
                        {
                            "name": name,
                            "device": status.st_dev,
                            "inode": status.st_ino,
                            "replaced": self._final_status(root, name) is not None,
                        }
                    )
                record: dict[str, Any] = {"files": files}
            else:
                record = {
                    "destination": recovery.destination_id(self.destination),
                    "files": [{"name": n} for n in self.names],
                    "remove_on_rollback": not self.overwrite,  # the names were free
                }
            name = ""
            self._journal = recovery.write_journal(parent, self._staging_name, record)
        except OSError as exc:
            raise self._error(name, exc) from exc
        finally:
            os.close(staging)
            os.close(parent)

    def _final_status(self, root: int, name: str) -> os.stat_result | None:
        """What the destination holds under ``name`` (None: nothing, or no folder for it)."""
        try:
            with folder_of(root, name) as (folder, leaf):
                return entry_status(leaf, folder)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def withdraw(self, published: list[tuple[str, str | None]]) -> None:
        """Take back files :meth:`publish` put in place (best effort, newest first); if one
        cannot be, the journal stays, and the next run finishes taking them back."""
        failed = False
        for name, backup in reversed(published):
            try:
                self._take_back(name, backup)
            except Exception:
                failed = True
        if self._journal is None:
            return
        if failed:
            self._stuck = True
            return
        with contextlib.suppress(OSError), self._anchors() as (parent, _):
            recovery.remove_journal(parent, self._journal)
            self._journal = None

    def _publish(self, name: str) -> str | None:
        """Put ``name`` in place; where (under the staging folder) the local file it replaced
        was kept, if any."""
        if not self.local:
            staged, final = os.path.join(self.staging, name), self.destination.path(name)
            try:
                if name in self._uploads:
                    self._uploads[name].complete()
                    return None
                self.destination._call(name, self.destination.fs.put_file, staged, final)
            except AccessDeniedError:
                raise  # already names the file and says to check credentials
            except OSError as exc:
                raise self._error(name, exc) from exc
            return None
        try:
            return self._replace_local(name)
        except OSError as exc:
            raise self._error(name, exc) from exc

    def _replace_local(self, name: str) -> str | None:
        """Rename the staged ``name`` to its final name (folders made, never through a link);
        what the final name held is kept in the staging folder (a hard link where the file
        system allows, so the final name is never absent, even for a moment)."""
        with contextlib.ExitStack() as stack:
            root, staging = stack.enter_context(self._anchors())
            folder, leaf = stack.enter_context(folder_of(root, name, create=True))
            staged_folder, staged_leaf = stack.enter_context(folder_of(staging, name))
            existing = entry_status(leaf, folder)
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                raise IsADirectoryError(
                    errno.EISDIR, "a folder is not replaced by a file", self.destination.path(name)
                )
            backup = None
            if existing is not None:
                backup = f"{REPLACED_DIR}/{name}"
                kept, kept_leaf = stack.enter_context(folder_of(staging, backup, create=True))
                try:
                    os.link(
                        leaf, kept_leaf, src_dir_fd=folder, dst_dir_fd=kept, follow_symlinks=False
                    )
                except OSError:
                    os.rename(leaf, kept_leaf, src_dir_fd=folder, dst_dir_fd=kept)
            try:
                os.replace(staged_leaf, leaf, src_dir_fd=staged_folder, dst_dir_fd=folder)
            except BaseException:
                if backup is not None:
                    os.replace(kept_leaf, leaf, src_dir_fd=kept, dst_dir_fd=folder)
                raise
            return backup

    def _flush_folders(self) -> None:
        """Make the renames durable: flush every folder that received an output."""
        with contextlib.ExitStack() as stack:
            root, _ = stack.enter_context(self._anchors())
            for folder in sorted({posixpath.dirname(name) for name in self.names}):
                if not folder:
                    os.fsync(root)
                    continue
                with folder_of(root, f"{folder}/-") as (fd, _leaf):
                    os.fsync(fd)

    def _take_back(self, name: str, backup: str | None) -> None:
        if not self.local:
            self.destination._call(name, self.destination.fs.rm_file, self.destination.path(name))
            return
        with contextlib.ExitStack() as stack:
            root, staging = stack.enter_context(self._anchors())
            folder, leaf = stack.enter_context(folder_of(root, name))
            if backup is None:
                os.unlink(leaf, dir_fd=folder)
                return
            kept, kept_leaf = stack.enter_context(folder_of(staging, backup))
            os.replace(kept_leaf, leaf, src_dir_fd=kept, dst_dir_fd=folder)

    def discard(self) -> None:
        """Remove the staging folder and everything in it, and the destination folders this
        output created if they stayed empty (an interrupted run leaves nothing behind). After
        :meth:`publish`, this is the commit: the journal goes once nothing of the run is needed
        to roll it back, and last where nothing was replaced (whatever stops this process first,
        the next run then rolls it back)."""
        if self._stuck:
            return  # the next run finishes taking the published files back
        for upload in self._uploads.values():
            upload.abort()  # those not completed
        self._sender.close()
        with contextlib.suppress(OSError):
            anchor = open_anchor(self._parent)
            try:
                if self._journal is None:
                    remove_tree(anchor, self._staging_name)
                else:
                    self._finish(anchor, self._journal)
            finally:
                os.close(anchor)
        self.remove_created_folders()

    def remove_created_folders(self) -> None:
        """Remove the destination folders this output created, innermost first, while they
        are empty (never what someone else put there). :meth:`discard` does; call it again
        once other processes' staging folders inside them are gone (ranks of one job)."""
        while self._created:
            try:
                os.rmdir(self._created[0])
            except FileNotFoundError:
                pass  # another rank of the job made it too, and removed it
            except OSError:
                return
            del self._created[0]

    def _finish(self, anchor: int, journal: str) -> None:
        """Remove a published run's staging folder and journal: the journal last when nothing
        was replaced; else (or when the staging folder would not go) the journal first,
        flushed, then the rest, so a rollback never lacks the files kept of replaced ones and
        a published output is never rolled back for a clean-up that failed."""
        staging = self._staging_name
        self._created = []  # they hold the output now
        try:
            remove_tree(anchor, staging, keep=frozenset({REPLACED_DIR}))
            folder = open_folder(staging, anchor)
            try:
                replaced = entry_status(REPLACED_DIR, folder) is not None
            finally:
                os.close(folder)
            if not replaced:
                os.rmdir(staging, dir_fd=anchor)
        except OSError:
            replaced = True
        recovery.remove_journal(anchor, journal)
        self._journal = None
        if replaced:
            os.fsync(anchor)
            remove_tree(anchor, staging)


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


def _parent_folders(name: str) -> set[str]:
    """The folders ``name`` lies in (``a/b/c``: ``a/b`` and ``a``)."""
    parents = set()
    up = posixpath.dirname(name)
    while up:
        parents.add(up)
        up = posixpath.dirname(up)
    return parents


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
