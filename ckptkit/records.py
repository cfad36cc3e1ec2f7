"""Decoding one record's bytes: torch.save zip archives, zstd frames, safetensors headers.

Pure functions over bytes already fetched; :mod:`ckptkit.reading` decides what to fetch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .dtypes import DType
from .errors import CorruptRecordError, FormatError
from .unpickler import OBJECT_GLOBALS, TENSOR_GLOBALS, TensorRef, safe_loads

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class Member:
    """A stored (uncompressed) zip member: ``size`` bytes at ``offset`` within the archive."""

    offset: int
    size: int
    crc32: int


@dataclass(frozen=True, slots=True)
class TensorData:
    """Element bytes plus the strided layout that reads them (strides/offset in elements)."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    buffer: memoryview


def zip_members(buf: memoryview, source: str) -> dict[str, Member]:
    """Members of a zip archive held in ``buf``, from its central directory (zip64 aware)."""
    tail = bytes(buf[-(22 + 65535) :])
    at = tail.rfind(_EOCD)
    if at < 0:
        raise CorruptRecordError(f"{source}: not a torch.save record (no zip end-of-directory)")
    eocd_pos = len(buf) - len(tail) + at
    (_, _, _, _, count, cd_size, cd_offset, _) = struct.unpack_from("<4sHHHHIIH", buf, eocd_pos)
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        locator = eocd_pos - 20
        if locator < 0 or bytes(buf[locator : locator + 4]) != _EOCD64_LOCATOR:
            raise CorruptRecordError(f"{source}: zip64 record without its locator")
        (eocd64_pos,) = struct.unpack_from("<Q", buf, locator + 8)
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", buf, eocd64_pos + 32)
    members: dict[str, Member] = {}
    pos = cd_offset
    for _ in range(count):
        if bytes(buf[pos : pos + 4]) != _CENTRAL:
            raise CorruptRecordError(f"{source}: damaged zip central directory")
        (method, crc, csize, usize, name_len, extra_len, comment_len) = struct.unpack_from(
            "<10xH4xIIIHHH", buf, pos
        )
        (local_offset,) = struct.unpack_from("<I", buf, pos + 42)
        name = bytes(buf[pos + 46 : pos + 46 + name_len]).decode("utf-8", "replace")
        extra = bytes(buf[pos + 46 + name_len : pos + 46 + name_len + extra_len])
        usize, csize, local_offset = _zip64_sizes(extra, usize, csize, local_offset)
        if method != 0 or csize != usize:
            raise CorruptRecordError(f"{source}: zip member {name!r} is compressed")
        if bytes(buf[local_offset : local_offset + 4]) != _LOCAL:
            raise CorruptRecordError(f"{source}: zip member {name!r} has no local header")
        lname, lextra = struct.unpack_from("<HH", buf, local_offset + 26)
        data_offset = local_offset + 30 + lname + lextra
        if data_offset + usize > len(buf):
            raise CorruptRecordError(f"{source}: zip member {name!r} extends past the record's end")
        members[name] = Member(data_offset, usize, crc)
        pos += 46 + name_len + extra_len + comment_len
    return members


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                usize = next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if offset == 0xFFFFFFFF:
                offset = next(values)
            break
        pos += 4 + size
    return usize, csize, offset


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
        if order is not None and bytes(self.member(order)) != b"little":
            raise CorruptRecordError(f"{source}: big-endian records are not supported")

    def member(self, m: Member) -> memoryview:
        return self.buf[m.offset : m.offset + m.size]

    def pickle_bytes(self) -> memoryview:
        return self.member(self.members[self.prefix + "data.pkl"])

    def storage(self, key: str) -> memoryview:
        m = self.members.get(f"{self.prefix}data/{key}")
        if m is None:
            raise CorruptRecordError(f"{self.source}: storage {key!r} missing from the record")
        return self.member(m)

    def tensor(self, ref: TensorRef) -> TensorData:
        return TensorData(
            ref.dtype, ref.shape, ref.stride, ref.storage_offset, self.storage(ref.storage.key)
        )


def undo_transform(buf: bytes, transform: str | None, source: str) -> bytes:
    """Bytes as written before ``transform`` (e.g. zstd) was applied."""
    if not transform:
        return buf
    if transform == "zstd":
        import io

        import zstandard

        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(buf)) as reader:
                return reader.read()
        except zstandard.ZstdError as exc:
            raise CorruptRecordError(f"{source}: bad zstd frame: {exc}") from exc
    raise CorruptRecordError(f"{source}: unsupported record transform {transform!r}")


def decode_tensor_record(buf: bytes, source: str) -> TensorData:
    """The tensor a torch.save record holds, layout from its own ``data.pkl``."""
    archive = TorchArchive(buf, source)
    ref = safe_loads(archive.pickle_bytes(), allow=TENSOR_GLOBALS, source=source)
    if not isinstance(ref, TensorRef):
        raise CorruptRecordError(f"{source}: record holds {type(ref).__name__}, not a tensor")
    return archive.tensor(ref)


def decode_object_record(buf: bytes, source: str) -> tuple[Any, TorchArchive]:
    """The value a torch.save record holds, unknown classes as placeholders, tensors as refs."""
    archive = TorchArchive(buf, source)
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
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecordError(f"{source}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptRecordError(f"{source}: safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, spec in header.items():
        try:
            dt = dtypes.from_safetensors(spec["dtype"])
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(v) for v in spec["data_offsets"])
        except (KeyError, TypeError, ValueError, FormatError) as exc:
            raise CorruptRecordError(f"{source}: bad safetensors entry {name!r}: {exc}") from exc
        tensors[name] = (dt, shape, begin, end)
    return SafetensorsHeader(8 + len(raw), tensors, metadata)
