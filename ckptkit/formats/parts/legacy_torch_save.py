"""Pre-1.6 torch.save files (``torch.save(obj, f, _use_new_zipfile_serialization=False)``, as
DeepSpeed still writes with ``checkpoint_serialization: false``), read without loading them.

Layout (torch ``_legacy_save``): five pickles back to back — the magic number, the protocol
version (1001), a sys-info dict, the main pickle (storages as persistent ids, see
``ckptkit.unpickler``) and the list of storage keys in the order their bytes follow — then, per
key, an 8-byte little-endian element count and that many elements. The element size is the one
of the storage's dtype in the main pickle, so every storage's byte length is known from the
pickle: the 8-byte headers are read (one batch of range reads, no data) to confirm it and
locate each storage. The format stores no checksum.
"""

from __future__ import annotations

import io
import pickletools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...decoding.pickle_limits import OBJECT_LIMITS, RECORD_LIMITS
from ...decoding.unpickler import StorageRef, safe_loads
from ...errors import CorruptRecordError, FormatError, LimitExceededError, TruncatedFileError
from ...storage import Store

__all__ = [
    "MAGIC_NUMBER",
    "PROTOCOL_VERSION",
    "MAGIC_PREFIX",
    "HEAD_BYTES",
    "HEADS_PER_ROUND",
    "HEADER_BYTES",
    "is_legacy_head",
    "Span",
    "LegacyIndex",
    "LegacyPickle",
    "read_legacy",
]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
#: A pre-1.6 file starts with its pickled magic number: protocol 2 (torch's default), a
#: 10-byte LONG1.
MAGIC_PREFIX = b"\x80\x02\x8a\x0a"
#: The same in any pickle protocol torch.save accepts (2-5; 4 and 5 open a frame first).
_MAGIC_HEAD = re.compile(rb"\x80[\x02-\x05](?:\x95.{8})?\x8a\x0a", re.DOTALL)
#: Bytes read first from each file: the small pickles and, nearly always, the main pickle.
HEAD_BYTES = 1 << 20
#: Bytes of heads read in one batched round, at most.
HEADS_PER_ROUND = 64 << 20
#: Each storage's bytes follow an 8-byte little-endian element count.
HEADER_BYTES = 8
#: Values that hold no storage, skipped when looking for storages.
_ATOMS = (str, bytes, bytearray, int, float, complex, type(None), range, slice)
_ATOMS += (np.generic, np.ndarray, np.dtype)


def is_legacy_head(head: bytes) -> bool:
    """True when a file's first (up to 16) bytes begin a pre-1.6 torch.save file."""
    return _MAGIC_HEAD.match(head) is not None


@dataclass(frozen=True, slots=True)
class Span:
    """A storage's bytes: ``size`` bytes at ``offset`` in the file (this format has no CRC)."""

    offset: int
    size: int
    crc32: None = None


@dataclass(frozen=True, slots=True)
class LegacyIndex:
    """Where each storage's bytes lie in one pre-1.6 file, by storage key."""

    file: str
    storages: Mapping[str, Span]

    def storage(self, key: str, source: str) -> Span:
        """The bytes of storage ``key``; a view ``"<key>@<byte offset>"`` (see
        ``ckptkit.unpickler``) is the rest of its storage from that offset."""
        found = self.storages.get(key)
        if found is None and "@" in key:
            root, _, start = key.rpartition("@")
            base = self.storages.get(root)
            if base is not None and start.isdigit() and int(start) <= base.size:
                found = Span(base.offset + int(start), base.size - int(start))
        if found is None:
            raise CorruptRecordError(f"{source}: storage {key!r} is not stored in the file")
        return found


@dataclass(frozen=True, slots=True)
class LegacyPickle:
    """One pre-1.6 file's main pickle, decoded safely, and where its storages lie."""

    value: Any
    index: LegacyIndex
    offset: int  # of the main pickle in the file
    length: int


