"""Decoding one record's bytes: torch.save zip archives, zstd frames, safetensors headers.

Pure functions over bytes already fetched; :mod:`ckptkit.reading` decides what to fetch.

A zip must give one answer whoever reads it: ``torch.load`` (miniz) takes the first of two
members of one name and trusts the central directory, Python's ``zipfile`` compares each local
header's name with it. So a name listed twice, a local header disagreeing with its central
directory entry (name, compression, sizes, CRC-32) and members overlapping each other or the
directory are refused (:class:`CorruptRecordError`, naming the file and the member).

Longer than most: the zip reader's consistency checks (one answer per file) sit beside the
records they guard.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..crc32 import crc32
from ..dtypes import DType
from ..errors import (
    ChecksumError,
    CorruptRecordError,
    FormatError,
    LimitExceededError,
    MissingFileError,
)
from ..storage import Store
from .bounded_repr import bounded_repr
from .pickle_limits import RECORD_LIMITS
from .unpickler import OBJECT_GLOBALS, TENSOR_GLOBALS, TensorRef, safe_loads

__all__ = [
    "Member",
    "TensorData",
    "zip_members",
    "end_record",
    "central_directory",
    "located",
    "local_header_range",
    "check_member_spans",
    "refuse_compressed",
    "ZipIndex",
    "read_safetensors_headers",
    "safetensors_file_headers",
    "read_zip_indexes",
    "MAX_INFLATED",
    "read_members",
    "inflate",
    "TorchArchive",
    "ARCHIVE_SLACK",
    "tensor_archive_limit",
    "undo_transform",
    "check_crc",
    "decode_tensor_record",
    "decode_object_record",
    "SafetensorsHeader",
    "MAX_SAFETENSORS_HEADER",
    "safetensors_header_length",
    "parse_safetensors_header",
]

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class Member:
    """A zip member: ``size`` bytes (uncompressed) whose data starts at ``offset`` within the
    archive; a compressed one (``method`` not 0, e.g. 8 = DEFLATE, as TorchScript's ``code/``)
    occupies ``compressed_size`` bytes there and is read only through :func:`inflate_member`."""

    offset: int
    size: int
    crc32: int
    method: int = 0
    compressed_size: int | None = None  # None: stored, the data is the ``size`` bytes

    @property
    def stored(self) -> bool:
        return self.method == 0

    @property
    def span(self) -> int:
        """Bytes the member's data occupies in the archive."""
        return self.size if self.compressed_size is None else self.compressed_size


@dataclass(frozen=True, slots=True)
class TensorData:
    """Element bytes plus the strided layout that reads them (strides/offset in elements)."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    buffer: memoryview
    #: CRC-32 of all of ``buffer``, when it was just checked against the one the file stores
    #: (a copy of the whole buffer can reuse it instead of computing it again).
    crc32: int | None = None


def zip_members(buf: memoryview, source: str) -> dict[str, Member]:
    """Members of a zip archive held in ``buf``, from its central directory (zip64 aware)."""
    count, cd_offset, cd_size = end_record(bytes(buf[-_TAIL:]), max(0, len(buf) - _TAIL), source)
    members: dict[str, Member] = {}
    local_offsets: dict[str, int] = {}
    for name, local, member in central_directory(
        bytes(buf[cd_offset : cd_offset + cd_size]), count, source
    ):
        start, end = local_header_range(local, name)
        members[name] = located(member, bytes(buf[start:end]), local, name, source)
        local_offsets[name] = local
        if members[name].offset + member.span > len(buf):
            raise CorruptRecordError(f"{source}: zip member {name!r} extends past the record's end")
    check_member_spans(members, local_offsets, cd_offset, source)
    return members


_EOCD64 = b"PK\x06\x06"
_TAIL = 22 + 0xFFFF  # the end-of-directory record plus the longest zip comment


def end_record(tail: bytes, start: int, source: str) -> tuple[int, int, int]:
    """``(members, central directory offset, its size)`` from a zip's last bytes ``tail``, which
    begin at offset ``start`` of the archive (zip64 aware)."""
    at = tail.rfind(_EOCD)
    if at < 0 or at + 22 > len(tail):
        raise CorruptRecordError(
            f"{source}: not a torch.save zip (no end-of-central-directory record)"
        )
    count, size, offset = struct.unpack_from("<10xHII", tail, at)
    if count == 0xFFFF or 0xFFFFFFFF in (size, offset):
        locator = at - 20
        if locator < 0 or tail[locator : locator + 4] != _EOCD64_LOCATOR:
            raise CorruptRecordError(f"{source}: zip64 archive without its end-record locator")
        (record,) = struct.unpack_from("<Q", tail, locator + 8)
        record -= start
        if record < 0 or record + 56 > len(tail) or tail[record : record + 4] != _EOCD64:
            raise CorruptRecordError(f"{source}: damaged zip64 end-of-central-directory record")
        count, size, offset = struct.unpack_from("<QQQ", tail, record + 32)
    return count, offset, size


def central_directory(buf: bytes, count: int, source: str) -> list[tuple[str, int, Member]]:
    """``(name, local header offset, member)`` of each member (its ``offset`` still unknown: 0);
    compressed members are listed with their method, to be refused by whatever reads them."""
    buf = bytes(buf)  # a large directory may arrive as a memory-mapped view
    members = []
    names: set[str] = set()
    pos = 0
    try:
        for _ in range(count):
            if buf[pos : pos + 4] != _CENTRAL:
                raise CorruptRecordError(f"{source}: damaged zip central directory")
            method, crc, csize, usize, name_len, extra_len, comment_len = struct.unpack_from(
                "<10xH4xIIIHHH", buf, pos
            )
            (local,) = struct.unpack_from("<I", buf, pos + 42)
            name = buf[pos + 46 : pos + 46 + name_len].decode("utf-8", "replace")
            extra = buf[pos + 46 + name_len : pos + 46 + name_len + extra_len]
            usize, csize, local = _zip64_sizes(extra, usize, csize, local)
            if method == 0 and csize != usize:
                raise CorruptRecordError(
                    f"{source}: stored zip member {name!r} has {csize} bytes but says {usize}"
                )
            if name in names:
                raise CorruptRecordError(
                    f"{source}: zip member {name!r} is listed twice (torch.load reads the first, "
                    "other readers the last)"
                )
            names.add(name)
            compressed = None if method == 0 else csize
            members.append((name, local, Member(0, usize, crc, method, compressed)))
            pos += 46 + name_len + extra_len + comment_len
    except struct.error as exc:
        raise CorruptRecordError(f"{source}: truncated zip central directory") from exc
    return members


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from a zip64 extra field, for the fields the classic record capped."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            # a field missing from the extra keeps its capped value: caught as a bad size later
            if usize == 0xFFFFFFFF:
                usize = next(values, usize)
            if csize == 0xFFFFFFFF:
                csize = next(values, csize)
            if offset == 0xFFFFFFFF:
                offset = next(values, offset)
            break
        pos += 4 + size
    return usize, csize, offset


def _data_offset(header: bytes, local: int, name: str, source: str) -> int:
    """Where a member's data starts, from its 30-byte local header at ``local``."""
    if header[:4] != _LOCAL or len(header) < 30:
        raise CorruptRecordError(f"{source}: zip member {name!r} has no local header")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return local + 30 + name_len + extra_len


#: Local header flag: CRC-32 and sizes follow the data (torch writes 0 in the header then).
_DATA_DESCRIPTOR = 0x0008
#: A local header size of this says "in the zip64 extra field".
_ZIP64_MARK = 0xFFFFFFFF


def local_header_range(local: int, name: str) -> tuple[int, int]:
    """The bytes to read at a member's local header ``local``: its 30 fixed bytes and room for
    the name the central directory gives it (so the two can be compared)."""
    return local, local + 30 + len(name.encode())


def located(member: Member, header: bytes, local: int, name: str, source: str) -> Member:
    """``member`` (from the central directory) with its data offset, from its local header
    ``header`` (read with :func:`local_header_range`), which must agree with it: the same name,
    compression method, CRC-32 and sizes (0 where a data descriptor follows the data)."""
    offset = _data_offset(header, local, name, source)
    flags, method, crc, csize, usize, name_len = struct.unpack_from("<6xHH4xIIIH", header)
    local_name = bytes(header[30 : 30 + name_len]).decode("utf-8", "replace")
    descriptor = bool(flags & _DATA_DESCRIPTOR)
    disagreements = [
        what
        for what, ok in (
            ("name", local_name == name and len(header) >= 30 + name_len),
            ("compression method", method == member.method),
            ("CRC-32", crc == member.crc32 or (descriptor and crc == 0)),
            ("compressed size", _size_agrees(csize, member.span, descriptor)),
            ("size", _size_agrees(usize, member.size, descriptor)),
        )
        if not ok
    ]
    if disagreements:
        raise CorruptRecordError(
            f"{source}: zip member {name!r}: its local header disagrees with the central "
            f"directory ({', '.join(disagreements)}; readers differ on which to trust)"
        )
    return Member(offset, member.size, member.crc32, member.method, member.compressed_size)


def _size_agrees(local: int, central: int, descriptor: bool) -> bool:
    """A local header size says the same as the central directory, or defers: 0 before a data
    descriptor, the zip64 mark (the size is in the extra field; every reader takes it from the
    central directory)."""
    return local in (central, _ZIP64_MARK) or (descriptor and local == 0)


def check_member_spans(
    members: Mapping[str, Member], local_offsets: Mapping[str, int], directory: int, source: str
) -> None:
    """Members may not overlap each other or the central directory at ``directory``: each
    spans its local header to the end of its data (offsets within one archive or file)."""
    spans = sorted(
        (local_offsets[name], member.offset + member.span, name) for name, member in members.items()
    )
    for (_, end, name), (start, _, following) in zip(
        spans, [*spans[1:], (directory, directory, "the central directory")], strict=True
    ):
        if end > start:
            raise CorruptRecordError(
                f"{source}: zip member {name!r} overlaps "
                f"{following if following.startswith('the ') else repr(following)}"
            )


def refuse_compressed(member: Member, name: str, source: str) -> Member:
    """``member`` if it is stored; a compressed member cannot be read as raw bytes."""
    if not member.stored:
        raise CorruptRecordError(
            f"{source}: zip member {name!r} is compressed (method {member.method}); ckptkit "
            "reads tensor storages and pickles only from stored (uncompressed) members"
        )
    return member


@dataclass(frozen=True, slots=True)
class ZipIndex:
    """A torch.save zip file's members (data offset and size in the file), by member name."""

    file: str
    prefix: str  # the archive folder every member sits in, e.g. "archive/"
    members: dict[str, Member]

    def member(self, name: str, source: str) -> Member:
        """The stored member ``<prefix><name>`` (``data.pkl``, ``data/0``…), read as raw bytes;
        a compressed one is refused (see :meth:`any_member`)."""
        return refuse_compressed(self.any_member(name, source), self.prefix + name, source)

    def any_member(self, name: str, source: str) -> Member:
        """The member ``<prefix><name>``, stored or compressed."""
        found = self.members.get(self.prefix + name)
        if found is None:
            raise CorruptRecordError(f"{source}: zip member {self.prefix + name!r} is missing")
        return found


def read_safetensors_headers(
    storage: Store, blobs: list[tuple[str, int]]
) -> dict[tuple[str, int], SafetensorsHeader]:
    """The parsed header of each safetensors blob ``(file, offset)`` (offset 0: a whole
    ``.safetensors`` file; else a blob inside a DCP data file), in two batched rounds of range
    reads: the 8-byte lengths, then the headers."""
    prefixes = storage.read_ranges([(f, o, o + 8) for f, o in blobs])
    lengths = [
        safetensors_header_length(p, storage.describe(f))
        for (f, _), p in zip(blobs, prefixes, strict=True)
    ]
    raws = storage.read_ranges(
        [(f, o + 8, o + 8 + n) for (f, o), n in zip(blobs, lengths, strict=True)]
    )
    return {
        (f, o): parse_safetensors_header(raw, storage.describe(f))
        for (f, o), raw in zip(blobs, raws, strict=True)
    }


def safetensors_file_headers(storage: Store, files: list[str]) -> dict[str, SafetensorsHeader]:
    """Each ``.safetensors`` file's parsed header (see :func:`read_safetensors_headers`)."""
    found = read_safetensors_headers(storage, [(file, 0) for file in files])
    return {file: header for (file, _), header in found.items()}


def read_zip_indexes(
    storage: Store, files: list[str], sizes: Mapping[str, int | None] | None = None
) -> dict[str, ZipIndex]:
    """Every member of each torch.save zip file, located by range reads in three batched rounds:
    the tails, any central directory not inside its tail, the local headers. No data is read."""
    if sizes is None:
        sizes = storage.sizes(files)
    for file in files:
        if sizes.get(file) is None:
            raise MissingFileError(f"{storage.describe(file)}: no such file")
    starts = {file: max(0, sizes[file] - _TAIL) for file in files}
    tails = storage.read_ranges([(file, starts[file], sizes[file]) for file in files])
    ends = {
        file: end_record(tail, starts[file], storage.describe(file))
        for file, tail in zip(files, tails, strict=True)
    }
    outside = [file for file in files if ends[file][1] < starts[file]]
    fetched = storage.read_ranges(
        [(file, ends[file][1], ends[file][1] + ends[file][2]) for file in outside]
    )
    directories = dict(zip(outside, fetched, strict=True))
    listed: dict[str, list[tuple[str, int, Member]]] = {}
    for file, tail in zip(files, tails, strict=True):
        count, offset, size = ends[file]
        at = offset - starts[file]
        directory = directories.get(file, tail[at : at + size])
        listed[file] = central_directory(directory, count, storage.describe(file))
    heads = iter(
        storage.read_ranges(
            [
                (file, *local_header_range(local, name))
                for file in files
                for name, local, _ in listed[file]
            ]
        )
    )
    indexes = {}
    for file in files:
        source = storage.describe(file)
        members = {}
        for name, local, member in listed[file]:
            members[name] = located(member, next(heads), local, name, source)
            if members[name].offset + member.span > sizes[file]:
                raise CorruptRecordError(f"{source}: zip member {name!r} extends past the end")
        local_offsets = {name: local for name, local, _ in listed[file]}
        check_member_spans(members, local_offsets, ends[file][1], source)
        pickles = [name for name in members if name.endswith("data.pkl")]
        if len(pickles) != 1:
            raise CorruptRecordError(
                f"{source}: not a torch.save file (expected one data.pkl, found {len(pickles)})"
            )
        indexes[file] = ZipIndex(file, pickles[0][: -len("data.pkl")], members)
    return indexes


#: The most bytes the compressed members one read asks for may inflate to, in all (TorchScript
#: ``code/`` files are kilobytes; a member declaring more is refused before it is read).
MAX_INFLATED = 64 << 20


def read_members(
    storage: Store, index: ZipIndex, names: list[str], *, limit: int = MAX_INFLATED
) -> dict[str, bytes]:
    """The bytes of members ``<prefix><name>`` of one zip file, stored or DEFLATE-compressed,
    in one batched round of range reads, each checked against its declared size and CRC-32.
    What they declare (and occupy) is bounded by ``limit`` before anything is read."""
    source = storage.describe(index.file)
    members = {name: index.any_member(name, source) for name in names}
    declared = sum(max(m.size, m.span) for m in members.values())
    if declared > limit:
        largest = max(members, key=lambda name: members[name].size)
        raise LimitExceededError(
            f"{source}: zip members to inflate declare {declared} bytes (member "
            f"{index.prefix + largest!r}: {members[largest].size}), more than the {limit} allowed"
        )
    blobs = storage.read_ranges(
        [(index.file, m.offset, m.offset + m.span) for m in members.values()]
    )
    return {
        name: inflate(blob, member, f"{source} member {index.prefix + name!r}")
        for (name, member), blob in zip(members.items(), blobs, strict=True)
    }


def inflate(data: bytes, member: Member, source: str) -> bytes:
    """A member's bytes from its ``data`` in the archive: as is when stored, raw-inflated when
    DEFLATE-compressed (never past its declared size), then checked against its CRC-32."""
    if member.method == 8:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            raw = inflater.decompress(bytes(data), member.size + 1)
        except zlib.error as exc:
            raise CorruptRecordError(f"{source}: bad DEFLATE data: {exc}") from exc
        if len(raw) != member.size or not inflater.eof:
            raise CorruptRecordError(
                f"{source}: inflates to {'more than ' if len(raw) > member.size else ''}"
                f"{len(raw)} bytes{'' if inflater.eof else ' (unfinished)'}, its zip entry "
                f"says {member.size}"
            )
    elif member.stored:
        raw = bytes(data)
    else:
        raise CorruptRecordError(
            f"{source}: compressed with zip method {member.method}; only stored and DEFLATE "
            "members are read"
        )
    check_crc(raw, member.crc32, source)
    return raw


class TorchArchive:
    """A torch.save zip held in memory: its pickle and its storages, located without copying."""

    def __init__(self, buf: bytes | memoryview, source: str) -> None:
        self.buf = memoryview(buf)
        self.source = source
        self.members = zip_members(self.buf, source)
        pickles = [name for name in self.members if name.endswith("data.pkl")]
        if len(pickles) != 1:
            raise CorruptRecordError(
                f"{source}: expected one data.pkl in the record, found {len(pickles)}"
            )
        self.prefix = pickles[0][: -len("data.pkl")]
        order = self.members.get(self.prefix + "byteorder")
        if order is not None and bytes(self.member(order, self.prefix + "byteorder")) != b"little":
            raise CorruptRecordError(f"{source}: big-endian records are not supported")

    def member(self, m: Member, name: str = "") -> memoryview:
        """A stored member's bytes (a compressed one is refused, naming ``name``)."""
        refuse_compressed(m, name, self.source)
        return self.buf[m.offset : m.offset + m.size]

    def check_crc(self, names: list[str] | None = None) -> None:
        """Compare stored members (all, or ``<prefix><name>`` for each name) with their CRC-32
        (compressed members, which ckptkit never reads from a record, are skipped)."""
        for name in names if names is not None else list(self.members):
            full = name if names is None else self.prefix + name
            m = self.members.get(full)
            if m is not None and (m.stored or names is not None):
                check_crc(self.member(m, full), m.crc32, f"{self.source} member {full!r}")

    def pickle_bytes(self) -> memoryview:
        name = self.prefix + "data.pkl"
        return self.member(self.members[name], name)

    def storage(self, key: str) -> memoryview:
        name = f"{self.prefix}data/{key}"
        m = self.members.get(name)
        if m is None:
            raise CorruptRecordError(f"{self.source}: storage {key!r} missing from the record")
        return self.member(m, name)

    def tensor(self, ref: TensorRef) -> TensorData:
        """The bytes and layout of ``ref``, whose storage is one of this archive's members."""
        return TensorData(
            ref.dtype, ref.shape, ref.stride, ref.storage_offset, self.storage(ref.storage.key)
        )


#: Bytes a torch.save archive adds around a tensor's storage (zip framing, data.pkl), at most.
ARCHIVE_SLACK = 1 << 20


def tensor_archive_limit(nbytes: int) -> int:
    """The most bytes a torch.save record holding a tensor chunk of ``nbytes`` may inflate to
    (its storage may be up to twice the chunk, e.g. a view saved with its base)."""
    return 2 * nbytes + ARCHIVE_SLACK


def undo_transform(buf: bytes, transform: str | None, source: str, *, limit: int) -> bytes:
    """Bytes as written before ``transform`` (e.g. zstd) was applied, at most ``limit`` of them:
    a frame that inflates further is refused before it is held in memory."""
    if not transform:
        return buf
    if transform == "zstd":
        import io

        import zstandard

        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(buf)) as reader:
                out = io.BytesIO()
                while out.tell() <= limit and (piece := reader.read(min(limit + 1, 8 << 20))):
                    out.write(piece)
                raw = out.getvalue()
        except zstandard.ZstdError as exc:
            raise CorruptRecordError(f"{source}: bad zstd frame: {exc}") from exc
        if len(raw) > limit:
            raise LimitExceededError(
                f"{source}: a {len(buf)}-byte zstd record inflates past {limit} bytes, more than "
                "the metadata allows for it"
            )
        return raw
    raise CorruptRecordError(f"{source}: unsupported record transform {transform!r}")


