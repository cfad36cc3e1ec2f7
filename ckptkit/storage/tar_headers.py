"""Tar headers read and checked: the index of an uncompressed tar archive (ustar, GNU or pax
headers), each member's name, kind and byte range, from its headers alone.

Every header is untrusted: its checksum is checked, its numbers must be octal (or GNU
base-256) and its member must lie inside the archive; extended headers (pax ``x``/``g``, GNU
long names) and names are bounded in size, headers in number (:data:`MAX_HEADERS`); member names
go through :func:`~ckptkit.storage.names.name_problem` like every other name (no ``..``, not
absolute, no control characters) and a name given twice, or as a file and a folder, is refused.
Sparse and multi-volume members are refused. :mod:`~ckptkit.storage.tar_archive` reads the
members through this index.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from ..errors import CorruptRecordError, LimitExceededError, TruncatedFileError, UnsafePathError
from .anchored import MAX_DEPTH
from .names import name_problem
from .protocol import Store

__all__ = [
    "BLOCK",
    "GZIP_MAGIC",
    "MAX_EXTENDED_HEADER",
    "MAX_HEADERS",
    "MAX_NAMES_TOTAL",
    "MAX_NAME_BYTES",
    "TarIndex",
    "TarMember",
    "index_tar",
    "is_tar_header",
]

#: Tar's block: headers are one block, data is padded to whole blocks.
BLOCK = 512
#: The first bytes of a gzip stream (a compressed tar: members cannot be read in place).
GZIP_MAGIC = b"\x1f\x8b"
#: Headers read, at most (members, plus their pax / long-name headers): a planted archive of
#: millions of empty members is refused after this many, in bounded time and memory.
MAX_HEADERS = 65536
#: Bytes of one pax extended header or GNU long name / link name, at most.
MAX_EXTENDED_HEADER = 1 << 20
#: Bytes of one member name, at most (a path, not a document); folders deeper than
#: :data:`~ckptkit.storage.anchored.MAX_DEPTH` are refused as they are on disk.
MAX_NAME_BYTES = 4096
#: Bytes of all member names of one archive together, at most (the index's memory).
MAX_NAMES_TOTAL = 16 << 20
#: Bytes read first while walking the headers: the front of the archive, where NeMo's config
#: and small members' headers lie, in one request.
_FIRST_WINDOW = 64 << 10
#: Bytes read for each later header: a pax header, its record block and the member's header in
#: one request; at most 1 KiB of a large member's data is read with them.
_HEADER_READ = 3 * BLOCK

_USTAR = b"ustar\x0000"  # POSIX (pax writes the same)
_GNU = b"ustar  \x00"  # GNU tar and Python's GNU_FORMAT
_REGULAR = (b"0", b"\x00", b"7")  # regular, old regular, contiguous
_DIRECTORY = (b"5", b"D")  # directory, GNU dump directory
_SPECIAL = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"6": "a FIFO",
}
_PAX = (b"x", b"g", b"X")  # extended header for the next member, global, Solaris
_GNU_LONG = {b"L": "path", b"K": "linkpath"}
_REFUSED = {
    b"S": "a GNU sparse member",
    b"M": "a multi-volume continuation",
    b"N": "an old GNU long-name record",
}


@dataclass(frozen=True, slots=True)
class TarMember:
    """One entry of the archive: ``size`` bytes of data at ``offset`` in it; ``kind`` is
    ``"file"``, ``"dir"``, or what a special member is (``"a symbolic link"``…)."""

    name: str
    offset: int
    size: int
    kind: str = "file"
    #: where a link leads (never followed), for messages
    target: str = ""


@dataclass
class TarIndex:
    """Every member of one archive by its normalised name (no ``./``, no trailing ``/``), and
    each folder's children (folders only implied by their members' names included)."""

    #: the archive's size in bytes when it was indexed
    size: int
    members: dict[str, TarMember] = field(default_factory=dict)
    children: dict[str, dict[str, None]] = field(default_factory=lambda: {"": {}})


def is_tar_header(block: bytes) -> bool:
    """Whether ``block`` is a ustar / GNU tar header (magic at 257, checksum right): what the
    first block of an uncompressed tar holds."""
    return (
        len(block) >= BLOCK
        and (block[257:265] == _USTAR or block[257:265] == _GNU)
        and _checksum_ok(block[:BLOCK])
    )


def index_tar(container: Store, name: str) -> TarIndex:
    """The index of the tar archive ``name`` of ``container``, every header read and checked;
    raises :class:`CorruptRecordError` (:class:`TruncatedFileError`), :class:`UnsafePathError`
    or :class:`LimitExceededError` naming the archive and the member."""
    return _Scanner(container, name).scan()


# -- reading the headers --------------------------------------------------------------------


def _checksum_ok(header: bytes) -> bool:
    """The header's stored checksum equals the sum of its bytes with the checksum field read
    as spaces (unsigned, or signed as some old tars computed it)."""
    try:
        stored = _octal(header[148:156])
    except ValueError:
        return False
    rest = header[:148] + header[156:]
    unsigned = sum(rest) + 8 * 0x20
    signed = sum(b - 256 if b > 127 else b for b in rest) + 8 * 0x20
    return stored in (unsigned, signed)


def _octal(field: bytes) -> int:
    """A numeric header field: octal digits (NUL / space padded), or GNU base-256 (first byte
    0x80, a non-negative big-endian number); ValueError otherwise."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    if field[:1] and field[0] & 0x80:
        raise ValueError("a negative base-256 number")
    text = field.split(b"\x00", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise ValueError(f"not an octal number: {text[:16]!r}")
    return int(text, 8)


def _text(field: bytes) -> str:
    """A NUL-terminated name field, undecodable bytes kept as lone surrogates (which the name
    check then refuses, as for any file name)."""
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def _blocks(size: int) -> int:
    """``size`` bytes of data rounded up to whole blocks."""
    return -(-size // BLOCK) * BLOCK


class _Scanner:
    """Walks an archive's headers front to back: :data:`_FIRST_WINDOW` bytes at the front, then
    :data:`_HEADER_READ` bytes per header (large members' data is skipped, not read)."""

    def __init__(self, container: Store, name: str) -> None:
        self.container, self.name = container, name
        self.where = container.describe(name)
        self.size = container.size(name)
        self._window_at, self._window = 0, b""
        self._headers = 0  # headers read so far
        self._names_bytes = 0  # bytes of the member names so far
        self._pending: dict[str, str] = {}  # pax / GNU long-name fields for the next member

    def _bytes(self, start: int, length: int) -> bytes:
        """``length`` bytes of the archive at ``start`` (inside it: callers check)."""
        end = start + length
        if not (self._window_at <= start and end <= self._window_at + len(self._window)):
            ahead = _FIRST_WINDOW if start == 0 else _HEADER_READ
            stop = min(self.size, max(end, start + ahead))
            (data,) = self.container.read_ranges([(self.name, start, stop)])
            self._window_at, self._window = start, bytes(data)
        return self._window[start - self._window_at : end - self._window_at]

    def _fail(self, at: int, problem: str) -> CorruptRecordError:
        return CorruptRecordError(f"{self.where}: tar header at offset {at}: {problem}")

    def scan(self) -> TarIndex:
        """Every member's header read and checked, front to back, into a :class:`TarIndex`."""
        index = TarIndex(self.size)
        at = 0
        while (header := self._header(at)) is not None:
            at = self._entry(index, at, header)
        if self._pending:
            raise self._fail(at, "an extended header with no member after it")
        return index

    def _header(self, at: int) -> bytes | None:
        """The checked header block at ``at``, None where the archive ends (its end or its
        end-of-archive block)."""
        if at == self.size:
            return None  # no end-of-archive blocks: the archive ends after its last member
        if at + BLOCK > self.size:
            raise TruncatedFileError(
                f"{self.where}: truncated: a tar header at offset {at} needs {BLOCK} bytes, "
                f"the archive ends at {self.size}"
            )
        header = self._bytes(at, BLOCK)
        if header == bytes(BLOCK):
            return None  # the end-of-archive marker
        self._headers += 1
        if self._headers > MAX_HEADERS:
            raise LimitExceededError(
                f"{self.where}: more than {MAX_HEADERS} tar headers; refused (raise "
                "ckptkit.storage.tar_headers.MAX_HEADERS if the archive is genuine)"
            )
        if header[257:265] not in (_USTAR, _GNU):
            raise self._fail(at, "not a ustar, GNU or pax tar header (no 'ustar' magic)")
        if not _checksum_ok(header):
            raise self._fail(at, "bad checksum (a damaged or edited archive)")
        return header

    def _entry(self, index: TarIndex, at: int, header: bytes) -> int:
        """Index what the header at ``at`` describes (or keep an extended header's fields for
        the next one); the offset of the next header."""
        kind = header[156:157]
        try:
            size = _octal(header[124:136])
        except ValueError as exc:
            raise self._fail(at, f"size field: {exc}") from None
        data = at + BLOCK
        if kind in _PAX or kind in _GNU_LONG:
            self._pending.update(self._extended(at, kind, data, size))
            return data + _blocks(size)
        if kind in _REFUSED:
            raise self._fail(at, f"{_REFUSED[kind]}: not supported")
        pending, self._pending = self._pending, {}
        if "size" in pending:
            size = self._pax_size(at, pending["size"])
        name = pending.get("path") or self._header_name(header)
        self._names_bytes += self._check_name_size(at, name, self._names_bytes)
        if kind in _REGULAR and not name.endswith("/"):
            if data + size > self.size:
                raise TruncatedFileError(
                    f"{self.where}: tar member {name!r}: {size} bytes at offset {data}, the "
                    f"archive ends at {self.size} (truncated, or a forged size)"
                )
            self._add(index, TarMember(name, data, size), at)
            return data + _blocks(size)
        if kind in _DIRECTORY or kind in _REGULAR:
            folder = name[:-1] if name.endswith("/") else name
            self._add(index, TarMember(folder, data, 0, "dir"), at)
            return data  # tar writes no data for folders (as Python's tarfile reads them)
        if kind in _SPECIAL:
            target = pending.get("linkpath") or _text(header[157:257])
            self._add(index, TarMember(name, data, 0, _SPECIAL[kind], target), at)
            return data
        # an unknown type: its data skipped, the member never readable
        self._add(index, TarMember(name, data, 0, f"a member of tar type {kind!r}"), at)
        return data + _blocks(size)

    def _check_name_size(self, at: int, name: str, so_far: int) -> int:
        """The bytes of ``name``, refused beyond :data:`MAX_NAME_BYTES` (one name),
        :data:`MAX_NAMES_TOTAL` (all names) or :data:`~ckptkit.storage.anchored.MAX_DEPTH`
        folders deep."""
        size = len(name.encode("utf-8", "surrogateescape"))
        if size > MAX_NAME_BYTES or so_far + size > MAX_NAMES_TOTAL:
            limit = "one name" if size > MAX_NAME_BYTES else "all names together"
            raise LimitExceededError(
                f"{self.where}: tar member at offset {at}: names beyond the limit for {limit} "
                f"({MAX_NAME_BYTES if size > MAX_NAME_BYTES else MAX_NAMES_TOTAL} bytes); refused"
            )
        if name.count("/") > MAX_DEPTH:
            raise LimitExceededError(
                f"{self.where}: tar member at offset {at}: folders nested more than {MAX_DEPTH} "
                "deep; refused"
            )
        return size

    def _header_name(self, header: bytes) -> str:
        """The member name of a ustar header: POSIX ``prefix/name``; GNU keeps other fields
        where POSIX has the prefix."""
        name = _text(header[0:100])
        if header[257:265] == _USTAR:
            prefix = _text(header[345:500])
            if prefix:
                return f"{prefix}/{name}"
        return name

    def _extended(self, at: int, kind: bytes, data: int, size: int) -> dict[str, str]:
        """The fields a pax extended header (``path``, ``linkpath``, ``size``) or a GNU long
        name / link name sets for the next member; global pax headers set nothing here."""
        if size > MAX_EXTENDED_HEADER:
            raise LimitExceededError(
                f"{self.where}: tar header at offset {at}: an extended header of {size} bytes, "
                f"more than the limit of {MAX_EXTENDED_HEADER}; refused"
            )
        if data + size > self.size:
            raise TruncatedFileError(
                f"{self.where}: truncated: the extended header at offset {at} needs {size} "
                f"bytes, the archive ends at {self.size}"
            )
        payload = self._bytes(data, size)
        if kind in _GNU_LONG:
            return {_GNU_LONG[kind]: _text(payload)}
        fields = self._pax_records(at, payload)
        if any(key.startswith("GNU.sparse.") for key in fields):
            raise self._fail(at, "a GNU sparse member (pax): not supported")
        if kind == b"g":
            return {}
        return {key: fields[key] for key in ("path", "linkpath", "size") if key in fields}

    def _pax_records(self, at: int, payload: bytes) -> dict[str, str]:
        """``"<length> <key>=<value>\\n"`` records, each length checked."""
        fields: dict[str, str] = {}
        pos = 0
        while pos < len(payload):
            if payload[pos:].strip(b"\x00") == b"":
                break  # NUL padding
            space = payload.find(b" ", pos, pos + 21)
            digits = payload[pos:space] if space > pos else b""
            if not digits.isdigit():
                raise self._fail(at, "a malformed pax record (no length)")
            length = int(digits)
            record = payload[pos : pos + length]
            if length <= space - pos + 1 or len(record) != length or record[-1:] != b"\n":
                raise self._fail(at, "a malformed pax record (its length disagrees)")
            key, sep, value = record[space - pos + 1 : -1].partition(b"=")
            if not sep:
                raise self._fail(at, "a malformed pax record (no '=')")
            fields[key.decode("utf-8", "surrogateescape")] = value.decode(
                "utf-8", "surrogateescape"
            )
            pos += length
        return fields

    def _pax_size(self, at: int, text: str) -> int:
        if not (text.isascii() and text.isdigit()):
            raise self._fail(at, f"a pax size that is not a number: {text[:32]!r}")
        return int(text)

    def _add(self, index: TarIndex, member: TarMember, at: int) -> None:
        """Index ``member`` under its normalised name (``./`` dropped; the archive's own ``.``
        skipped), its folders implied; unsafe, repeated or clashing names refused."""
        name = member.name
        while name.startswith("./"):
            name = name[2:]
        if name in (".", "") and member.kind == "dir":
            return
        problem = name_problem(name)
        if problem is not None:
            raise UnsafePathError(
                f"{self.where}: tar member {member.name!r} at offset {at}: refused the name "
                f"({problem}): an archive may only name files inside itself"
            )
        member = TarMember(name, member.offset, member.size, member.kind, member.target)
        known = index.members.get(name)
        clash = known is not None or (name in index.children and member.kind != "dir")
        if clash and not (member.kind == "dir" and (known is None or known.kind == "dir")):
            raise CorruptRecordError(
                f"{self.where}: tar member {name!r} at offset {at} is in the archive twice "
                "(as a file and a folder, or two files): which one is meant is ambiguous"
            )
        index.members[name] = member
        if member.kind == "dir":
            index.children.setdefault(name, {})
        child = name
        while child:
            folder = posixpath.dirname(child)
            if child in index.children.get(folder, ()):
                break  # its folders were indexed with an earlier member
            known = index.members.get(folder)
            if known is not None and known.kind != "dir":
                raise CorruptRecordError(
                    f"{self.where}: tar member {name!r} at offset {at} lies in {folder!r}, "
                    "which the archive holds as a file"
                )
            index.children.setdefault(folder, {})[child] = None
            child = folder
