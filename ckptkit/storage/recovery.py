"""What a killed run leaves behind, and how the next run settles it before anything else.

A staging folder's name says which process owns it (pid, process start, host), from the moment
it exists until it is gone; the owner file inside says it again for readers. While files are
being put under their final names, a *journal* beside the staging folder (``<staging>.journal``,
written whole before the first final name changes and removed last) lists them. A run whose
owner is gone is settled by the next run into the same place: with a journal, its publishing is
rolled back (files it put in place are removed, files they replaced restored; for a remote
destination, objects it uploaded are deleted), so the destination is as before the killed run;
without one (killed before publishing, or after its journal was removed: complete), its staging
folder is removed. All of it through :mod:`.anchored`: nothing in a staging folder or in the
destination is followed through a link, and only regular files are restored.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import stat
from typing import Any

from ..errors import CheckpointError, MissingFileError
from . import multipart
from .anchored import (
    entry_status,
    folder_of,
    open_anchor,
    open_folder,
    regular_files,
    remove_tree,
)
from .names import name_problem
from .store import Storage

__all__ = [
    "JOURNAL_SUFFIX",
    "OWNER_FILE",
    "REPLACED_DIR",
    "destination_id",
    "owned_prefix",
    "process_start",
    "remove_journal",
    "settle_stale",
    "write_journal",
    "write_owner",
]

#: Inside a staging folder: who owns it, and where files replaced on commit are kept until it
#: succeeds (``.ckptkit-replaced/<name>``).
OWNER_FILE = ".ckptkit-owner"
REPLACED_DIR = ".ckptkit-replaced"
#: Beside a staging folder, while its files are being published.
JOURNAL_SUFFIX = ".journal"
#: The journal is written here inside the staging folder, then renamed beside it.
_JOURNAL_DRAFT = ".ckptkit-journal"
#: A journal larger than this is not one of ours.
_JOURNAL_LIMIT = 64 << 20
_VERSION = 1


# -- owners ----------------------------------------------------------------------------------


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks since boot), to
    tell a live owner from a later process that reuses its pid; None where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read(4096).decode("ascii", "replace")
        return text[text.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:12]


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": process_start(pid)}


def owned_prefix(prefix: str) -> str:
    """``prefix`` followed by this process's identity (``<pid>.<start>.<host>-``): a staging
    folder named so is owned from the moment it exists, even before its owner file is written."""
    pid = os.getpid()
    return f"{prefix}{pid}.{process_start(pid) or 'x'}.{_host_tag()}-"


def _owner_in_name(name: str, prefix: str) -> dict[str, Any] | None:
    """The owner a staging folder's (or journal's) name records, None if it records none."""
    fields = name[len(prefix) :].split("-", 1)[0].split(".")
    if len(fields) != 3 or not fields[0].isdigit() or not fields[0].isascii():
        return None
    start = None if fields[1] == "x" else fields[1]
    return {"pid": int(fields[0]), "start": start, "host_tag": fields[2]}


def write_owner(staging: str) -> None:
    """Record in the staging folder ``staging`` which process on which host owns it."""
    with open(os.path.join(staging, OWNER_FILE), "w", encoding="utf-8") as handle:
        json.dump(_owner_record(), handle)


def _read_small(name: str, dir_fd: int, limit: int) -> bytes | None:
    """The regular file ``name`` of ``dir_fd`` (not through a link, not blocking on a FIFO),
    None when it is missing, not a regular file or larger than ``limit``."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd
        )
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size > limit:
            return None
        chunks, left = [], status.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _owner_gone(owner: Any) -> bool:
    """Whether the process ``owner`` names is known to be gone: it ran on this host and its pid
    is free or now another process's. False when unsure (another host, another user's process,
    nothing recorded)."""
    if not isinstance(owner, dict):
        return False
    if "host" in owner:
        if owner["host"] != socket.gethostname():
            return False
    elif owner.get("host_tag") != _host_tag():
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
    started = process_start(pid)
    recorded = owner.get("start")
    return recorded is not None and started is not None and started != recorded


def _folder_owner(anchor: int, name: str, prefix: str) -> Any:
    """Who owns the staging folder ``name``: its owner file, else its name."""
    try:
        fd = open_folder(name, anchor)
    except OSError:
        return None
    try:
        data = _read_small(OWNER_FILE, fd, 4096)
    finally:
        os.close(fd)
    if data is not None:
        with contextlib.suppress(ValueError):
            owner = json.loads(data)
            if isinstance(owner, dict):
                return owner
    return _owner_in_name(name, prefix)