def read_legacy(
    storage: Store, files: list[str], sizes: Mapping[str, int], allow: Mapping[str, Any]
) -> dict[str, LegacyPickle]:
    """Each pre-1.6 file's main pickle (unknown globals as placeholders) and storage
    locations, reading the pickles and the 8-byte storage headers only, in batched rounds."""
    jobs = []
    per_round = max(1, HEADS_PER_ROUND // HEAD_BYTES)  # bounds the heads held at once
    for first in range(0, len(files), per_round):
        batch = files[first : first + per_round]
        heads = storage.read_ranges([(file, 0, min(sizes[file], HEAD_BYTES)) for file in batch])
        jobs += [
            _parse(_Prefix(storage, file, head, sizes[file]), allow)
            for file, head in zip(batch, heads, strict=True)
        ]
    while pending := [job for job in jobs if job.position < len(job.keys)]:
        chains = [job.chain() for job in pending]
        ranges = [
            (job.file, at, at + HEADER_BYTES)
            for job, chain in zip(pending, chains, strict=True)
            for _, at in chain
        ]
        found = iter(storage.read_ranges(ranges))
        for job, chain in zip(pending, chains, strict=True):
            job.confirm(chain, [next(found) for _ in chain])
    return {
        job.file: LegacyPickle(
            job.value, LegacyIndex(job.file, job.spans), job.main_offset, job.main_length
        )
        for job in jobs
    }


# --------------------------------------------------------------------------------------------
# The pickles at the start of a file.


class _Prefix:
    """The first bytes of one file, read further on demand, and the pickles found in them."""

    def __init__(self, storage: Store, file: str, head: bytes, size: int) -> None:
        self.storage, self.file, self.buf, self.size = storage, file, bytearray(head), size
        self.source = storage.describe(file)

    def pickle_end(self, start: int) -> int:
        """The end of the pickle starting at ``start`` (just after its STOP), reading more of
        the file while the pickle runs past what was read (up to the object pickle limit)."""
        while True:
            end = _stop_after(self.buf, start, self.source)
            if end is not None:
                return end
            if len(self.buf) >= self.size:
                raise TruncatedFileError(
                    f"{self.source}: truncated: the pickle at byte {start} does not end before "
                    f"the file does ({self.size} bytes)"
                )
            if len(self.buf) - start > OBJECT_LIMITS.max_bytes:
                raise LimitExceededError(
                    f"{self.source}: the pickle at byte {start} is over "
                    f"{OBJECT_LIMITS.max_bytes} bytes"
                )
            more = min(self.size, 2 * len(self.buf))
            (piece,) = self.storage.read_ranges([(self.file, len(self.buf), more)])
            self.buf += piece

    def load(self, start: int, what: str, allow: Mapping[str, Any], **options: Any) -> tuple:
        """``(value, end)`` of the pickle at ``start``, decoded by the safe unpickler."""
        end = self.pickle_end(start)
        value = safe_loads(
            self.buf[start:end], allow=allow, source=f"{self.source} ({what})", **options
        )
        return value, end


def _stop_after(buf: bytearray, start: int, source: str) -> int | None:
    """The position after the STOP of the pickle at ``start`` in ``buf``; None when ``buf``
    ends first. Steps over opcodes only (``pickletools.genops``): nothing is built."""
    stream = io.BytesIO(buf)
    stream.seek(start)
    try:
        for op, _, at in pickletools.genops(stream):
            if op.name == "STOP":
                return at + 1
    except ValueError as exc:
        if "unknown" in str(exc):  # an opcode that does not exist: no more bytes will help
            raise CorruptRecordError(f"{source}: not a pickle at byte {start}: {exc}") from None
        return None
    return None


@dataclass
class _Claim:
    """What a file's main pickle says about one stored storage: the element sizes its
    persistent ids use, its byte length (None when only views name it) and the bytes its
    views reach."""

    itemsizes: set[int] = field(default_factory=set)
    nbytes: int | None = None
    reach: int = 0


@dataclass
class _Job:
    """One file: its decoded pickles, then its storages located key by key."""

    file: str
    source: str
    size: int
    value: Any
    main_offset: int
    main_length: int
    keys: list[str]
    claims: dict[str, _Claim]
    cursor: int  # where the next storage's header is
    position: int = 0  # index in ``keys`` of the next storage to locate
    spans: dict[str, Span] = field(default_factory=dict)

    def chain(self) -> list[tuple[str, int]]:
        """``(key, header position)`` of the next storages whose positions the pickle
        predicts: up to and including the first whose length only its header tells."""
        chain, at = [], self.cursor
        for key in self.keys[self.position :]:
            if at + HEADER_BYTES > self.size:
                raise TruncatedFileError(
                    f"{self.source}: truncated: storage {key!r} starts at byte {at}, the file "
                    f"has {self.size} bytes"
                )
            chain.append((key, at))
            nbytes = self.claims[key].nbytes
            if nbytes is None:
                break
            at += HEADER_BYTES + nbytes
        return chain

    def confirm(self, chain: list[tuple[str, int]], headers: list[bytes]) -> None:
        """Check each header read against the pickle's claim and record the storage."""
        for (key, at), header in zip(chain, headers, strict=True):
            count = int.from_bytes(header, "little")
            nbytes = self._length(key, count)
            end = at + HEADER_BYTES + nbytes
            if end > self.size:
                raise TruncatedFileError(
                    f"{self.source}: truncated: storage {key!r} needs bytes [{at}, {end}), the "
                    f"file has {self.size} bytes"
                )
            self.spans[key] = Span(at + HEADER_BYTES, nbytes)
            self.cursor, self.position = end, self.position + 1

    def _length(self, key: str, count: int) -> int:
        """The byte length of storage ``key`` whose header says ``count`` elements."""
        claim = self.claims[key]
        if claim.nbytes is not None:
            if any(count * size == claim.nbytes for size in claim.itemsizes):
                return claim.nbytes
            problem = f"the pickle says {claim.nbytes} bytes"
        elif len(claim.itemsizes) == 1:
            nbytes = count * next(iter(claim.itemsizes))
            if nbytes >= claim.reach:
                return nbytes
            problem = f"its views reach {claim.reach} bytes"
        else:
            problem = f"its views use element sizes {sorted(claim.itemsizes)}"
        raise CorruptRecordError(
            f"{self.source}: storage {key!r}: its header says {count} elements, {problem}"
        )


def _parse(prefix: _Prefix, allow: Mapping[str, Any]) -> _Job:
    """The pickles at the start of a file, checked: magic number, protocol, byte order."""
    source = prefix.source
    magic, end = prefix.load(0, "magic number", {}, limits=RECORD_LIMITS)
    if magic != MAGIC_NUMBER:
        raise FormatError(f"{source}: not a pre-1.6 torch.save file (magic number {magic!r})")
    protocol, end = prefix.load(end, "protocol version", {}, limits=RECORD_LIMITS)
    if protocol != PROTOCOL_VERSION:
        raise FormatError(
            f"{source}: pre-1.6 torch.save protocol version {protocol!r} is not supported "
            f"(expected {PROTOCOL_VERSION})"
        )
    sys_info, end = prefix.load(end, "sys info", {}, limits=RECORD_LIMITS)
    if not isinstance(sys_info, dict):
        raise CorruptRecordError(f"{source}: the sys info is a {type(sys_info).__name__}")
    if sys_info.get("little_endian", True) is not True:
        raise CorruptRecordError(f"{source}: big-endian torch.save files are not supported")
    start = end
    value, end = prefix.load(start, "main pickle", allow, unknown="opaque")
    keys, data_start = prefix.load(end, "storage keys", {})
    if not isinstance(keys, list) or not all(isinstance(k, str | int) for k in keys):
        raise CorruptRecordError(f"{source}: the storage key list is not a list of keys")
    keys = [str(k) for k in keys]
    claims = _claims(value, source)
    for key in keys:
        if key not in claims:
            raise CorruptRecordError(
                f"{source}: storage {key!r} is stored but the pickle never uses it"
            )
    if len(set(keys)) != len(keys):
        raise CorruptRecordError(f"{source}: a storage key is listed twice")
    return _Job(
        prefix.file, source, prefix.size, value, start, end - start, keys, claims, data_start
    )


def _claims(value: Any, source: str) -> dict[str, _Claim]:
    """Per stored storage key, what the persistent ids in ``value`` say about it."""
    claims: dict[str, _Claim] = {}
    for ref in _storage_refs(value):
        root, view, start = ref.key.rpartition("@")
        if not view or not start.isdigit():
            root, start = ref.key, None
        claim = claims.setdefault(root, _Claim())
        itemsize = ref.dtype.itemsize
        claim.itemsizes.add(itemsize)
        if ref.numel < 0:
            raise CorruptRecordError(f"{source}: storage {root!r} has {ref.numel} elements")
        if start is None:
            nbytes = ref.numel * itemsize
            if claim.nbytes not in (None, nbytes):
                raise CorruptRecordError(
                    f"{source}: storage {root!r} is {claim.nbytes} and {nbytes} bytes long"
                )
            claim.nbytes = nbytes
        else:
            claim.reach = max(claim.reach, int(start) + ref.numel * itemsize)
    return claims


def _storage_refs(value: Any) -> Iterator[StorageRef]:
    """Every storage the decoded pickle refers to, wherever it sits (containers, tensors,
    placeholders' arguments and state, stand-ins' attributes); each object visited once."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if isinstance(obj, StorageRef):
            yield obj
            continue
        if isinstance(obj, (*_ATOMS, type)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack += obj.keys()
            stack += obj.values()
        elif isinstance(obj, list | tuple | set | frozenset):
            stack += obj
        elif hasattr(obj, "__dict__"):
            stack += vars(obj).values()
        else:
            stack += (getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ()))
