"""Streaming ``torch.save`` output: ``data.pkl`` first, then each storage as it is produced.

The result is the zip layout torch itself writes (stored members, storages 64-byte aligned,
``.storage_alignment`` record), so ``torch.load(..., weights_only=True, mmap=True)`` reads it.
"""

from __future__ import annotations

import collections
import copyreg
import io
import math
import pickle
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .. import dtypes
from ..dtypes import DType
from ..errors import MismatchError, UnsafePickleError, UsageError
from ..unpickler import Opaque

ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_PAD_TAG = 0x4246  # the extra-field id torch's own writer pads with ("FB")


@dataclass(frozen=True)
class _MemberInfo:
    name: bytes
    offset: int
    size: int
    crc: int


class StoredZipWriter:
    """Writes an uncompressed zip to a seekable stream, one member at a time (zip64 when needed)."""

    def __init__(self, stream: BinaryIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self.members: list[_MemberInfo] = []
        self.start = stream.tell()

    def write(self, name: str, data: bytes | memoryview) -> None:
        """A whole member at once (small records: ``data.pkl``, ``version``…)."""
        self.write_chunks(name, len(data), [data])

    def write_chunks(self, name: str, size: int, chunks: Iterable[bytes | memoryview]) -> None:
        """A member of known ``size`` from pieces produced one after another."""
        full = f"{self.prefix}/{name}".encode()
        offset = self.stream.tell() - self.start
        zip64 = size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        header_len = 30 + len(full) + len(extra)
        pad = -(offset + header_len + 4) % ALIGNMENT  # 4 = the padding field's own header
        extra += struct.pack("<HH", _PAD_TAG, pad) + b"Z" * pad
        stored_size = _ZIP64_LIMIT if zip64 else size
        header = struct.pack(
            "<4sHHHHHIIIHH",
            b"PK\x03\x04",
            45 if zip64 else 20,
            0,
            0,
            0,
            0,
            0,
            stored_size,
            stored_size,
            len(full),
            len(extra),
        )
        self.stream.write(header + full + extra)
        crc, written = 0, 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            written += len(chunk)
            self.stream.write(chunk)
        if written != size:
            raise MismatchError(f"member {name!r}: {written} bytes written, {size} announced")
        end = self.stream.tell()
        self.stream.seek(self.start + offset + 14)
        self.stream.write(struct.pack("<I", crc))
        self.stream.seek(end)
        self.members.append(_MemberInfo(full, offset, size, crc))

    def close(self) -> None:
        """Write the central directory (and zip64 end records when any field overflows)."""
        cd_start = self.stream.tell() - self.start
        for m in self.members:
            zip64 = m.size >= _ZIP64_LIMIT or m.offset >= _ZIP64_LIMIT
            extra = struct.pack("<HHQQQ", 0x0001, 24, m.size, m.size, m.offset) if zip64 else b""
            size = _ZIP64_LIMIT if zip64 else m.size
            offset = _ZIP64_LIMIT if zip64 else m.offset
            self.stream.write(
                struct.pack(
                    "<4sHHHHHHIIIHHHHHII",
                    b"PK\x01\x02",
                    45,
                    45 if zip64 else 20,
                    0,
                    0,
                    0,
                    0,
                    m.crc,
                    size,
                    size,
                    len(m.name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + m.name
                + extra
            )
        cd_end = self.stream.tell() - self.start
        count, cd_size = len(self.members), cd_end - cd_start
        if count >= 0xFFFF or cd_start >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
            self.stream.write(
                struct.pack(
                    "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_start
                )
            )
            self.stream.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_end, 1))
            count16, cd_size32, cd_start32 = 0xFFFF, _ZIP64_LIMIT, _ZIP64_LIMIT
        else:
            count16, cd_size32, cd_start32 = count, cd_size, cd_start
        self.stream.write(
            struct.pack(
                "<4sHHHHIIH", b"PK\x05\x06", 0, 0, count16, count16, cd_size32, cd_start32, 0
            )
        )


@dataclass(eq=False)
class TensorSlot:
    """A tensor in the pickled structure whose bytes are written later, as storage ``key``."""

    dtype: DType
    shape: tuple[int, ...]
    key: str = ""
    data: Any = field(default=None, repr=False)  # bytes for tensors already in memory

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def dumps(structure: Any) -> tuple[bytes, list[TensorSlot]]:
    """Pickle ``structure`` as torch.save does; tensors (slots or ``torch.Tensor``) become storages.

    Placeholders of classes ckptkit did not decode (:class:`~ckptkit.unpickler.Opaque`) are
    replayed as the pickle that built them: the same global, arguments, state and items, so
    loading the output where those classes exist gives the original objects; nothing of them
    is imported or run here. Returns the ``data.pkl`` bytes and the slots in storage-key
    order. Imports torch, whose rebuild functions and storage classes the pickle names.
    """
    slots: list[TensorSlot] = []
    try:
        return _dump(_TorchPickler, structure, slots), slots
    except _HoldsOpaque:  # the C pickler would import a placeholder's module to name it
        for slot in slots:
            slot.key = ""
        slots.clear()
        return _dump(_ReplayingPickler, structure, slots), slots


class _HoldsOpaque(Exception):
    """The structure holds a placeholder: pickle it again with :class:`_ReplayingPickler`."""


def _dump(pickler: type, structure: Any, slots: list[TensorSlot]) -> bytes:
    buf = io.BytesIO()
    pickler(buf, slots).dump(structure)
    return buf.getvalue()


class _TensorReduction:
    """What both picklers share: tensors and slots as torch.save pickles them."""

    def __init__(self, stream: BinaryIO, slots: list[TensorSlot]) -> None:
        super().__init__(stream, protocol=2)
        self.slots = slots

    def reduce_tensor(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            obj = _slot_from_tensor(obj)
        if not isinstance(obj, TensorSlot):
            return NotImplemented
        if not obj.key:
            obj.key = str(len(self.slots))
            self.slots.append(obj)
        args = (_StorageId(obj), 0, torch.Size(obj.shape), _contiguous_strides(obj.shape))
        args += (False, collections.OrderedDict())
        if obj.dtype.storage is None:  # fp8, uint16…: untyped bytes plus the dtype, as torch does
            return torch._utils._rebuild_tensor_v3, (*args, dtypes.to_torch(obj.dtype))
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, _StorageId):
            return None
        slot = obj.slot
        if slot.dtype.storage is None:
            return ("storage", torch.storage.UntypedStorage, slot.key, "cpu", slot.nbytes)
        storage_type = getattr(torch, slot.dtype.storage)
        return ("storage", storage_type, slot.key, "cpu", slot.nbytes // slot.dtype.itemsize)


class _TorchPickler(_TensorReduction, pickle.Pickler):
    """The C pickler: fast, for structures without placeholders."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Opaque) or (isinstance(obj, type) and issubclass(obj, Opaque)):
            raise _HoldsOpaque
        return self.reduce_tensor(obj)


class _ReplayingPickler(_TensorReduction, pickle._Pickler):
    """The pure-Python pickler (its ``save_global`` can be taught to name a placeholder's
    global without importing it), replaying each placeholder as the pickle that built it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Opaque):
            return _replay(obj)
        return self.reduce_tensor(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Opaque):
            if not all(part.isidentifier() for part in f"{obj.module}.{obj.qualname}".split(".")):
                # STACK_GLOBAL names are any string: a newline would inject opcodes here
                raise UnsafePickleError(
                    f"cannot write the global {obj.global_name!r}: not a dotted Python name",
                    global_name=obj.global_name,
                )
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _replay(obj: Opaque) -> tuple:
    """The reduce value that pickles ``obj`` as it was unpickled: REDUCE ``cls(*args)`` or
    NEWOBJ ``cls.__new__(cls, *args)``, then its items, then BUILD with its state."""
    if obj.kwargs:
        raise UsageError(
            f"{obj.global_name} was built with keyword arguments (NEWOBJ_EX), which a "
            "protocol-2 torch.save pickle cannot express; leave it out with exclude="
        )
    listitems = iter(obj.listitems) if obj.listitems else None
    dictitems = iter(obj.dictitems) if obj.dictitems else None
    if obj.called:
        return type(obj), obj.args, obj.state, listitems, dictitems
    return copyreg.__newobj__, (type(obj), *obj.args), obj.state, listitems, dictitems


@dataclass(eq=False)
class _StorageId:
    slot: TensorSlot


def _slot_from_tensor(tensor) -> TensorSlot:
    """A tensor already in memory (inside a decoded object) as a slot carrying its bytes."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return TensorSlot(dtypes.dtype(str(tensor.dtype)), tuple(tensor.shape), data=data)


def write(
    stream: BinaryIO,
    structure: Any,
    produce: Callable[[TensorSlot], Iterable[bytes | memoryview]],
    *,
    archive_name: str = "archive",
) -> list[TensorSlot]:
    """Write ``structure`` as a torch.save zip; ``produce(slot)`` yields each streamed tensor's bytes."""
    pickled, slots = dumps(structure)
    zip_writer = StoredZipWriter(stream, archive_name)
    zip_writer.write("data.pkl", pickled)
    zip_writer.write(".format_version", b"1")
    zip_writer.write(".storage_alignment", str(ALIGNMENT).encode())
    zip_writer.write("byteorder", b"little")
    for slot in slots:
        chunks = [slot.data] if slot.data is not None else produce(slot)
        zip_writer.write_chunks(f"data/{slot.key}", slot.nbytes, chunks)
    zip_writer.write("version", b"3\n")
    zip_writer.close()
    return slots