# -- journals --------------------------------------------------------------------------------


def destination_id(destination: Storage) -> str:
    """How a remote destination is named in a journal (protocol and path: never options)."""
    return str(destination.fs.unstrip_protocol(destination.root))


def write_journal(anchor: int, staging_name: str, record: dict[str, Any]) -> str:
    """Write ``record`` (plus owner and version) as the journal of the staging folder
    ``staging_name`` of ``anchor``: drafted inside the folder, flushed to disk, then renamed
    beside it, so a journal is whole or absent. Its name."""
    data = json.dumps({"version": _VERSION, "owner": _owner_record(), **record}).encode()
    journal = staging_name + JOURNAL_SUFFIX
    staging = open_folder(staging_name, anchor)
    try:
        fd = os.open(
            _JOURNAL_DRAFT,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=staging,
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(_JOURNAL_DRAFT, journal, src_dir_fd=staging, dst_dir_fd=anchor)
    finally:
        os.close(staging)
    os.fsync(anchor)
    return journal


def remove_journal(anchor: int, journal: str) -> None:
    """Remove a journal: its publishing is over (complete, or rolled back)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal, dir_fd=anchor)


def _journal_files(record: Any) -> list[dict[str, Any]]:
    """The well-formed file entries of a journal read back (a journal is untrusted too)."""
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list):
        return []
    return [
        entry
        for entry in files
        if isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and _restorable(entry["name"])
    ]


def _restorable(name: str) -> bool:
    """Whether ``name`` may be put back under (or removed from) a destination."""
    return name_problem(name) is None and not name.split("/", 1)[0].startswith(".ckptkit-")


# -- settling what killed runs left ----------------------------------------------------------


def settle_stale(parent: str, prefix: str, destination: Storage) -> None:
    """Settle the ``prefix*`` staging folders and journals in ``parent`` whose owner is gone:
    journals first (their publishing rolled back, when ``destination`` is theirs), then the
    staging folders (files a killed commit kept under ``.ckptkit-replaced/`` go back where
    their name is free). Best effort: what cannot be settled now is left for a later run."""
    try:
        anchor = open_anchor(parent)
    except OSError:
        return
    try:
        names = [n for n in os.listdir(anchor) if n.startswith(prefix)]
        for name in names:
            if name.endswith(JOURNAL_SUFFIX):
                with contextlib.suppress(OSError, CheckpointError):
                    _settle_journal(anchor, name, prefix, destination)
        left = set(os.listdir(anchor))
        for name in names:
            if name in left and not name.endswith(JOURNAL_SUFFIX):
                with contextlib.suppress(OSError):
                    _settle_staging(anchor, name, prefix, destination, left)
    except OSError:
        pass
    finally:
        os.close(anchor)


def _ours(status: os.stat_result, destination: Storage) -> bool:
    """Whether an entry of the shared temporary folder is this user's (a remote destination's
    staging lives there, where anyone may plant a name)."""
    return destination.local or status.st_uid == os.geteuid()


def _settle_journal(anchor: int, journal: str, prefix: str, destination: Storage) -> None:
    status = entry_status(journal, anchor)
    if status is None or not stat.S_ISREG(status.st_mode) or not _ours(status, destination):
        return
    staging = journal[: -len(JOURNAL_SUFFIX)]
    data = _read_small(journal, anchor, _JOURNAL_LIMIT)
    record = None
    if data is not None:
        with contextlib.suppress(ValueError):
            record = json.loads(data)
    owner = record.get("owner") if isinstance(record, dict) else None
    if not _owner_gone(owner if isinstance(owner, dict) else _owner_in_name(staging, prefix)):
        return
    if destination.local:
        if isinstance(record, dict):
            _roll_back_local(anchor, staging, _journal_files(record))
        else:  # not one we wrote: at least what it kept goes back where the name is free
            _restore_replaced(anchor, staging)
    elif isinstance(record, dict):
        if record.get("destination") != destination_id(destination):
            return  # another destination's: kept for a run that writes there
        if record.get("remove_on_rollback") is True:
            _roll_back_remote(destination, _journal_files(record))
        _abort_uploads(anchor, staging, destination)
    remove_tree(anchor, staging)
    remove_journal(anchor, journal)


def _settle_staging(
    anchor: int, name: str, prefix: str, destination: Storage, entries: set[str]
) -> None:
    status = entry_status(name, anchor)
    if status is None or not stat.S_ISDIR(status.st_mode) or not _ours(status, destination):
        return  # a link or a file under a staging name is not ours: left alone
    if not _owner_gone(_folder_owner(anchor, name, prefix)):
        return
    if name + JOURNAL_SUFFIX in entries:
        if destination.local:
            return  # its journal's rollback needs what it kept: settled with the journal
        remove_tree(anchor, name)  # another destination's uploads: only the journal is needed
        return
    if destination.local:
        _restore_replaced(anchor, name)
    else:
        _abort_uploads(anchor, name, destination)
    remove_tree(anchor, name)


def _abort_uploads(anchor: int, staging: str, destination: Storage) -> None:
    """Abort the multipart uploads a dead owner's staging folder lists, when they went to
    ``destination`` (their parts are invisible, but stored until aborted)."""
    try:
        folder = open_folder(staging, anchor)
    except OSError:
        return
    try:
        data = _read_small(multipart.UPLOADS_FILE, folder, _JOURNAL_LIMIT)
    finally:
        os.close(folder)
    if data is not None:
        with contextlib.suppress(ValueError):
            multipart.abort_recorded(json.loads(data), destination, destination_id(destination))


def _roll_back_local(anchor: int, staging: str, files: list[dict[str, Any]]) -> None:
    """Undo a killed commit into the destination ``anchor``, newest first: a file it put in
    place (same device and inode as it staged) is removed, or replaced by what it kept of the
    earlier file; a kept file whose final name is free goes back."""
    try:
        kept = open_folder(staging, anchor)
    except OSError:
        kept = None
    try:
        for entry in reversed(files):
            with contextlib.suppress(OSError, TypeError):
                _roll_back_file(anchor, kept, entry)
    finally:
        if kept is not None:
            os.close(kept)


def _roll_back_file(anchor: int, kept: int | None, entry: dict[str, Any]) -> None:
    name = entry["name"]
    with contextlib.ExitStack() as stack:
        folder, leaf = stack.enter_context(folder_of(anchor, name))
        final = entry_status(leaf, folder)
        ours = (
            final is not None
            and stat.S_ISREG(final.st_mode)
            and [final.st_dev, final.st_ino] == [entry.get("device"), entry.get("inode")]
        )
        backup = None
        if kept is not None:
            with contextlib.suppress(OSError):
                where = stack.enter_context(folder_of(kept, f"{REPLACED_DIR}/{name}"))
                found = entry_status(where[1], where[0])
                if found is not None and stat.S_ISREG(found.st_mode):
                    backup = where
        if backup is not None and (final is None or ours):
            os.rename(backup[1], leaf, src_dir_fd=backup[0], dst_dir_fd=folder)
        elif ours and entry.get("replaced") is False:
            os.unlink(leaf, dir_fd=folder)


def _roll_back_remote(destination: Storage, files: list[dict[str, Any]]) -> None:
    """Delete the objects a killed upload may have put under final names (none existed)."""
    for entry in reversed(files):
        name = entry["name"]
        with contextlib.suppress(MissingFileError, FileNotFoundError):
            destination._call(name, destination.fs.rm_file, destination.path(name))


def _restore_replaced(anchor: int, staging: str) -> None:
    """Put the regular files a staging folder kept under ``.ckptkit-replaced/`` back under the
    destination ``anchor`` where nothing took their name (never through a link, either side)."""
    try:
        folder = open_folder(staging, anchor)
    except OSError:
        return
    try:
        for name in regular_files(folder, REPLACED_DIR):
            if not _restorable(name):
                continue
            with (
                contextlib.suppress(OSError),
                folder_of(folder, f"{REPLACED_DIR}/{name}") as (kept, kept_leaf),
                folder_of(anchor, name, create=True) as (final, leaf),
            ):
                if entry_status(leaf, final) is None:
                    _move_if_free(kept, kept_leaf, final, leaf)
    finally:
        os.close(folder)


def _move_if_free(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """Move the entry ``src`` to ``dst`` unless ``dst`` exists (a hard link refuses an
    existing name; a rename, where links are not supported, is checked first)."""
    try:
        os.link(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
    except FileExistsError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
            raise
        if entry_status(dst, dst_fd) is None:
            os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    os.unlink(src, dir_fd=src_fd)
