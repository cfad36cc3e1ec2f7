"""Streaming ``torch.save`` output: ``data.pkl`` first, then each storage as it is produced.

The result is the zip layout torch itself writes (stored members, storages 64-byte aligned,
``.storage_alignment`` record), so ``torch.load(..., weights_only=True, mmap=True)`` reads it.

What the pickle names is torch's and the checkpoint's, never ckptkit's: dtypes and devices are
written as torch pickles them, any other ckptkit class is refused. :func:`pickled_globals`
pickles a value the same way into nothing and reports every global the bytes would name, so
what is checked (the ``objects=`` policy, :data:`WEIGHTS_ONLY_GLOBALS`) is what is written.

Longer than most: the zip writer, the pickler with its fast path for tensors (byte for byte
what the generic one writes) and the globals check built on that same pickler belong together.
"""

from __future__ import annotations

import copyreg
import functools
import io
import math
import pickle
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import numpy as np

from ... import dtypes
from ...crc32 import combine as combine_crc
from ...crc32 import crc32
from ...decoding.known_objects import BENIGN_GLOBALS, Device, benign_placeholder
from ...decoding.pickle_limits import OBJECT_LIMITS
from ...decoding.records import TensorData
from ...decoding.unpickler import Opaque, paused_gc
from ...dtypes import DType
from ...errors import MismatchError, PickleLimitError, UnsafePickleError, UsageError
from ...reading import strided_view

if TYPE_CHECKING:
    from ...storage import RangedOutput

__all__ = [
    "ALIGNMENT",
    "WEIGHTS_ONLY_GLOBALS",
    "CheckedBytes",
    "PickledGlobals",
    "RangedZip",
    "StoredZipWriter",
    "TensorSlot",
    "dumps",
    "pickled_globals",
    "write",
]

ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_PAD_TAG = 0x4246  # the extra-field id torch's own writer pads with ("FB")


class CheckedBytes(NamedTuple):
    """A piece of a member whose CRC-32 is known (just checked against its source's)."""

    data: bytes | memoryview
    crc32: int


class _MemberInfo(NamedTuple):  # a tuple: one per member, made fast
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
        header = _local_header(full, size, offset, 0)
        if size <= _SMALL_MEMBER:  # in memory already: CRC first, one write, no seek back
            data, crc = _joined_member(name, size, chunks)
            self.stream.write(_with_crc(header, crc) + data)
            self.members.append(_MemberInfo(full, offset, size, crc))
            return
        self.stream.write(header)
        crc = _write_member_data(name, size, chunks, self.stream.write)
        end = self.stream.tell()
        self.stream.seek(self.start + offset + _CRC_AT)
        self.stream.write(struct.pack("<I", crc))
        self.stream.seek(end)
        self.members.append(_MemberInfo(full, offset, size, crc))

    def close(self) -> None:
        """Write the central directory (and zip64 end records when any field overflows)."""
        for part in _central_directory(self.members, self.stream.tell() - self.start):
            self.stream.write(part)


