"""ckptkit's own local files (the run-statistics cache), safe in a folder others can write to.

A file is written whole under a fresh random name created exclusively beside it (never through
a link planted at a name ckptkit would use, readable by its owner only) and renamed into place;
it is read only if it is a regular file of the current user: a link there is not followed, a
FIFO not waited on, and a file another user put there not trusted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from ..errors import UnsafePathError
from .local import file_kind, pread

__all__ = ["PRIVATE_MODE", "TEMPORARY_SUFFIX", "read_private_file", "write_private_file"]

#: Permissions of the files written: the owner's only.
PRIVATE_MODE = 0o600
#: Temporary files are ``.<name>.<random>`` plus this, beside the file they become.
TEMPORARY_SUFFIX = ".tmp"
#: Random names tried before giving up (one clash in 2**64 is already unlikely).
_NAME_ATTEMPTS = 16


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Put ``data`` at ``path`` all at once: written and flushed to a new file of a random name
    in the same folder, created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600),
    then renamed over ``path``, replacing whatever is there (a link there is replaced, its target
    untouched). The folder is created if missing; errors are ``OSError``."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    anchor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        temporary, fd = _create_exclusive(anchor, name)
        try:
            with os.fdopen(fd, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, name, src_dir_fd=anchor, dst_dir_fd=anchor)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=anchor)
            raise
    finally:
        os.close(anchor)


def _create_exclusive(anchor: int, name: str) -> tuple[str, int]:
    """A new file ``.<name>.<random>.tmp`` in the folder ``anchor``, opened for writing: created
    by this call (an existing file or link of that name is never opened)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NAME_ATTEMPTS):
        temporary = f".{name}.{secrets.token_hex(8)}{TEMPORARY_SUFFIX}"
        try:
            return temporary, os.open(temporary, flags, PRIVATE_MODE, dir_fd=anchor)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name for {name!r}")


def read_private_file(path: str | os.PathLike[str]) -> bytes | None:
    """The bytes of the file at ``path``, None when there is none. Opened without following a
    link and without blocking; a link, a FIFO or another non-regular file, or a file owned by
    another user, raises :class:`UnsafePathError` (not read); other errors are ``OSError``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path}: a symbolic link, not followed") from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UnsafePathError(f"{path}: not a regular file: {file_kind(status.st_mode)}")
        if status.st_uid != os.geteuid():
            raise UnsafePathError(
                f"{path}: owned by another user (uid {status.st_uid}), not trusted"
            )
        return bytes(pread(fd, 0, status.st_size))
    finally:
        os.close(fd)
