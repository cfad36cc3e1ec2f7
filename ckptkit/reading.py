"""Reading values out of a catalog: tensors assembled from their chunks, objects decoded safely.

Format-free: it sees only entries, chunks and records. Tensors are assembled in numpy (torch is
imported only to hand back a ``torch.Tensor``), a bounded batch of records at a time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from . import dtypes
from .catalog import Chunk, Encoding, Entry, Record, distinct_chunks, leaf_path
from .errors import (
    CorruptRecordError,
    FormatError,
    LimitExceededError,
    MismatchError,
    MissingFileError,
    PickleLimitError,
    TruncatedFileError,
)
from .known_objects import MAX_DEPTH, decoded
from .pickle_limits import OBJECT_LIMITS
from .records import (
    SafetensorsHeader,
    TensorData,
    TorchArchive,
    ZipIndex,
    check_crc,
    decode_object_record,
    decode_tensor_record,
    read_safetensors_headers,
    read_zip_indexes,
    tensor_archive_limit,
    undo_transform,
)
from .storage import Storage
from .unpickler import OBJECT_GLOBALS, Opaque, TensorRef, safe_loads

#: ``read_object(trust=True)`` loads a whole torch.save file: bounded by its real size only.
TRUSTED_FILE_LIMIT = 1 << 62
#: Records fetched together for one tensor, at most (bytes); bounds memory while assembling.
BATCH_BYTES = 64 << 20


class Reader:
    """Fetches and decodes records of one checkpoint location."""

    def __init__(
        self,
        storage: Storage,
        object_globals: Mapping[str, Any] | None = None,
        *,
        verify_crc: bool = True,
    ) -> None:
        self.storage = storage
        self.object_globals = object_globals if object_globals is not None else OBJECT_GLOBALS
        #: Check what is read against the CRC-32 the format stores (torch.save zip members).
        self.verify_crc = verify_crc
        self._safetensors_headers: dict[tuple[str, int], SafetensorsHeader] = {}
        self._zip_indexes: dict[str, ZipIndex] = {}  # torch.save file → its located members
        self._pickles: OrderedDict[tuple[str, int, int], Any] = OrderedDict()

    # -- tensors ---------------------------------------------------------------------------

    def read_array(self, entry: Entry) -> np.ndarray:
        """The whole tensor as a numpy array (bfloat16/fp8 as same-sized unsigned ints)."""
        if entry.kind != "tensor" or entry.dtype is None or entry.shape is None:
            raise FormatError(f"{entry.key!r} is not a tensor")
        chunks = _distinct_chunks(entry)
        _check_record_lengths(entry, chunks)
        try:
            out = np.empty(entry.shape, dtype=dtypes.to_numpy(entry.dtype))
        except (MemoryError, ValueError) as exc:  # the shape comes from the checkpoint
            raise LimitExceededError(
                f"{entry.key!r}: {entry.nbytes} bytes of {entry.dtype.name}{list(entry.shape)} "
                f"cannot be allocated ({type(exc).__name__})"
            ) from exc
        for batch in _batches([c for c in chunks if c.record is not None]):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                _place(out, chunk, data, entry, self.storage.describe(chunk.record.file))
            data = None  # release this batch's records before the next batch is read
        return out

    def iter_bytes(self, entry: Entry) -> Iterator[memoryview]:
        """The tensor's row-major bytes, in pieces: chunk by chunk when they tile the first
        dimension (or a flat range), else the assembled tensor at once. Used for streaming."""
        chunks = _distinct_chunks(entry)
        if not _tiles_first_dim(entry, chunks):
            yield _as_bytes(self.read_array(entry))
            return
        ordered = sorted((c for c in chunks if c.record is not None), key=lambda c: c.offsets[:1])
        for batch in _batches(ordered):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                source = self.storage.describe(chunk.record.file)
                view = strided_view(data, source)
                if view.size != chunk.numel or (not chunk.flat and view.shape != chunk.sizes):
                    raise MismatchError(
                        f"{source}: {entry.key!r} record holds shape {list(view.shape)}, metadata says {list(chunk.sizes)}"
                    )
                yield _as_bytes(view)
            data = view = None  # release this batch before the next one is read

    def read_chunk(self, entry: Entry, chunk: Chunk) -> memoryview:
        """One stored chunk's elements as row-major bytes."""
        (data,) = self.decode_chunks(entry, [chunk])
        view = strided_view(data, self.storage.describe(chunk.record.file))
        if view.size != chunk.numel:
            raise MismatchError(
                f"{entry.key!r}: chunk record holds {view.size} elements, expected {chunk.numel}"
            )
        return _as_bytes(view)

    def read_tensor(self, entry: Entry):
        """The whole tensor as a ``torch.Tensor`` with the entry's dtype (imports torch)."""
        array = self.read_array(entry)
        return _tensor_from_numpy(array, entry.dtype)

    def decode_chunks(self, entry: Entry, chunks: list[Chunk]) -> list[TensorData]:
        """What each of ``chunks`` (chunks of the tensor ``entry`` that have a record) stores:
        its records fetched in one batch of reads, checked against their CRC-32 when
        :attr:`verify_crc`, decoded, and their dtype checked against the entry's
        (:class:`MismatchError`). The results view the fetched bytes, so pass a bounded batch
        (:data:`BATCH_BYTES`); the caller checks shapes against ``chunk.sizes``."""
        records = [c.record for c in chunks]
        self._load_safetensors_headers([r for r in records if r.encoding is Encoding.SAFETENSORS])
        ranges = [self._byte_range(r) for r in records]
        blobs = self.read_ranges(ranges, entry.key)
        out = []
        for chunk, (_, start, _), blob in zip(chunks, ranges, blobs, strict=True):
            record = chunk.record
            source = f"{self.storage.describe(record.file)} @{start} ({entry.key})"
            if self.verify_crc and record.crc32 is not None:
                check_crc(blob, record.crc32, source)
            if record.encoding is Encoding.TORCH_SAVE:
                data = decode_tensor_record(
                    undo_transform(
                        blob,
                        record.transform,
                        source,
                        limit=tensor_archive_limit(chunk.numel * entry.dtype.itemsize),
                    ),
                    source,
                    verify_crc=self.verify_crc,
                )
            elif record.encoding is Encoding.SAFETENSORS:
                dt, shape, _, _ = self._safetensors_entry(record)
                data = TensorData(dt, shape, _row_major(shape), 0, memoryview(blob))
            else:
                shape = chunk.sizes
                stride = record.stride or _row_major(shape)
                data = TensorData(
                    entry.dtype, shape, stride, record.storage_offset, memoryview(blob)
                )
            if data.dtype != entry.dtype:
                raise MismatchError(
                    f"{source}: record holds {data.dtype.name}, metadata says {entry.dtype.name}"
                )
            out.append(data)
        return out

    def read_record(self, entry: Entry, chunk: Chunk) -> bytes:
        """``chunk``'s stored record byte for byte (any byte transform such as zstd left in
        place), for copying it unchanged. When :attr:`verify_crc`, its CRC-32 is checked first:
        the one the format stores for the record, and for a torch.save record every member's
        (the transform undone for that, within the size its chunk allows)."""
        record = chunk.record
        if record is None:
            raise FormatError(f"{entry.key!r}: the chunk at {list(chunk.offsets)} has no record")
        (data,) = self.read_ranges(
            [(record.file, record.offset, record.offset + record.length)], entry.key
        )
        if self.verify_crc:
            source = f"{self.storage.describe(record.file)} @{record.offset} ({entry.key})"
            if record.crc32 is not None:
                check_crc(data, record.crc32, source)
            if record.encoding is Encoding.TORCH_SAVE:
                limit = (
                    tensor_archive_limit(chunk.numel * entry.dtype.itemsize)
                    if entry.kind == "tensor"
                    else OBJECT_LIMITS.max_bytes
                )
                raw = undo_transform(data, record.transform, source, limit=limit)
                TorchArchive(raw, source).check_crc()
        return data

    def read_ranges(self, ranges: list[tuple[str, int, int]], key: str) -> list[bytes]:
        """``storage.read_ranges`` naming ``key`` in errors; a range past the end of its file
        raises :class:`TruncatedFileError` with the file's size."""
        try:
            return self.storage.read_ranges(ranges)
        except TruncatedFileError:
            raise
        except MissingFileError as exc:
            raise MissingFileError(f"{exc} (needed for {key!r})") from exc
        except CorruptRecordError as exc:
            sizes = self.storage.sizes(sorted({file for file, _, _ in ranges}))
            for file, start, end in ranges:
                size = sizes.get(file)
                if size is not None and end > size:
                    raise TruncatedFileError(
                        f"{self.storage.describe(file)}: truncated: {key!r} needs bytes "
                        f"[{start}, {end}), the file has {size} bytes"
                    ) from exc
            raise

    def _byte_range(self, record: Record) -> tuple[str, int, int]:
        if record.encoding is Encoding.SAFETENSORS:
            _, _, begin, end = self._safetensors_entry(record)
            header = self._safetensors_headers[(record.file, record.offset)]
            start = record.offset + header.data_start + begin
            return (record.file, start, start + (end - begin))
        return (record.file, record.offset, record.offset + record.length)

    def _safetensors_entry(self, record: Record):
        header = self._safetensors_headers[(record.file, record.offset)]
        found = header.tensors.get(record.name)
        if found is None:
            raise CorruptRecordError(
                f"{self.storage.describe(record.file)}: safetensors blob at {record.offset} has no tensor {record.name!r}"
            )
        return found

    def _load_safetensors_headers(self, records: list[Record]) -> None:
        blobs = sorted({(r.file, r.offset) for r in records} - self._safetensors_headers.keys())
        if blobs:
            self._safetensors_headers.update(read_safetensors_headers(self.storage, blobs))

    # -- objects ---------------------------------------------------------------------------

    def read_objects(
        self, entries: list[Entry], *, tensors: str = "torch", decode: bool = True
    ) -> list[Any]:
        """Decode object entries in one batch of reads.

        ``tensors="torch"`` turns tensors inside objects into ``torch.Tensor`` (imports torch);
        ``tensors="ref"`` leaves them as descriptions, which needs no torch. ``decode`` turns
        placeholders of known benign classes into real values and marks reference cycles
        (:func:`ckptkit.known_objects.decoded`); False keeps every placeholder and cycle as the
        pickle built them, for writing the value back. A torch.save file's ``data.pkl`` is
        decoded once and kept for later keys of the same file (:attr:`PICKLE_CACHE` files).
        """
        records = [_object_record(entry) for entry in entries]
        ranges = list(
            dict.fromkeys(
                _record_range(r)
                for r in records
                if r.encoding is Encoding.TORCH_SAVE or _record_range(r) not in self._pickles
            )
        )
        keys = ", ".join(repr(e.key) for e in entries[:3]) + (" …" if len(entries) > 3 else "")
        blobs = dict(zip(ranges, self.read_ranges(ranges, keys), strict=True)) if ranges else {}
        values = []
        for entry, record in zip(entries, records, strict=True):
            source = f"{self.storage.describe(record.file)} @{record.offset} ({entry.key})"
            if record.encoding is Encoding.TORCH_SAVE:
                blob = blobs[_record_range(record)]
                self._check_crc(blob, record, source)
                raw = undo_transform(blob, record.transform, source, limit=OBJECT_LIMITS.max_bytes)
                value, archive = decode_object_record(raw, source, verify_crc=self.verify_crc)
                convert = lambda ref, a=archive, s=source: _to_torch(a.tensor(ref), s)  # noqa: E731
            else:
                value = _walk(self._pickle(record, blobs, entry.key), leaf_path(record), source)
                convert = lambda ref, r=record, s=source: self._pickled_tensor(r, ref, s)  # noqa: E731
            if decode:
                value = decoded(value)
            if tensors == "torch":
                value = _materialize(value, convert)
            values.append(value)
        return values

    #: Decoded ``data.pkl`` pickles kept for later reads of other keys of the same file.
    PICKLE_CACHE = 8

    def _pickle(self, record: Record, blobs: dict[tuple[str, int, int], bytes], key: str) -> Any:
        """The whole pickle a PICKLE_LEAF / PICKLE_BYTES record points into, decoded once."""
        where = _record_range(record)
        if where in self._pickles:
            self._pickles.move_to_end(where)
            return self._pickles[where]
        blob = blobs.get(where)
        if blob is None:  # cached when the batch began, dropped since by other files
            (blob,) = self.read_ranges([where], key)
        source = self.storage.describe(record.file)
        self._check_crc(blob, record, f"{source} @{record.offset} ({key})")
        if record.encoding is Encoding.PICKLE_LEAF:
            value = safe_loads(blob, allow=self.object_globals, source=source, unknown="opaque")
        elif record.encoding is Encoding.PICKLE_BYTES:
            value = safe_loads(blob, allow=OBJECT_GLOBALS, source=source, unknown="opaque")
        else:
            raise FormatError(f"{source}: {key!r} has no object record ({record.encoding.value})")
        self._pickles[where] = value
        while len(self._pickles) > self.PICKLE_CACHE:
            self._pickles.popitem(last=False)
        return value

    def _check_crc(self, blob: bytes, record: Record, source: str) -> None:
        if self.verify_crc and record.crc32 is not None:
            check_crc(blob, record.crc32, source)

    def read_object_trusted(self, entry: Entry) -> Any:
        """UNSAFE: ``entry``'s value as torch itself loads it (``torch.load(weights_only=False)``
        or ``pickle.loads``), which runs whatever code the pickle names. Only for checkpoints
        whose origin you trust; see :meth:`ckptkit.Checkpoint.read_object`."""
        import io
        import pickle

        import torch

        record = entry.chunks[0].record if entry.kind == "object" and entry.chunks else None
        if record is None:
            raise FormatError(f"{entry.key!r} is not an object entry")
        source = f"{self.storage.describe(record.file)} @{record.offset} ({entry.key})"
        if record.encoding is Encoding.TORCH_SAVE:
            (blob,) = self.read_ranges(
                [(record.file, record.offset, record.offset + record.length)], entry.key
            )
            raw = undo_transform(blob, record.transform, source, limit=OBJECT_LIMITS.max_bytes)
            return torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")
        if record.encoding is Encoding.PICKLE_LEAF:
            whole = torch.load(
                io.BytesIO(self.storage.read_file(record.file, max_bytes=TRUSTED_FILE_LIMIT)),
                weights_only=False,
                map_location="cpu",
            )
            return _walk(whole, leaf_path(record), source)
        if record.encoding is Encoding.PICKLE_BYTES:
            (blob,) = self.read_ranges(
                [(record.file, record.offset, record.offset + record.length)], entry.key
            )
            path = leaf_path(record)
            return _walk(pickle.loads(blob), path, source)
        raise FormatError(f"{source}: no trusted loader for {record.encoding.value} records")

    def _pickled_tensor(self, record: Record, ref: TensorRef, source: str):
        """A tensor inside a pickled object, its storage read from the torch.save zip (a bare
        pickle has no storages: its tensors stay descriptions)."""
        if record.encoding is not Encoding.PICKLE_LEAF:
            return ref
        file = record.file
        if file not in self._zip_indexes:
            self._zip_indexes[file] = read_zip_indexes(self.storage, [file])[file]
        member = self._zip_indexes[file].member(f"data/{ref.storage.key}", source)
        (blob,) = self.read_ranges([(file, member.offset, member.offset + member.size)], source)
        if self.verify_crc:
            check_crc(blob, member.crc32, f"{source} storage {ref.storage.key}")
        data = TensorData(ref.dtype, ref.shape, ref.stride, ref.storage_offset, memoryview(blob))
        return _to_torch(data, source)