class RangedZip:
    """A torch.save zip whose layout is known before its storages' bytes: the same bytes as
    :func:`write`, but each storage may be written by any thread at its place
    (:meth:`write_storage`) once :meth:`write_records` wrote the pickle and small records;
    :meth:`finish` then adds the central directory after the :attr:`data_end` bytes of the
    members."""

    def __init__(self, structure: Any, archive_name: str = "archive") -> None:
        pickled, self.slots = dumps(structure)
        members = _members(pickled, self.slots)
        self._contents: list[bytes | TensorSlot] = []
        self._headers: list[bytes] = []
        self._members: list[_MemberInfo] = []
        self._written: set[int] = set()  # members whose CRC is known here
        offset = 0
        for name, content in members:
            full = f"{archive_name}/{name}".encode()
            size = content.nbytes if isinstance(content, TensorSlot) else len(content)
            header = _local_header(full, size, offset, 0)
            self._contents.append(content)
            self._headers.append(header)
            self._members.append(_MemberInfo(full, offset, size, 0))
            offset += len(header) + size
        self.data_end = offset

    @property
    def size(self) -> int:
        """The file's size once finished (the central directory's length does not depend on
        the CRCs still to come)."""
        return self.data_end + sum(map(len, _central_directory(self._members, self.data_end)))

    @property
    def streamed(self) -> list[int]:
        """The storages whose bytes come from a producer (not in memory already), by index
        into :attr:`slots`."""
        return [i for i, slot in enumerate(self.slots) if slot.data is None]

    def write_records(self, file: RangedOutput) -> None:
        """Write every member whose bytes are known: the pickle, the small records, and the
        storages already in memory."""
        for i, content in enumerate(self._contents):
            data = content.data if isinstance(content, TensorSlot) else content
            if data is not None:
                crc = crc32(data)
                self._set_crc(i, crc)
                file.write_at(self._members[i].offset, _with_crc(self._headers[i], crc) + data)

    def write_storage(
        self, file: RangedOutput, index: int, chunks: Iterable[bytes | memoryview | CheckedBytes]
    ) -> None:
        """Write storage ``index`` (of :attr:`slots`) from its pieces, then its header with
        their CRC-32; another thread may be writing another storage meanwhile."""
        member = _FIRST_STORAGE + index
        info, header = self._members[member], self._headers[member]
        write = file.writer_at(info.offset + len(header))
        crc = _write_member_data(info.name.decode(), info.size, chunks, write)
        self._set_crc(member, crc)
        file.write_at(info.offset, _with_crc(header, crc))

    def crcs(self) -> dict[int, int]:
        """The CRC-32s of the members written here, by member index: what :meth:`finish`
        needs from each process that wrote some of the storages."""
        return {i: m.crc for i, m in enumerate(self._members) if i in self._written}

    def finish(self, file: RangedOutput, crcs: Iterable[dict[int, int]] = ()) -> int:
        """Write the central directory after the members (every storage written, here or by
        processes whose :meth:`crcs` are given); the file's size."""
        for found in crcs:
            for member, crc in found.items():
                self._set_crc(member, crc)
        write = file.writer_at(self.data_end)
        size = self.data_end
        for part in _central_directory(self._members, self.data_end):
            write(part)
            size += len(part)
        return size

    def _set_crc(self, member: int, crc: int) -> None:
        self._members[member] = self._members[member]._replace(crc=crc)
        self._written.add(member)


def _local_header(full: bytes, size: int, offset: int, crc: int) -> bytes:
    """The local header of member ``full`` of ``size`` bytes at ``offset`` (zip64 fields when
    needed), padded so its data starts 64-byte aligned as torch's writer pads; its length does
    not depend on ``crc``."""
    zip64 = size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
    header_len = 30 + len(full) + len(extra)
    pad = -(offset + header_len + 4) % ALIGNMENT  # 4 = the padding field's own header
    extra += struct.pack("<HH", _PAD_TAG, pad) + b"Z" * pad
    stored_size = _ZIP64_LIMIT if zip64 else size
    version = 45 if zip64 else 20
    return (
        _LOCAL_HEADER.pack(
            b"PK\x03\x04", version, 0, 0, 0, 0, crc, stored_size, stored_size, len(full), len(extra)
        )
        + full
        + extra
    )


def _with_crc(header: bytes, crc: int) -> bytes:
    """A local header with its CRC-32 field set."""
    return header[:_CRC_AT] + struct.pack("<I", crc) + header[_CRC_AT + 4 :]