def check_crc(data: bytes | memoryview, expected: int, source: str) -> None:
    """Raise :class:`ChecksumError` unless ``data``'s CRC-32 is ``expected``."""
    actual = crc32(data)
    if actual != expected:
        raise ChecksumError(
            f"{source}: CRC-32 mismatch: stored {expected:08x}, the bytes give {actual:08x} "
            "(the file is corrupted)"
        )


def decode_tensor_record(buf: bytes, source: str, *, verify_crc: bool = False) -> TensorData:
    """The tensor a torch.save record holds, layout from its own ``data.pkl``; with
    ``verify_crc`` its pickle and storage are checked against the zip's CRC-32 first."""
    archive = TorchArchive(buf, source)
    if verify_crc:
        archive.check_crc(["data.pkl"])
    ref = safe_loads(
        archive.pickle_bytes(), allow=TENSOR_GLOBALS, source=source, limits=RECORD_LIMITS
    )
    if not isinstance(ref, TensorRef):
        raise CorruptRecordError(f"{source}: record holds {type(ref).__name__}, not a tensor")
    if not verify_crc:
        return archive.tensor(ref)
    archive.check_crc([f"data/{ref.storage.key}"])
    checked = archive.members[f"{archive.prefix}data/{ref.storage.key}"].crc32
    return dataclasses.replace(archive.tensor(ref), crc32=checked)


