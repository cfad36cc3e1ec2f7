"""Where a tensor's elements lie: numpy views of decoded records, chunks placed in the whole
tensor or cut into row-major bytes, and the checks that a tensor's chunks tile it before it is
allocated. Pure numpy over bytes already fetched (torch only to hand back a tensor).

A view may use its bytes more than once (a stride of 0: ``torch.ones(1).expand(n)`` saves one
element): its elements may reach :data:`BROADCAST_SLACK` bytes beyond the bytes its record
holds, no more, so an 852-byte file cannot claim a terabyte of elements."""

from __future__ import annotations

import functools
import math

import numpy as np

from .. import dtypes
from ..catalog.coverage import check_coverage as check_tiling
from ..catalog.model import Chunk, Encoding, Entry, distinct_chunks
from ..decoding.records import TensorData
from ..errors import LimitExceededError, MismatchError
from ..extras import require

__all__ = [
    "BROADCAST_SLACK",
    "allocate",
    "as_bytes",
    "check_coverage",
    "check_record_lengths",
    "chunk_bytes",
    "chunk_view",
    "covering_chunks",
    "is_whole_storage",
    "leading_offset",
    "place",
    "row_major",
    "strided_view",
    "tensor_from_numpy",
    "tiles_first_dim",
]


#: Bytes a tensor's elements may exceed the bytes its record holds by (views reusing their
#: bytes, such as a stride of 0); materialising one costs at most this much more than the record.
BROADCAST_SLACK = 64 << 20


# -- views of records --------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous row-major tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def strided_view(data: TensorData, source: str) -> np.ndarray:
    """A read-only numpy view of the elements ``data`` describes (no copy)."""
    np_dtype = dtypes.to_numpy(data.dtype)
    itemsize = np_dtype.itemsize
    shape, stride = data.shape, data.stride
    numel = math.prod(shape)
    if numel == 0:
        return np.empty(shape, dtype=np_dtype)
    _check_reuse(numel * itemsize, data.buffer.nbytes, f"{source}: tensor {list(shape)}", stride)
    extent = data.storage_offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    available = len(data.buffer) // itemsize
    if extent > available or data.storage_offset < 0 or min(stride, default=0) < 0:
        raise MismatchError(
            f"{source}: tensor {list(shape)} with strides {list(stride)} needs {extent} "
            f"elements, the storage has {available}"
        )
    if stride == row_major(shape):  # contiguous: a plain view, much cheaper to make
        view = np.frombuffer(
            data.buffer, np_dtype, count=numel, offset=data.storage_offset * itemsize
        ).reshape(shape)
        view.flags.writeable = False
        return view
    base = np.frombuffer(data.buffer, dtype=np_dtype, count=available)[data.storage_offset :]
    return np.lib.stride_tricks.as_strided(
        base, shape, tuple(s * itemsize for s in stride), writeable=False
    )


def _check_reuse(nbytes: int, held: int, what: str, stride: tuple[int, ...] | None) -> None:
    """Raise :class:`LimitExceededError` when elements of ``nbytes`` bytes would be made from
    ``held`` bytes of record with more than :data:`BROADCAST_SLACK` bytes to spare."""
    if nbytes > held + BROADCAST_SLACK:
        strides = f" with strides {list(stride)}" if stride is not None else ""
        raise LimitExceededError(
            f"{what}{strides} has {nbytes} bytes of elements over {held} bytes of record: a "
            f"view reusing its bytes may reach at most {BROADCAST_SLACK} bytes beyond them"
        )


def chunk_view(chunk: Chunk, data: TensorData, entry: Entry, source: str) -> np.ndarray:
    """The chunk's elements viewed in its box's shape (a flat chunk: 1-D); a record holding
    another shape raises :class:`MismatchError`."""
    nbytes = math.prod(data.shape) * data.dtype.itemsize
    _check_reuse(nbytes, data.buffer.nbytes, f"{source}: {entry.key!r}", data.stride)
    view = strided_view(data, source)
    if chunk.flat:
        if view.size != chunk.numel:
            raise MismatchError(
                f"{source}: {entry.key!r} flat chunk holds {view.size} elements, expected {chunk.numel}"
            )
        return view.reshape(-1)
    if view.shape != chunk.sizes:
        raise MismatchError(
            f"{source}: {entry.key!r} record holds shape {list(view.shape)}, metadata says {list(chunk.sizes)}"
        )
    return view


def chunk_bytes(chunk: Chunk, data: TensorData, entry: Entry, source: str) -> memoryview:
    """The chunk's elements as row-major bytes: a slice of the record when they lie there
    contiguously (no numpy, no copy), else through :func:`chunk_view`."""
    shape = data.shape
    numel = math.prod(shape)
    if data.stride == row_major(shape) and (
        shape == chunk.sizes if not chunk.flat else numel == chunk.numel
    ):
        itemsize = data.dtype.itemsize
        start = data.storage_offset * itemsize
        end = start + numel * itemsize
        buffer = data.buffer if data.buffer.format == "B" else data.buffer.cast("B")
        if start >= 0 and end <= len(buffer):
            return buffer[start:end]
    return as_bytes(chunk_view(chunk, data, entry, source))