def _write_member_data(
    name: str, size: int, chunks: Iterable[bytes | memoryview | CheckedBytes], write: Callable
) -> int:
    """``write`` a member's pieces in order; their CRC-32 (combined from those of
    :class:`CheckedBytes`, computed for the others). Refused unless they are ``size`` bytes."""
    crc, written = 0, 0
    for chunk in chunks:
        if isinstance(chunk, CheckedBytes):  # its CRC is known: combine, do not recompute
            crc = combine_crc(crc, chunk.crc32, len(chunk.data))
            chunk = chunk.data
        else:
            crc = crc32(chunk, crc)
        written += len(chunk)
        write(chunk)
        del chunk  # let go of the piece (a reader's reused buffer) before the next is read
    if written != size:
        raise MismatchError(f"member {name!r}: {written} bytes written, {size} announced")
    return crc


def _central_directory(members: list[_MemberInfo], cd_start: int) -> Iterator[bytes]:
    """The central directory of ``members`` starting at ``cd_start`` and the end records
    (zip64 ones when any field overflows), in batches of entries."""
    entries: list[bytes] = []
    cd_size = 0
    for m in members:
        zip64 = m.size >= _ZIP64_LIMIT or m.offset >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQQ", 0x0001, 24, m.size, m.size, m.offset) if zip64 else b""
        size = _ZIP64_LIMIT if zip64 else m.size
        offset = _ZIP64_LIMIT if zip64 else m.offset
        entries.append(
            _CENTRAL_HEADER.pack(
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
            )  # fmt: skip
            + m.name
            + extra
        )
        if len(entries) == _CENTRAL_BATCH:  # many members: a write per batch, not each
            batch = b"".join(entries)
            cd_size += len(batch)
            yield batch
            entries.clear()
    if entries:
        batch = b"".join(entries)
        cd_size += len(batch)
        yield batch
    cd_end = cd_start + cd_size
    count = len(members)
    if count >= 0xFFFF or cd_start >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
        yield struct.pack(
            "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_start
        )
        yield struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_end, 1)
        count16, cd_size32, cd_start32 = 0xFFFF, _ZIP64_LIMIT, _ZIP64_LIMIT
    else:
        count16, cd_size32, cd_start32 = count, cd_size, cd_start
    yield struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count16, count16, cd_size32, cd_start32, 0)


#: A zip member's local header, and where its CRC-32 is.
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_CRC_AT = 14
#: A central directory entry's fixed part, and how many entries are written at once.
_CENTRAL_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")
_CENTRAL_BATCH = 4096
#: Members up to this size are joined in memory and written with their CRC-32 in one write
#: (small tensors' pieces are in memory already); larger ones stream, their CRC patched after.
_SMALL_MEMBER = 1 << 20


def _joined_member(
    name: str, size: int, chunks: Iterable[bytes | memoryview | CheckedBytes]
) -> tuple[bytes | memoryview, int]:
    """A small member's pieces as one buffer, and its CRC-32 (refusing a size other than
    announced, as the streaming path does)."""
    pieces = [chunk.data if isinstance(chunk, CheckedBytes) else chunk for chunk in chunks]
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    written = len(data)
    if written != size:
        raise MismatchError(f"member {name!r}: {written} bytes written, {size} announced")
    return data, crc32(data)


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


@functools.lru_cache(maxsize=4096)
def _int_opcodes(value: int) -> bytes:
    """What ``save_long(value)`` writes at protocol 2."""
    buf = io.BytesIO()
    pickle._Pickler(buf, protocol=2).save_long(value)
    return buf.getvalue()


