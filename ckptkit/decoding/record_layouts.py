"""torch.save tensor records decoded by their layout instead of parsed one by one.

A DCP checkpoint with many small tensors holds thousands of torch.save records that differ
only in their storage bytes and torch's per-save bookkeeping. The second time a record length
comes, :class:`Layouts` learns the layout of such a record (by parsing it fully); a later record
of that length whose every other byte is the same then parses to the same members at the same
places and unpickles to the same tensor, so it is decoded by that comparison alone (its
storage CRC-32 is still checked by the reader).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError
from .pickle_limits import RECORD_LIMITS
from .records import TensorData, TorchArchive, end_record
from .unpickler import TENSOR_GLOBALS, TensorRef, safe_loads

__all__ = ["BULK_RECORD", "Layout", "Layouts"]

#: The end-of-central-directory record plus the longest zip comment.
_ZIP_TAIL = 22 + 0xFFFF
_CENTRAL = b"PK\x01\x02"
_U32 = struct.Struct("<I")
#: Records up to this long are matched against known layouts many at once (numpy).
BULK_RECORD = 64 << 10
_DESCRIPTOR = b"PK\x07\x08"


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a decoded torch.save tensor record keeps what varies from record to record: its
    storage member and torch's per-save bookkeeping (``.data/serialization_id``), their data
    and CRC-32 fields. A record of the same length whose other bytes (every zip header and
    size, the end record, ``data.pkl``, ``byteorder``, … all of ``fixed``) are the same parses
    to the same members at the same places and unpickles to the same tensor, so it is decoded
    by this comparison alone; only its storage's CRC-32 is its own."""

    segments: tuple[tuple[int, int], ...]  # the byte ranges compared, in order
    fixed: bytes  # their bytes, joined
    ref: TensorRef
    storage: tuple[int, int]  # the storage member's data: [start, end)
    storage_name: str
    crc_at: int  # the storage's CRC-32 in the central directory

    def matches(self, blob: bytes | memoryview) -> bool:
        return b"".join([blob[a:b] for a, b in self.segments]) == self.fixed

    def tensor(self, blob: bytes | memoryview, crc32: int | None = None) -> TensorData:
        """The tensor ``blob`` (a record of this layout) holds; ``crc32``: its storage's,
        when just checked."""
        ref = self.ref
        start, end = self.storage
        data = memoryview(blob)[start:end]
        return TensorData(ref.dtype, ref.shape, ref.stride, ref.storage_offset, data, crc32)

    def stored_crc(self, blob: bytes | memoryview, start: int = 0) -> int:
        """The CRC-32 the central directory of this record (at ``start`` in ``blob``) stores
        for its storage."""
        return _U32.unpack_from(blob, start + self.crc_at)[0]

    def matching_rows(self, rows: np.ndarray) -> np.ndarray:
        """Which rows of ``rows`` (records of this length, one per row) match: a bool per row."""
        ok = np.ones(len(rows), dtype=bool)
        at = 0
        fixed = np.frombuffer(self.fixed, np.uint8)
        for a, b in self.segments:
            ok &= (rows[:, a:b] == fixed[at : at + b - a]).all(axis=1)
            at += b - a
        return ok

    @classmethod
    def of(cls, blob: bytes | memoryview, source: str) -> Layout | None:
        """The layout of a torch.save tensor record (parsed, its pickle decoded, its
        ``data.pkl`` CRC checked); None for anything unusual (zip64, compressed members, not
        one tensor), which is then always parsed."""
        try:
            archive = TorchArchive(blob, source)
            archive.check_crc(["data.pkl"])
            ref = safe_loads(
                archive.pickle_bytes(), allow=TENSOR_GLOBALS, source=source, limits=RECORD_LIMITS
            )
            places = _zip_places(archive.buf, source)
        except (CheckpointError, struct.error):
            return None
        name = f"{archive.prefix}data/{ref.storage.key}" if isinstance(ref, TensorRef) else ""
        if places is None or name not in archive.members or set(places) != set(archive.members):
            return None
        varying = []
        buf = archive.buf
        for member_name, member in archive.members.items():
            if not member.stored:
                return None
            inner = member_name[len(archive.prefix) :]
            if not inner.startswith(("data/", ".data/")):
                continue
            local, central = places[member_name]
            end = member.offset + member.size
            varying += [
                (local + 14, local + 18),
                (member.offset, end),
                (central + 16, central + 20),
            ]
            (flags,) = struct.unpack_from("<H", buf, local + 6)
            if flags & 8:  # a data descriptor follows the data: its CRC-32 varies too
                at = end + 4 if bytes(buf[end : end + 4]) == _DESCRIPTOR else end
                varying.append((at, at + 4))
        segments, at = [], 0
        for a, b in sorted(varying):
            if a > at:
                segments.append((at, a))
            at = max(at, b)
        if at < len(buf):
            segments.append((at, len(buf)))
        member = archive.members[name]
        return cls(
            tuple(segments),
            b"".join(bytes(buf[a:b]) for a, b in segments),
            ref,
            (member.offset, member.offset + member.size),
            name,
            places[name][1] + 16,
        )


def _zip_places(buf: memoryview, source: str) -> dict[str, tuple[int, int]] | None:
    """Each member's local header and central directory entry positions in a zip (already
    parsed whole by :class:`TorchArchive`); None for zip64 or duplicated names."""
    start = max(0, len(buf) - _ZIP_TAIL)
    count, offset, size = end_record(bytes(buf[start:]), start, source)
    if offset + size > len(buf):
        return None
    places: dict[str, tuple[int, int]] = {}
    pos = offset
    for _ in range(count):
        if bytes(buf[pos : pos + 4]) != _CENTRAL:
            return None
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", buf, pos + 28)
        (local,) = struct.unpack_from("<I", buf, pos + 42)
        if local == 0xFFFFFFFF:
            return None
        places[bytes(buf[pos + 46 : pos + 46 + name_len]).decode("utf-8", "replace")] = (local, pos)
        pos += 46 + name_len + extra_len + comment_len
    return places if len(places) == count else None


class Layouts:
    """Layouts of torch.save tensor records (:class:`Layout`) by record length, learnt the
    second time a length comes (a record seen once costs nothing more than its parse)."""

    #: Layouts kept per length, and lengths kept in all (then everything is forgotten).
    PER_LENGTH = 4
    LENGTHS = 4096

    def __init__(self) -> None:
        self.by_length: dict[int, list[Layout]] = {}
        self.seen: set[int] = set()

    def find(self, blob: bytes | memoryview) -> Layout | None:
        for layout in self.by_length.get(len(blob), ()):
            if layout.matches(blob):
                return layout
        return None

    def learn(self, blob: bytes | memoryview, source: str) -> None:
        length = len(blob)
        if length not in self.seen:
            if len(self.seen) >= self.LENGTHS:
                self.seen.clear()
            self.seen.add(length)
            return
        known = self.by_length.setdefault(length, [])
        if len(known) >= self.PER_LENGTH:
            return
        if len(self.by_length) > self.LENGTHS:
            self.by_length = {length: known}
        layout = Layout.of(blob, source)
        if layout is not None:
            known.append(layout)