def is_whole_storage(piece: memoryview, data: TensorData) -> bool:
    """Whether ``piece`` (from :func:`chunk_bytes`) is byte for byte all of ``data``'s
    checked storage: row-major from its first element to its last."""
    return (
        data.crc32 is not None
        and data.storage_offset == 0
        and data.stride == row_major(data.shape)
        and piece.nbytes == data.buffer.nbytes
    )


# -- whole tensors -----------------------------------------------------------------------


def allocate(entry: Entry) -> np.ndarray:
    """An uninitialised array for the whole tensor; a shape too large to allocate (it comes
    from the checkpoint) is a :class:`LimitExceededError`."""
    try:
        return np.empty(entry.shape, dtype=dtypes.to_numpy(entry.dtype))
    except (MemoryError, ValueError) as exc:
        raise LimitExceededError(
            f"{entry.key!r}: {entry.nbytes} bytes of {entry.dtype.name}{list(entry.shape)} "
            f"cannot be allocated ({type(exc).__name__})"
        ) from exc


def place(out: np.ndarray, chunk: Chunk, data: TensorData, entry: Entry, source: str) -> None:
    """Copy the chunk's elements (decoded as ``data``) into its box of the whole tensor ``out``."""
    view = chunk_view(chunk, data, entry, source)
    if chunk.flat:
        start = chunk.offsets[0]
        out.reshape(-1)[start : start + chunk.numel] = view
        return
    out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))] = view


def as_bytes(array: np.ndarray) -> memoryview:
    """Row-major bytes of ``array`` (copied only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def tensor_from_numpy(array: np.ndarray, dt: dtypes.DType):
    """``array`` as a tensor of ``dt`` sharing its memory; an empty one with the strides
    torch gives empty tensors (numpy's would make ``.view(torch.uint8)`` fail)."""
    torch = require("torch", "reading tensors as torch tensors (read_numpy() needs no torch)")

    if not array.size:
        return torch.empty(array.shape, dtype=dtypes.to_torch(dt))
    return torch.from_numpy(array).view(dtypes.to_torch(dt))


# -- how chunks cover a tensor -----------------------------------------------------------


def covering_chunks(entry: Entry) -> list[Chunk]:
    """Chunks with replicas (the same box saved by several ranks) dropped; checks that they
    cover the tensor exactly once (:func:`check_coverage`)."""
    chunks = distinct_chunks(entry.chunks)
    check_coverage(entry, chunks)
    return chunks


def check_coverage(entry: Entry, chunks: list[Chunk]) -> None:
    """Raise :class:`CoverageError` unless ``chunks`` (distinct boxes) tile the tensor: every
    element in exactly one chunk, none outside it (see :mod:`ckptkit.catalog.coverage`)."""
    check_tiling(entry, chunks)


def check_record_lengths(entry: Entry, chunks: list[Chunk]) -> None:
    """Refuse, before the tensor is allocated, a raw record shorter than the elements its
    chunk's strides reach (the shape would announce bytes the files do not hold), and a raw or
    torch.save record whose chunk has more element bytes than :data:`BROADCAST_SLACK` past
    the record's (a view reusing few bytes for many elements)."""
    itemsize = entry.dtype.itemsize
    for chunk in chunks:
        record = chunk.record
        if (
            record is None
            or record.encoding not in (Encoding.RAW, Encoding.TORCH_SAVE)
            or record.transform
        ):
            continue  # other records are checked against what they decode to
        numel = chunk.numel
        if not numel:
            continue
        if numel * itemsize > record.length + BROADCAST_SLACK:  # the message built only here
            what = f"{entry.key!r}: the chunk at {list(chunk.offsets)} in {record.file!r}"
            _check_reuse(numel * itemsize, record.length, what, record.stride)
        if record.encoding is Encoding.TORCH_SAVE:
            continue  # its layout is in the record, checked when decoded
        sizes = chunk.sizes
        stride = record.stride or row_major(sizes)
        reach = (
            record.storage_offset
            + 1
            + sum((n - 1) * s for n, s in zip(sizes, stride, strict=False))
        )
        if record.length < reach * itemsize:
            raise MismatchError(
                f"{entry.key!r}: the chunk at {list(chunk.offsets)} reaches {reach * itemsize} "
                f"bytes but its record in {record.file!r} is {record.length} bytes long"
            )


def tiles_first_dim(entry: Entry, chunks: list[Chunk]) -> bool:
    """True when chunks are whole rows (or flat ranges), so their bytes concatenate in order."""
    flat = [c.flat for c in chunks]
    if all(flat):
        return True
    if any(flat):
        return False
    rest = entry.shape[1:]
    zeros = (0,) * len(rest)
    return all(c.sizes[1:] == rest and c.offsets[1:] == zeros for c in chunks)


def leading_offset(chunk: Chunk) -> tuple[int, ...]:
    """Sort key: the chunk's first offset (empty for a 0-d tensor's one chunk)."""
    return chunk.offsets[:1]