@functools.lru_cache(maxsize=4096)
def _shape_opcodes(shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The opcodes of the shape's and its contiguous strides' tuples of ints, as
    ``save_tuple`` writes them before memoizing them."""
    return _ints_opcodes(shape), _ints_opcodes(_contiguous_strides(shape))


#: A 4-byte little-endian length or memo index, as pickle opcodes write them.
_UINT32 = struct.Struct("<I")


def _put_opcode(index: int) -> bytes:
    """What ``memoize`` writes at protocol 2 for memo entry ``index``."""
    if index < 256:
        return pickle.BINPUT + bytes((index,))
    return pickle.LONG_BINPUT + struct.pack("<I", index)


def _ints_opcodes(values: tuple[int, ...]) -> bytes:
    if not values:
        return pickle.EMPTY_TUPLE
    short = len(values) <= 3
    ops = b"".join(map(_int_opcodes, values))
    if short:
        return ops + pickle._tuplesize2code[len(values)]
    return pickle.MARK + ops + pickle.TUPLE


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
    # the cyclic GC paused: the memo grows by several small acyclic objects per tensor, and
    # each collection they would trigger walks the whole catalog
    with paused_gc():
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
_DEVICE = _Global("torch", "device")
#: The top-level package of ckptkit's own classes, which no output may name.
_OWN_PACKAGE = __name__.partition(".")[0]


@dataclass(eq=False)
class _StorageId:
    slot: TensorSlot


class _TorchPickler(pickle._Pickler):
    """The pure-Python pickler, whose ``save_global`` can name a global without importing it:
    torch's (:class:`_Global`) and each placeholder's (replayed as the pickle that built it).
    ckptkit's dtypes and devices become torch's; any other class of ckptkit is refused."""

    #: Whether every object saved must go through ``save`` (a pickler counting them).
    counts_saves = False

    def __init__(self, stream: BinaryIO, slots: list[TensorSlot]) -> None:
        super().__init__(stream, protocol=2)
        self.slots = slots
        self._refs: dict[int, bytes] = {}  # memo reference opcodes of objects save_slot names
        #: per (dtype, shape): a slot's opcodes between its memo puts (see _save_slot_templated)
        self._templates: dict[tuple[str, tuple[int, ...]], tuple[bytes, ...] | None] = {}
        torch = sys.modules.get("torch")  # tensors can only be in memory if it is imported
        self.tensor_type = torch.Tensor if torch is not None else None
        if torch is not None:
            self.save = self._save_tensors_as_slots

    def _save_tensors_as_slots(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, self.tensor_type):
            obj = _slot_from_tensor(obj)
        super().save(obj, save_persistent_id)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Global):
            return obj.qualname  # a name: the pickler calls save_global
        if isinstance(obj, Opaque):
            return self.replay(obj)
        kind = type(obj)
        if kind not in self.dispatch and not isinstance(obj, type) and _is_own(kind.__module__):
            raise _own_class_error(f"{kind.__module__}.{kind.__qualname__}")
        return NotImplemented

    def replay(self, obj: Opaque) -> tuple:
        """The reduce value replaying the placeholder ``obj`` (see :func:`_replay`)."""
        return _replay(obj)

    def save_slot(self, slot: TensorSlot) -> None:
        """``rebuild(storage, 0, shape, stride, False, OrderedDict()[, dtype])`` as the opcodes
        ``save_reduce`` would write, byte for byte, in one write: globals and strings seen
        before as memo references (their opcodes kept), the shape and stride opcodes cached per
        shape (a pickle of many small tensors spent most of its time in the generic dispatch)."""
        if self.counts_saves or self.fast:
            self._save_slot_generic(slot)
            return
        if not slot.key:
            slot.key = str(len(self.slots))
            self.slots.append(slot)
        memo = self.memo
        if len(memo) >= 256 and self._save_slot_templated(slot):
            return
        parts: list[bytes] = []
        ref = self._ref
        untyped = slot.dtype.storage is None  # fp8, uint16…: untyped bytes plus the dtype
        ref(parts, _REBUILD_V3 if untyped else _REBUILD_V2)
        pid = self.persistent_id(_StorageId(slot))  # saved as save_tuple saves it
        parts.append(pickle.MARK + pickle.MARK)
        ref(parts, pid[0])
        ref(parts, pid[1])
        key = pid[2]
        if type(key) is str and id(key) not in memo:  # a fresh key, as save_str writes it
            encoded = key.encode("utf-8", "surrogatepass")
            parts.append(pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded)
            parts.append(_put_opcode(len(memo)))
            memo[id(key)] = len(memo), key
        else:
            self._ref(parts, key, remember=False)
        ref(parts, pid[3])
        parts.append(_int_opcodes(pid[4]) + pickle.TUPLE)
        parts.append(_put_opcode(len(memo)))
        memo[id(pid)] = len(memo), pid
        parts.append(pickle.BINPERSID + pickle.BININT1 + b"\0")  # storage_offset 0
        shape_ops, stride_ops = _shape_opcodes(slot.shape)
        for ops in (shape_ops, stride_ops):
            parts.append(ops)
            if slot.shape:  # a fresh tuple, memoized (the empty tuple is not)
                kept = object()
                parts.append(_put_opcode(len(memo)))
                memo[id(kept)] = len(memo), kept
        parts.append(pickle.NEWFALSE)  # requires_grad
        ref(parts, _ORDERED_DICT)
        parts.append(pickle.EMPTY_TUPLE + pickle.REDUCE)  # backward hooks: OrderedDict()
        kept = object()  # memo slots stand for objects save_reduce would memoize
        parts.append(_put_opcode(len(memo)))
        memo[id(kept)] = len(memo), kept
        if untyped:
            ref(parts, _DTYPES[slot.dtype.name])
        kept = object()  # the arguments tuple
        parts.append(pickle.TUPLE + _put_opcode(len(memo)))
        memo[id(kept)] = len(memo), kept
        parts.append(pickle.REDUCE + _put_opcode(len(memo)))
        memo[id(slot)] = len(memo), slot
        self.write(b"".join(parts))

    def _save_slot_templated(self, slot: TensorSlot) -> bool:
        """:meth:`save_slot` once the memo holds 256 entries (every put then a 4-byte
        ``LONG_BINPUT``) and every global it names is a memo reference: the same bytes, as the
        slot's (dtype, shape) template with its key and seven memo indices filled in (a pickle
        of 50k small tensors spent most of its time in the opcode-by-opcode path). False when
        there is no template yet: the caller takes that path."""
        key = slot.key
        memo = self.memo
        if type(key) is not str or id(key) in memo:
            return False
        at = (slot.dtype.name, slot.shape)
        template = self._templates.get(at, False)
        if template is False:
            template = self._templates[at] = self._slot_template(slot)
        if template is None:
            return False
        encoded = key.encode("utf-8", "surrogatepass")
        m = len(memo)
        index = _UINT32.pack
        # the key, then each fragment (ending in LONG_BINPUT) with the index it puts: the pid
        # tuple, the shape, the stride, the backward hooks, the arguments, the tensor
        parts = [template[0], index(len(encoded)), encoded, pickle.LONG_BINPUT, index(m)]
        for put, fragment in enumerate(template[1:], m + 1):
            parts += (fragment, index(put))
        self.write(b"".join(parts))
        memo[id(key)] = m, key
        for put in range(m + 1, m + 6):  # objects save_reduce would memoize, none kept
            memo[-put] = put, None  # a key no id() can be
        memo[id(slot)] = m + 6, slot
        return True

    def _slot_template(self, slot: TensorSlot) -> tuple[bytes, ...] | None:
        """The fixed opcodes of a slot of ``slot``'s dtype and shape between its memo puts
        (:meth:`_save_slot_templated`): up to the key's ``BINUNICODE``, then six fragments
        each ending in ``LONG_BINPUT``; from the references :meth:`save_slot` kept. None while
        a global it names is not one yet, or for a 0-d tensor (its shape is not memoized)."""
        if not slot.shape:
            return None
        untyped = slot.dtype.storage is None
        pid = self.persistent_id(_StorageId(slot))
        named = [_REBUILD_V3 if untyped else _REBUILD_V2, pid[0], pid[1], pid[3], _ORDERED_DICT]
        if untyped:
            named.append(_DTYPES[slot.dtype.name])
        refs = [self._refs.get(id(obj)) for obj in named]
        if None in refs:
            return None
        shape_ops, stride_ops = _shape_opcodes(slot.shape)
        put = pickle.LONG_BINPUT
        return (
            refs[0] + pickle.MARK + pickle.MARK + refs[1] + refs[2] + pickle.BINUNICODE,
            refs[3] + _int_opcodes(pid[4]) + pickle.TUPLE + put,
            pickle.BINPERSID + pickle.BININT1 + b"\0" + shape_ops + put,
            stride_ops + put,
            pickle.NEWFALSE + refs[4] + pickle.EMPTY_TUPLE + pickle.REDUCE + put,
            (refs[5] if untyped else b"") + pickle.TUPLE + put,
            pickle.REDUCE + put,
        )

    def _ref(self, parts: list[bytes], obj: Any, *, remember: bool = True) -> None:
        """``save(obj)`` into ``parts``: a memo reference when ``obj`` was saved before (its
        opcode kept when ``remember``: the objects :meth:`save_slot` names every time), else
        (``parts`` written first) the generic way."""
        known = self._refs.get(id(obj))
        if known is not None:
            parts.append(known)
            return
        found = self.memo.get(id(obj))
        if found is None:
            self.write(b"".join(parts))
            parts.clear()
            self.save(obj)
            found = self.memo.get(id(obj))
            if found is None:
                return
        else:
            parts.append(self.get(found[0]))
        if remember:  # memo entries never change during a dump
            self._refs[id(obj)] = self.get(found[0])

    def _save_slot_generic(self, slot: TensorSlot) -> None:
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

    def save_dtype(self, dt: DType) -> None:
        """A dtype as ``torch.save`` pickles one: the global ``torch.<name>``."""
        self.save(_DTYPES[dt.name])

    def save_device(self, device: Device) -> None:
        """A device as ``torch.save`` pickles one: ``torch.device(type[, index])``."""
        args = (device.type,) if device.index is None else (device.type, device.index)
        self.save_reduce(_DEVICE, args, obj=device)

    dispatch = {
        **pickle._Pickler.dispatch,
        TensorSlot: save_slot,
        TensorData: save_tensor_data,
        DType: save_dtype,
        Device: save_device,
    }

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
                self.unwritable_name(obj)
                return
        else:
            module, qualname = _global_name(obj, name)
            if _is_own(module):
                raise _own_class_error(f"{module}.{qualname}")
            self.named(f"{module}.{qualname}", obj)
            super().save_global(obj, name)
            return
        self.named(f"{module}.{qualname}", obj)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)

    def named(self, name: str, obj: Any) -> None:
        """Called with each global written (nothing to do here; :class:`_GlobalsPickler`
        records them)."""

    def unwritable_name(self, cls: type[Opaque]) -> None:
        """A placeholder's global that is not a dotted Python name: refused."""
        raise UnsafePickleError(
            f"cannot write the global {cls.global_name!r}: not a dotted Python name",
            global_name=cls.global_name,
        )