def _object_record(entry: Entry) -> Record:
    if entry.kind != "object" or not entry.chunks or entry.chunks[0].record is None:
        raise FormatError(f"{entry.key!r} is not an object entry")
    return entry.chunks[0].record


def _record_range(record: Record) -> tuple[str, int, int]:
    return (record.file, record.offset, record.offset + record.length)


def _distinct_chunks(entry: Entry) -> list[Chunk]:
    """Chunks with replicas (the same box saved by several ranks) dropped; checks that they
    cover the tensor exactly once (:func:`check_coverage`)."""
    chunks = distinct_chunks(entry.chunks)
    check_coverage(entry, chunks)
    return chunks


def check_coverage(entry: Entry, chunks: list[Chunk]) -> None:
    """Raise :class:`CoverageError` unless ``chunks`` (distinct boxes) tile the tensor: every
    element in exactly one chunk, none outside it (see :mod:`ckptkit.coverage`)."""
    from .coverage import check_coverage as check_tiling

    check_tiling(entry, chunks)


def _check_record_lengths(entry: Entry, chunks: list[Chunk]) -> None:
    """Refuse, before the tensor is allocated, a raw record shorter than the elements its
    chunk's strides reach: the shape would announce bytes the files do not hold."""
    itemsize = entry.dtype.itemsize
    for chunk in chunks:
        record = chunk.record
        if (
            record is None
            or record.encoding is not Encoding.RAW
            or record.transform
            or not chunk.numel
        ):
            continue  # other records are checked against what they decode to
        sizes = chunk.sizes
        stride = record.stride or _row_major(sizes)
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