def decode_object_record(
    buf: bytes, source: str, *, verify_crc: bool = False
) -> tuple[Any, TorchArchive]:
    """The value a torch.save record holds, unknown classes as placeholders, tensors as refs."""
    archive = TorchArchive(buf, source)
    if verify_crc:
        archive.check_crc()
    value = safe_loads(
        archive.pickle_bytes(), allow=OBJECT_GLOBALS, source=source, unknown="opaque"
    )
    return value, archive


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensor name → (dtype, shape, [begin, end) after the header)."""

    data_start: int  # offset of the first data byte, relative to the blob start
    tensors: dict[str, tuple[DType, tuple[int, ...], int, int]]
    metadata: dict[str, str]


#: Headers larger than this are refused (safetensors' own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100 << 20


def safetensors_header_length(prefix: bytes, source: str) -> int:
    """The header length stored in a safetensors blob's first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptRecordError(f"{source}: truncated safetensors blob")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_SAFETENSORS_HEADER:
        raise CorruptRecordError(f"{source}: safetensors header of {n} bytes is too large")
    return n


def parse_safetensors_header(raw: bytes, source: str) -> SafetensorsHeader:
    """Parse the JSON header (the bytes after the 8-byte length)."""
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, …
        raise CorruptRecordError(f"{source}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptRecordError(f"{source}: safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, spec in header.items():
        try:
            dt = dtypes.from_safetensors(spec["dtype"])
            shape = spec["shape"]
            offsets = spec["data_offsets"]
            begin, end = offsets
            if not (_json_size(begin) and _json_size(end)):
                raise ValueError(f"data_offsets {bounded_repr(offsets)} are not byte offsets")
        except (KeyError, TypeError, ValueError, FormatError) as exc:
            raise CorruptRecordError(f"{source}: bad safetensors entry {name!r}: {exc}") from exc
        tensors[name] = (dt, _safetensors_shape(shape, name, source), begin, end)
    return SafetensorsHeader(8 + len(raw), tensors, metadata)


#: Dimensions and offsets of a safetensors header are below this (torch's sizes are int64).
_SIZE_BOUND = 1 << 63


def _json_size(value: Any) -> bool:
    """A JSON integer from 0 below :data:`_SIZE_BOUND` (not a float, bool or string)."""
    return type(value) is int and 0 <= value < _SIZE_BOUND


def _safetensors_shape(shape: Any, name: str, source: str) -> tuple[int, ...]:
    """A header's ``shape``: a list of sizes; anything else (``Infinity``, ``NaN``, negative,
    fractional or past int64) is a :class:`FormatError` naming the file and tensor."""
    if type(shape) is not list or not all(map(_json_size, shape)):
        raise FormatError(
            f"{source}: safetensors tensor {name!r} has shape {bounded_repr(shape)}: dimensions "
            "must be integers from 0 to 2**63-1"
        )
    return tuple(shape)