def _global_name(obj: Any, name: str | None) -> tuple[str, str]:
    """``(module, qualname)`` as ``pickle`` names a class or function it saves as a global."""
    if name is None:
        name = getattr(obj, "__qualname__", None) or obj.__name__
    return pickle.whichmodule(obj, name), name


def _is_own(module: str) -> bool:
    return module.partition(".")[0] == _OWN_PACKAGE


def _own_class_error(name: str) -> UsageError:
    """The refusal of a ckptkit class reaching the output: loading it would need ckptkit."""
    return UsageError(
        f"cannot write {name}: a class of ckptkit's own, which loading the output would need "
        "ckptkit for; leave it out with exclude="
    )


def _replay(obj: Opaque, *, strict: bool = True) -> tuple:
    """The reduce value that pickles ``obj`` as it was unpickled: REDUCE ``cls(*args)`` or
    NEWOBJ ``cls.__new__(cls, *args)``, then its items, then BUILD with its state. Keyword
    arguments (NEWOBJ_EX) cannot be written: refused, or (not ``strict``, only to see what the
    pickle names) passed as one more argument."""
    args = obj.args
    if obj.kwargs:
        if strict:
            raise UsageError(
                f"{obj.global_name} was built with keyword arguments (NEWOBJ_EX), which a "
                "protocol-2 torch.save pickle cannot express; leave it out with exclude="
            )
        args = (*args, obj.kwargs)
    listitems = iter(obj.listitems) if obj.listitems else None
    dictitems = iter(obj.dictitems) if obj.dictitems else None
    if obj.called:
        return type(obj), args, obj.state, listitems, dictitems
    return copyreg.__newobj__, (type(obj), *args), obj.state, listitems, dictitems


