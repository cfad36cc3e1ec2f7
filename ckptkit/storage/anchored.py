"""File operations anchored on folder descriptors that never follow a symbolic link.

The all-or-nothing outputs move, restore and remove files inside a destination and inside
staging folders that a killed run (or someone else) left behind; a link planted there must not
send a rename or a delete anywhere else. Every folder below an anchor is opened component by
component with ``O_DIRECTORY | O_NOFOLLOW`` (a link is ``ELOOP``, a file ``ENOTDIR``), and
renames, links, unlinks and removals name one entry of such a folder (``dir_fd=``).

Reads walk the same way (:class:`Beneath`): a link met on the way is resolved by ckptkit itself,
allowed only while it stays inside the folders a location may read (:class:`Root`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = [
    "MAX_DEPTH",
    "MAX_LINKS",
    "Beneath",
    "Located",
    "NotRegular",
    "OutsideRoots",
    "Root",
    "entry_status",
    "folder_of",
    "fsync_file",
    "open_anchor",
    "open_folder",
    "regular_files",
    "remove_tree",
]

#: Folders nested deeper than this are not walked (ckptkit's own never are): a planted tree
#: cannot exhaust descriptors or the stack.
MAX_DEPTH = 64
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_anchor(path: str) -> int:
    """A descriptor of the folder ``path`` itself (the destination or the temporary folder the
    user chose: a link there is theirs and is followed), to anchor the operations below."""
    return os.open(path, _FOLDER_FLAGS)


def open_folder(name: str, dir_fd: int) -> int:
    """A descriptor of the folder entry ``name`` of ``dir_fd``, never through a link (a link
    raises ``ELOOP``, whatever the system says first, a file ``ENOTDIR``)."""
    try:
        return os.open(name, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            status = entry_status(name, dir_fd)
            if status is not None and stat.S_ISLNK(status.st_mode):
                raise OSError(errno.ELOOP, "a symbolic link, not followed", name) from None
        raise


def entry_status(name: str, dir_fd: int) -> os.stat_result | None:
    """The entry ``name`` of ``dir_fd`` itself (a link is not followed), None when missing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def folder_of(anchor: int, name: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """The folder holding the relative ``name`` (``a/b/c.pt``) under ``anchor``, opened one
    component at a time without following a link, and ``name``'s last component; missing
    folders are made when ``create``. A link or a file on the way raises (``ELOOP``,
    ``ENOTDIR``)."""
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        raise OSError(errno.ENAMETOOLONG, "too deeply nested", name)
    fd = os.dup(anchor)
    try:
        for part in parts[:-1]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            child = open_folder(part, fd)
            os.close(fd)
            fd = child
        yield fd, parts[-1]
    finally:
        os.close(fd)


def fsync_file(name: str, dir_fd: int) -> None:
    """Flush the regular file ``name`` of ``dir_fd`` to stable storage (not through a link)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def regular_files(anchor: int, name: str) -> list[str]:
    """The regular files under the folder ``name`` of ``anchor``, as names relative to it
    (``a/b.pt``); links, special files and folders deeper than :data:`MAX_DEPTH` are skipped,
    never followed. Empty when ``name`` is missing or not a folder."""
    found: list[str] = []

    def walk(fd: int, prefix: str, depth: int) -> None:
        for entry in sorted(os.listdir(fd)):
            status = entry_status(entry, fd)
            if status is None:
                continue
            if stat.S_ISREG(status.st_mode):
                found.append(prefix + entry)
            elif stat.S_ISDIR(status.st_mode) and depth < MAX_DEPTH:
                child = open_folder(entry, fd)
                try:
                    walk(child, f"{prefix}{entry}/", depth + 1)
                finally:
                    os.close(child)

    try:
        top = open_folder(name, anchor)
    except (FileNotFoundError, NotADirectoryError):
        return found
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link: not ours to walk
            return found
        raise
    try:
        walk(top, "", 1)
    finally:
        os.close(top)
    return found


def remove_tree(anchor: int, name: str, *, keep: frozenset[str] = frozenset()) -> None:
    """Remove the entry ``name`` of ``anchor``: a file or link is unlinked (never followed), a
    folder emptied entry by entry and removed. ``keep`` names entries of the top folder left in
    place (the folder then stays too). Raises OSError when something could not be removed."""
    status = entry_status(name, anchor)
    if status is None:
        return
    if not stat.S_ISDIR(status.st_mode):
        os.unlink(name, dir_fd=anchor)
        return
    _empty_folder(anchor, name, status, keep, 1)
    if not keep:
        os.rmdir(name, dir_fd=anchor)


def _empty_folder(
    parent: int, name: str, status: os.stat_result, keep: frozenset[str], depth: int
) -> None:
    """Remove what the folder ``name`` of ``parent`` holds, but ``keep``."""
    if depth > MAX_DEPTH:
        raise OSError(errno.ELOOP, "folders nested too deeply to remove", name)
    fd = open_folder(name, parent)
    try:
        if not os.path.samestat(status, os.fstat(fd)):  # swapped since it was looked at
            raise OSError(errno.EAGAIN, "folder replaced while being removed", name)
        for entry in os.listdir(fd):
            if entry in keep:
                continue
            inner = entry_status(entry, fd)
            if inner is None:
                continue
            if stat.S_ISDIR(inner.st_mode):
                _empty_folder(fd, entry, inner, frozenset(), depth + 1)
                os.rmdir(entry, dir_fd=fd)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)


# -- the read side: names resolved beneath allowed folders ---------------------------------
#
# Reading a checkpoint, ckptkit follows links itself: each folder is opened from the one before
# with ``O_NOFOLLOW``, and a link met on the way is read (``readlink``) and its target walked
# again from an allowed folder's descriptor, only while it stays inside one. There is no check
# apart from the use, so a folder swapped for a link meanwhile cannot send a read elsewhere.

#: Links followed (and entries found swapped) while resolving one name, at most (Linux's own
#: limit on links, ``MAXSYMLINKS``).
MAX_LINKS = 40
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_SKIPPED = ("", ".")


class Root(NamedTuple):
    """A folder names may resolve into: ``path`` opened as named (a link in it is the user's
    and is followed), then the folders ``below`` it one by one, never through a link."""

    path: str
    below: tuple[str, ...] = ()

    def __str__(self) -> str:
        return posixpath.join(self.path, *self.below)


class OutsideRoots(Exception):
    """A link met while resolving a name leads outside every allowed folder."""

    def __init__(self, link: str, target: str, *, folder: bool) -> None:
        super().__init__(f"{link} leads to {target}, outside the allowed folders")
        self.link = link  # the link's own path, as walked
        self.target = target  # where it leads: absolute, normalised by name
        self.folder = folder  # it stood for a folder (the name went on below it)


class NotRegular(Exception):
    """The name leads to something other than a regular file (``mode``: its ``st_mode``)."""

    def __init__(self, mode: int) -> None:
        super().__init__(f"not a regular file (mode {mode:o})")
        self.mode = mode


class Located:
    """Where a name led: the folder holding it (``folder``, a descriptor this object owns until
    :meth:`close`) and its entry there (``name``: never a link; None when the name is that folder
    itself), with the entry's own status."""

    __slots__ = ("folder", "name", "status")

    def __init__(self, folder: int, name: str | None, status: os.stat_result) -> None:
        self.folder, self.name, self.status = folder, name, status

    def close(self) -> None:
        os.close(self.folder)

    def __enter__(self) -> Located:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Beneath:
    """Names resolved below ``roots[0]`` (first down ``base``), links followed by ckptkit alone
    and only while they stay inside one of ``roots`` (at most :data:`MAX_LINKS` per name).

    A context for one batch of look-ups: the roots' descriptors and the folder ``base`` leads
    to are opened once, on first use, and closed on exit.
    """

    def __init__(self, roots: Sequence[Root], base: Sequence[str] = ()) -> None:
        self.roots = tuple(roots)
        self.base = tuple(base)
        self._anchors: dict[int, int] = {}
        self._spellings: list[list[list[str]]] | None = None
        self._start: _Position | None = None

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every descriptor this context opened."""
        if self._start is not None:
            self._start.release()
            self._start = None
        for fd in self._anchors.values():
            os.close(fd)
        self._anchors.clear()

    def locate(self, parts: Sequence[str], *, folder: bool = False) -> Located:
        """Where the components ``parts`` (below ``base``) lead; with ``folder`` the last one is
        opened as a folder too (``Located.name`` is then None). Missing: ``FileNotFoundError``;
        a file on the way: ``NotADirectoryError``; a link leading outside: :class:`OutsideRoots`."""
        position = self._base().borrow()
        try:
            name, status = self._walk(position, collections.deque(parts), into_last=folder)
            found = position.take_top()
            return Located(found, name, os.fstat(found) if status is None else status)
        finally:
            position.release()

    def open_file(self, parts: Sequence[str]) -> tuple[int, os.stat_result]:
        """A read-only descriptor of the regular file ``parts`` leads to, and its ``fstat``:
        opened without following a link nor blocking (a FIFO or device swapped in after the look
        is refused, :class:`NotRegular`, never waited on)."""
        for attempt in range(MAX_LINKS):
            with self.locate(parts) as found:
                if found.name is None or not stat.S_ISREG(found.status.st_mode):
                    raise NotRegular(found.status.st_mode)
                try:
                    fd = os.open(found.name, _FILE_FLAGS, dir_fd=found.folder)
                except OSError as exc:  # swapped for a link since the look: resolve again
                    if exc.errno == errno.ELOOP and attempt + 1 < MAX_LINKS:
                        continue
                    raise
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                os.close(fd)
                raise NotRegular(status.st_mode)
            return fd, status
        raise AssertionError("unreachable")

    # -- the walk ------------------------------------------------------------------------

    def _base(self) -> _Position:
        if self._start is None:
            position = _Position(0, [self._anchor(0)], [], borrowed=1)
            try:
                self._walk(position, collections.deque(self.base), into_last=True)
            except BaseException:
                position.release()
                raise
            self._start = position
        return self._start

    def _anchor(self, index: int) -> int:
        """The descriptor of ``roots[index]``, opened once per context."""
        if index not in self._anchors:
            root = self.roots[index]
            fd = open_anchor(root.path)
            try:
                for part in root.below:
                    child = open_folder(part, fd)
                    os.close(fd)
                    fd = child
            except BaseException:
                os.close(fd)
                raise
            self._anchors[index] = fd
        return self._anchors[index]

    def _walk(
        self, at: _Position, pending: collections.deque[str], *, into_last: bool
    ) -> tuple[str | None, os.stat_result | None]:
        """Move ``at`` along ``pending``; the last component's name and status (None, None when
        ``into_last`` or when the name ends on a folder)."""
        turns = 0  # links followed and entries found swapped: bounded together
        link: _Link | None = None
        while True:
            while pending and pending[0] in _SKIPPED:
                pending.popleft()
            if not pending:
                return None, None
            part = pending.popleft()
            if part == "..":
                if at.depth:
                    at.up()
                else:  # above an allowed folder: by name, from where it really is
                    pending = self._enter(at, [*self._real(at.zone), "..", *pending], link)
                continue
            last = not into_last and all(p in _SKIPPED for p in pending)
            status = self._look(at, part, last=last)
            if status is None:
                continue  # a folder, entered
            if last and not stat.S_ISLNK(status.st_mode):
                return part, status
            turns += 1
            if turns > MAX_LINKS:
                raise OSError(errno.ELOOP, f"more than {MAX_LINKS} symbolic links", part)
            target = _link_target(at, part, status)
            if target is None:  # swapped meanwhile: look again
                pending.appendleft(part)
                continue
            where = posixpath.join(str(self.roots[at.zone]), *at.names, part)
            link = _Link(at, part, target, where, folder=not last)
            if target.startswith("/"):
                pending = self._enter(at, [*target.split("/"), *pending], link, by_name=False)
            else:
                pending.extendleft(reversed(target.split("/")))

    @staticmethod
    def _look(at: _Position, part: str, *, last: bool) -> os.stat_result | None:
        """The last component's own status; else enter the folder ``part`` (None) or, when it
        is not one, its status (a link, or a folder swapped back in meanwhile)."""
        if last:
            return os.stat(part, dir_fd=at.top, follow_symlinks=False)
        try:
            at.down(part, open_folder(part, at.top))
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            status = entry_status(part, at.top)
            if status is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", part) from None
            if not (stat.S_ISLNK(status.st_mode) or stat.S_ISDIR(status.st_mode)):
                raise
            return status

    def _enter(
        self, at: _Position, path: list[str], link: _Link | None, *, by_name: bool = True
    ) -> collections.deque[str]:
        """Move ``at`` to the allowed folder the absolute ``path`` (components) lies in and
        return the components below it; :class:`OutsideRoots` when it lies in none. ``path``
        is matched with ``..`` taken by name; unless ``by_name``, first as written and last as
        the system resolves it (a link target spelled through another link to an allowed
        folder): only to find which folder, the rest is walked from its descriptor again."""
        written = [p for p in path if p not in _SKIPPED]
        for candidate in _candidates(written, by_name=by_name):
            best: tuple[int, int] | None = None
            for index, spellings in enumerate(self._all_spellings()):
                for spelling in spellings:
                    n = len(spelling)
                    if candidate[:n] == spelling and (best is None or n > best[1]):
                        best = (index, n)
            if best is not None:
                at.reset(best[0], self._anchor(best[0]))
                return collections.deque(candidate[best[1] :])
        if link is None:
            where = "/" + "/".join(_by_name(written))
            raise OutsideRoots(str(self.roots[at.zone]), where, folder=True)
        raise OutsideRoots(link.path, link.absolute(self), folder=link.folder)

    def _all_spellings(self) -> list[list[list[str]]]:
        """Each root's path as components: as named, and as it really is (links resolved)."""
        if self._spellings is None:
            self._spellings = []
            for root in self.roots:
                named = _by_name(os.path.abspath(root.path).split("/")) + list(root.below)
                real = _by_name(os.path.realpath(root.path).split("/")) + list(root.below)
                self._spellings.append([named, real])
        return self._spellings

    def _real(self, index: int) -> list[str]:
        """``roots[index]`` as it really is (links in its path resolved), as components."""
        return self._all_spellings()[index][1]


