"""Streaming ``torch.save`` output: ``data.pkl`` first, then each storage as it is produced.

The result is the zip layout torch itself writes (stored members, storages 64-byte aligned,
``.storage_alignment`` record), so ``torch.load(..., weights_only=True, mmap=True)`` reads it.
"""

from __future__ import annotations

import copyreg
import io
import math
import pickle
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ... import dtypes
from ...crc32 import combine as combine_crc
from ...decoding.records import TensorData
from ...decoding.unpickler import Opaque
from ...dtypes import DType
from ...errors import MismatchError, UnsafePickleError, UsageError
from ...reading import strided_view

__all__ = ["ALIGNMENT", "CheckedBytes", "StoredZipWriter", "TensorSlot", "dumps", "write"]

ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_PAD_TAG = 0x4246  # the extra-field id torch's own writer pads with ("FB")


class CheckedBytes(NamedTuple):
    """A piece of a member whose CRC-32 is known (just checked against its source's)."""

    data: bytes | memoryview
    crc32: int


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

    def write_chunks(
        self, name: str, size: int, chunks: Iterable[bytes | memoryview | CheckedBytes]
    ) -> None:
        """A member of known ``size`` from pieces produced one after another; the CRC-32 of
        :class:`CheckedBytes` pieces is combined from theirs (one CRC pass, not two)."""
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
            if isinstance(chunk, CheckedBytes):  # its CRC is known: combine, do not recompute
                crc = combine_crc(crc, chunk.crc32, len(chunk.data))
                chunk = chunk.data
            else:
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
    """Pickle ``structure`` as torch.save does; tensors (slots, or ``torch.Tensor`` when torch
    is already imported) become storages.

    torch's rebuild functions, storage classes and dtypes are written by name, as the opcodes
    torch's own pickle holds, so nothing here imports torch. Placeholders of classes ckptkit did
    not decode (:class:`~ckptkit.unpickler.Opaque`) are replayed as the pickle that built them:
    the same global, arguments, state and items, so loading the output where those classes
    exist gives the original objects; nothing of them is imported or run here. Returns the
    ``data.pkl`` bytes and the slots in storage-key order.
    """
    buf = io.BytesIO()
    slots: list[TensorSlot] = []
    _TorchPickler(buf, slots).dump(structure)
    return buf.getvalue(), slots


@dataclass(frozen=True, eq=False)
class _Global:
    """A global torch.save pickles by name (``module`` ``qualname``), never imported here."""

    module: str
    qualname: str

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce asks for a callable
        raise TypeError(f"{self.module}.{self.qualname} is only a name here, never called")


_REBUILD_V2 = _Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = _Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED_STORAGE = _Global("torch.storage", "UntypedStorage")
_ORDERED_DICT = _Global("collections", "OrderedDict")
_TYPED_STORAGES = {
    d.storage: _Global("torch", d.storage) for d in dtypes.BY_NAME.values() if d.storage
}
_DTYPES = {name: _Global("torch", d.name) for name, d in dtypes.BY_NAME.items()}


@dataclass(eq=False)
class _StorageId:
    slot: TensorSlot


class _TorchPickler(pickle._Pickler):
    """The pure-Python pickler, whose ``save_global`` can name a global without importing it:
    torch's (:class:`_Global`) and each placeholder's (replayed as the pickle that built it)."""

    def __init__(self, stream: BinaryIO, slots: list[TensorSlot]) -> None:
        super().__init__(stream, protocol=2)
        self.slots = slots
        torch = sys.modules.get("torch")  # tensors can only be in memory if it is imported
        if torch is not None:
            self.tensor_type = torch.Tensor
            self.save = self._save_tensors_as_slots

    def _save_tensors_as_slots(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, self.tensor_type):
            obj = _slot_from_tensor(obj)
        super().save(obj, save_persistent_id)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Global):
            return obj.qualname  # a name: the pickler calls save_global
        if isinstance(obj, Opaque):
            return _replay(obj)
        return NotImplemented

    def save_slot(self, slot: TensorSlot) -> None:
        """``rebuild(storage, 0, shape, stride, False, OrderedDict()[, dtype])`` as the opcodes
        ``save_reduce`` would write, without its generic per-argument dispatch (half the time
        of a tensor-heavy pickle)."""
        if not slot.key:
            slot.key = str(len(self.slots))
            self.slots.append(slot)
        save, write = self.save, self.write
        untyped = slot.dtype.storage is None  # fp8, uint16…: untyped bytes plus the dtype
        save(_REBUILD_V3 if untyped else _REBUILD_V2)
        write(pickle.MARK)
        self.save_pers(self.persistent_id(_StorageId(slot)))
        write(pickle.BININT1 + b"\0")  # storage_offset
        self._save_ints(slot.shape)
        self._save_ints(_contiguous_strides(slot.shape))
        write(pickle.NEWFALSE)  # requires_grad
        save(_ORDERED_DICT)
        write(pickle.EMPTY_TUPLE + pickle.REDUCE)  # backward hooks: OrderedDict()
        self.memoize(object())  # memo slots stand for objects save_reduce would memoize
        if untyped:
            save(_DTYPES[slot.dtype.name])
        write(pickle.TUPLE)
        self.memoize(object())  # the arguments tuple
        write(pickle.REDUCE)
        self.memoize(slot)

    def _save_ints(self, values: tuple[int, ...]) -> None:
        """A fresh tuple of ints, as ``save_tuple`` writes it."""
        if not values:
            self.write(pickle.EMPTY_TUPLE)
            return
        short = len(values) <= 3
        if not short:
            self.write(pickle.MARK)
        for value in values:
            self.save_long(value)
        self.write(pickle._tuplesize2code[len(values)] if short else pickle.TUPLE)
        self.memoize(object())

    def save_tensor_data(self, data: TensorData) -> None:
        """A tensor read from inside a pickled object: its elements, row-major, as a slot."""
        array = np.ascontiguousarray(strided_view(data, "a tensor inside an object"))
        self.save_slot(TensorSlot(data.dtype, data.shape, data=array.tobytes()))

    dispatch = {**pickle._Pickler.dispatch, TensorSlot: save_slot, TensorData: save_tensor_data}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageId):
            return None
        slot = obj.slot
        if slot.dtype.storage is None:
            return ("storage", _UNTYPED_STORAGE, slot.key, "cpu", slot.nbytes)
        storage = _TYPED_STORAGES[slot.dtype.storage]
        return ("storage", storage, slot.key, "cpu", slot.nbytes // slot.dtype.itemsize)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, _Global):
            module, qualname = obj.module, obj.qualname
        elif isinstance(obj, type) and issubclass(obj, Opaque):
            module, qualname = obj.module, obj.qualname
            if not all(part.isidentifier() for part in f"{module}.{qualname}".split(".")):
                # STACK_GLOBAL names are any string: a newline would inject opcodes here
                raise UnsafePickleError(
                    f"cannot write the global {obj.global_name!r}: not a dotted Python name",
                    global_name=obj.global_name,
                )
        else:
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


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


def _slot_from_tensor(tensor) -> TensorSlot:
    """A tensor already in memory (inside a decoded object) as a slot carrying its bytes."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return TensorSlot(dtypes.dtype(str(tensor.dtype)), tuple(tensor.shape), data=data)


def write(
    stream: BinaryIO,
    structure: Any,
    produce: Callable[[TensorSlot], Iterable[bytes | memoryview | CheckedBytes]],
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