# --------------------------------------------------------------------------------------------
# What a pickle names: the same pickling, into nothing.


@dataclass(frozen=True)
class PickledGlobals:
    """The globals a value's pickle names (as Python 3 spells them), sorted: all of them, and
    the ``harmful`` ones: the checkpoint's globals not known to be harmless (see
    :data:`~ckptkit.decoding.known_objects.BENIGN_GLOBALS`), which loading would import or run."""

    names: tuple[str, ...]
    harmful: tuple[str, ...]

    @property
    def refused_by_weights_only(self) -> tuple[str, ...]:
        """The globals ``torch.load(weights_only=True)`` refuses (outside its allowlist)."""
        return tuple(name for name in self.names if name not in WEIGHTS_ONLY_GLOBALS)


def pickled_globals(value: Any, *, budget: int = OBJECT_LIMITS.max_items) -> PickledGlobals:
    """Every global :func:`dumps` would write for ``value`` (a value as unpickled, placeholders
    kept), found by pickling it the same way into nothing (tensor bytes not read): classes,
    reduce functions, and everything in arguments, BUILD states and items, nested. Refuses
    ckptkit's own classes as :func:`dumps` does; placeholders it could not write (keyword
    arguments, names that are not dotted) count as harmful. Reference cycles end at the memo, as
    when writing; more than ``budget`` objects raise :class:`PickleLimitError`, and a value
    nested too deeply for the pickler (or in a cycle through sets or tuples alone, which no
    pickle can express) raises :class:`UsageError`."""
    pickler = _GlobalsPickler(budget)
    try:
        pickler.dump(value)
    except RecursionError:
        raise UsageError(
            "cannot write it: nested too deeply, or in a reference cycle through sets or tuples "
            "(which a pickle cannot express); leave it out with exclude="
        ) from None
    return PickledGlobals(tuple(sorted(pickler.names)), tuple(sorted(pickler.harmful)))