def _tiles_first_dim(entry: Entry, chunks: list[Chunk]) -> bool:
    """True when chunks are whole rows (or flat ranges), so their bytes concatenate in order."""
    if all(c.flat for c in chunks):
        return True
    if any(c.flat for c in chunks):
        return False
    return all(c.sizes[1:] == entry.shape[1:] and not any(c.offsets[1:]) for c in chunks)


def _as_bytes(array: np.ndarray) -> memoryview:
    """Row-major bytes of ``array`` (copied only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _batches(chunks: list[Chunk]) -> Iterator[list[Chunk]]:
    batch: list[Chunk] = []
    size = 0
    for chunk in chunks:
        if batch and size + chunk.record.length > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += chunk.record.length
    if batch:
        yield batch


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def strided_view(data: TensorData, source: str) -> np.ndarray:
    """A read-only numpy view of the elements ``data`` describes (no copy)."""
    np_dtype = dtypes.to_numpy(data.dtype)
    itemsize = np_dtype.itemsize
    if math.prod(data.shape) == 0:
        return np.empty(data.shape, dtype=np_dtype)
    extent = (
        data.storage_offset
        + 1
        + sum((n - 1) * s for n, s in zip(data.shape, data.stride, strict=True))
    )
    available = len(data.buffer) // itemsize
    if extent > available or data.storage_offset < 0 or min(data.stride, default=0) < 0:
        raise MismatchError(
            f"{source}: tensor {list(data.shape)} with strides {list(data.stride)} needs {extent} "
            f"elements, the storage has {available}"
        )
    base = np.frombuffer(data.buffer, dtype=np_dtype, count=available)[data.storage_offset :]
    return np.lib.stride_tricks.as_strided(
        base, data.shape, tuple(s * itemsize for s in data.stride), writeable=False
    )


def _place(out: np.ndarray, chunk: Chunk, data: TensorData, entry: Entry, source: str) -> None:
    view = strided_view(data, source)
    if chunk.flat:
        if view.size != chunk.numel:
            raise MismatchError(
                f"{source}: {entry.key!r} flat chunk holds {view.size} elements, expected {chunk.numel}"
            )
        start = chunk.offsets[0]
        out.reshape(-1)[start : start + chunk.numel] = view.reshape(-1)
        return
    if view.shape != chunk.sizes:
        raise MismatchError(
            f"{source}: {entry.key!r} record holds shape {list(view.shape)}, metadata says {list(chunk.sizes)}"
        )
    out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))] = view


def _to_torch(data: TensorData, source: str):
    array = np.array(strided_view(data, source))  # copy: own, writable memory
    return _tensor_from_numpy(array, data.dtype)


def _tensor_from_numpy(array: np.ndarray, dt: dtypes.DType):
    """``array`` as a tensor of ``dt`` sharing its memory; an empty one with the strides
    torch gives empty tensors (numpy's would make ``.view(torch.uint8)`` fail)."""
    import torch

    if not array.size:
        return torch.empty(array.shape, dtype=dtypes.to_torch(dt))
    return torch.from_numpy(array).view(dtypes.to_torch(dt))


def _walk(value: Any, path: list, source: str) -> Any:
    """The item at ``path`` inside ``value``: dict keys as ``str`` (as flattening spells them),
    list and tuple indices as ``int``."""
    for part in path:
        if isinstance(value, Mapping):
            found = (
                [value[part]] if part in value else [v for k, v in value.items() if str(k) == part]
            )
        elif isinstance(value, (list, tuple)) and type(part) is int and 0 <= part < len(value):
            found = [value[part]]
        else:
            found = []
        if not found:
            raise CorruptRecordError(f"{source}: the pickle has no item {part!r} on path {path}")
        value = found[0]
    return value


def _materialize(value: Any, convert) -> Any:
    """``value`` with every tensor description replaced by ``convert(ref)``: a new value where
    anything changes (the cached pickle stays as it was); reference cycles are kept."""
    return _Materializer(convert).value(value, 0)


class _Materializer:
    """Copies every container and placeholder once (shared parts stay shared, the source is
    never changed); dicts, lists and placeholders are registered before their parts, so
    cycles through them close on the copies."""

    def __init__(self, convert) -> None:
        self.convert = convert
        self.done: dict[int, Any] = {}
        self.keep: list[Any] = []  # ids stay valid while their objects live

    def value(self, value: Any, depth: int) -> Any:
        if isinstance(value, TensorRef):
            return self.convert(value)
        if not isinstance(value, dict | list | tuple | set | frozenset | Opaque):
            return value
        key = id(value)
        if key in self.done:
            return self.done[key]
        if depth > MAX_DEPTH:
            raise PickleLimitError(f"object nested more than {MAX_DEPTH} deep")
        self.keep.append(value)
        depth += 1
        if isinstance(value, dict):
            out = self.done[key] = value.copy()
            for k, v in value.items():
                out[k] = self.value(v, depth)
        elif isinstance(value, list):
            out = self.done[key] = []
            out.extend(self.value(v, depth) for v in value)
        elif isinstance(value, Opaque):
            out = self.done[key] = Opaque.__new__(type(value))
            out.called, out.kwargs = value.called, self.value(value.kwargs, depth)
            out.args = self.value(value.args, depth)
            out.state = self.value(value.state, depth)
            out.listitems = self.value(value.listitems, depth)
            out.dictitems = [(k, self.value(v, depth)) for k, v in value.dictitems]
        else:  # tuples, sets: immutable, built from their parts
            out = type(value)(self.value(v, depth) for v in value)
            self.done[key] = out
        return out