class _Link:
    """A link met during a walk, for the message when it leads outside."""

    __slots__ = ("folder", "path", "target", "where", "zone")

    def __init__(self, at: _Position, name: str, target: str, path: str, *, folder: bool) -> None:
        self.zone, self.where = at.zone, (*at.names, name)
        self.target, self.path, self.folder = target, path, folder

    def absolute(self, beneath: Beneath) -> str:
        """Where the link leads, as an absolute path normalised by name."""
        if self.target.startswith("/"):
            return "/" + "/".join(_by_name(self.target.split("/")))
        here = beneath._real(self.zone) + list(self.where[:-1])
        return "/" + "/".join(_by_name([*here, *self.target.split("/")]))


class _Position:
    """A folder reached below an allowed one: the descriptors from that folder down (the first
    ``borrowed`` of them belong to someone else) and the names between them."""

    __slots__ = ("borrowed", "fds", "names", "zone")

    def __init__(self, zone: int, fds: list[int], names: list[str], *, borrowed: int) -> None:
        self.zone, self.fds, self.names, self.borrowed = zone, fds, names, borrowed

    @property
    def top(self) -> int:
        return self.fds[-1]

    @property
    def depth(self) -> int:
        return len(self.fds) - 1

    def borrow(self) -> _Position:
        """A copy starting here, owning none of these descriptors."""
        return _Position(self.zone, list(self.fds), list(self.names), borrowed=len(self.fds))

    def down(self, name: str, fd: int) -> None:
        if len(self.fds) > MAX_DEPTH:
            os.close(fd)
            raise OSError(errno.ENAMETOOLONG, "folders nested too deeply", name)
        self.fds.append(fd)
        self.names.append(name)

    def up(self) -> None:
        fd = self.fds.pop()
        self.names.pop()
        if len(self.fds) >= self.borrowed:
            os.close(fd)
        else:
            self.borrowed = len(self.fds)

    def take_top(self) -> int:
        """The current folder's descriptor, now the caller's."""
        if len(self.fds) > self.borrowed:
            self.names.pop()
            return self.fds.pop()
        return os.dup(self.fds[-1])

    def reset(self, zone: int, anchor: int) -> None:
        self.release()
        self.zone, self.fds, self.names, self.borrowed = zone, [anchor], [], 1

    def release(self) -> None:
        """Close the descriptors this position owns."""
        while len(self.fds) > self.borrowed:
            os.close(self.fds.pop())
        del self.names[max(len(self.fds) - 1, 0) :]


def _by_name(parts: Sequence[str]) -> list[str]:
    """Path components with ``.`` and empty ones dropped and ``..`` taken by name."""
    out: list[str] = []
    for part in parts:
        if part == "..":
            if out:
                out.pop()
        elif part not in _SKIPPED:
            out.append(part)
    return out


def _link_target(at: _Position, part: str, status: os.stat_result) -> str | None:
    """What the link ``part`` of the current folder holds; None when it is no longer a link."""
    if not stat.S_ISLNK(status.st_mode):
        return None
    try:
        return os.readlink(part, dir_fd=at.top)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None


def _candidates(written: list[str], *, by_name: bool) -> Iterator[list[str]]:
    """The spellings :meth:`Beneath._enter` tries for an absolute path, in order."""
    if not by_name:
        yield written
    yield _by_name(written)
    if not by_name:
        yield _by_name(os.path.realpath("/" + "/".join(written)).split("/"))