class _NullSink:
    """A stream that keeps nothing."""

    def write(self, data: bytes) -> int:
        return len(data)


class _GlobalsPickler(_TorchPickler):
    """:class:`_TorchPickler` writing into nothing, recording every global it names and judging
    the checkpoint's placeholders and classes; tensors are slots without bytes."""

    def __init__(self, budget: int) -> None:
        super().__init__(_NullSink(), [])
        self.names: set[str] = set()
        self.harmful: set[str] = set()
        self.budget = budget
        self.save = self._counted_save

    counts_saves = True

    def _counted_save(self, obj: Any, save_persistent_id: bool = True) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise PickleLimitError("object of too many parts to write")
        if self.tensor_type is not None and isinstance(obj, self.tensor_type):
            obj = TensorSlot(dtypes.dtype(str(obj.dtype)), tuple(obj.shape))
        pickle._Pickler.save(self, obj, save_persistent_id)

    def replay(self, obj: Opaque) -> tuple:
        if not benign_placeholder(obj):
            self.harmful.add(obj.global_name)
        return _replay(obj, strict=False)

    def save_tensor_data(self, data: TensorData) -> None:
        self.save_slot(TensorSlot(data.dtype, data.shape))  # its bytes name nothing

    dispatch = {**_TorchPickler.dispatch, TensorData: save_tensor_data}

    def named(self, name: str, obj: Any) -> None:
        self.names.add(name)
        if isinstance(obj, type) and issubclass(obj, Opaque) and name not in BENIGN_GLOBALS:
            self.harmful.add(name)

    def unwritable_name(self, cls: type[Opaque]) -> None:
        self.names.add(cls.global_name)
        self.harmful.add(cls.global_name)
        self.memoize(cls)


_WEIGHTS_ONLY_DTYPES = (
    *("bfloat16", "bool", "complex32", "complex64", "complex128"),
    *("float16", "float32", "float64", "float4_e2m1fn_x2", "float8_e8m0fnu"),
    *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"),
    *(f"int{bits}" for bits in (*range(1, 9), 16, 32, 64)),
    *(f"uint{bits}" for bits in (*range(1, 9), 16, 32, 64)),
    *("qint8", "qint32", "quint8", "quint2x4", "quint4x2"),
    *("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
)
_KINDS = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_SPARSE_KINDS = tuple(kind for kind in _KINDS if kind != "Bool")
_STORAGE_KINDS = (*_KINDS, "ComplexDouble", "ComplexFloat")
_REBUILDS = (
    *("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"),
    *("_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor"),
    *("_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass"),
    *("_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"),
)
_QSCHEMES = (
    *("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine"),
    *("per_channel_symmetric", "per_channel_affine_float_qparams"),
)
#: What ``torch.load(weights_only=True)`` accepts by default (torch 2.13's
#: ``torch._weights_only_unpickler._get_allowed_globals``, kept here so nothing imports torch):
#: tensors, storages, dtypes, ``torch.Size`` and ``torch.device``, ``OrderedDict``,
#: ``Counter`` and a few builtins. A pickle naming anything else is refused by it.
WEIGHTS_ONLY_GLOBALS: frozenset[str] = frozenset(
    (
        *("collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter"),
        *("torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device"),
        *("_codecs.encode", "builtins.bytearray", "builtins.set", "builtins.complex"),
        *(f"torch.{name}" for name in _WEIGHTS_ONLY_DTYPES),
        *(f"torch.{name}" for name in _QSCHEMES),
        *(f"torch.{kind}Storage" for kind in _STORAGE_KINDS),
        *(f"torch.{kind}Storage" for kind in ("QInt8", "QInt32", "QUInt8", "QUInt2x4", "QUInt4x2")),
        *(f"torch.cuda.{kind}Storage" for kind in _STORAGE_KINDS),
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        *(f"torch.{kind}Tensor" for kind in _KINDS),
        *(f"torch.cuda.{kind}Tensor" for kind in _KINDS),
        *(f"torch.sparse.{kind}Tensor" for kind in _SPARSE_KINDS),
        *(f"torch.cuda.sparse.{kind}Tensor" for kind in _SPARSE_KINDS),
        *(f"torch._utils.{name}" for name in _REBUILDS),
        "torch._tensor._rebuild_from_type_v2",
    )
)


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
    for name, content in _members(pickled, slots):
        if not isinstance(content, TensorSlot):
            zip_writer.write(name, content)
        else:
            chunks = [content.data] if content.data is not None else produce(content)
            zip_writer.write_chunks(name, content.nbytes, chunks)
    zip_writer.close()
    return slots


def _members(pickled: bytes, slots: list[TensorSlot]) -> list[tuple[str, bytes | TensorSlot]]:
    """The members of a torch.save zip in torch's order: the pickle, three small records, the
    storages (:data:`_FIRST_STORAGE` is the first's index), ``version``."""
    records: list[tuple[str, bytes | TensorSlot]] = [
        ("data.pkl", pickled),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
    ]
    return [*records, *((f"data/{slot.key}", slot) for slot in slots), ("version", b"3\n")]


_FIRST_STORAGE = 4
