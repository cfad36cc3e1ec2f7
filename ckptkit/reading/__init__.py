"""Reading values out of a catalog: tensors assembled from their chunks, objects decoded safely.

Format-free: it sees only entries, chunks and records. Tensors are assembled in numpy (torch is
imported only to hand back a ``torch.Tensor``), a bounded batch of records at a time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import dtypes, tunables
from ..catalog.coverage import check_coverage as check_tiling
from ..catalog.coverage import rows_in_order
from ..catalog.model import Chunk, Encoding, Entry, Record, distinct_chunks, leaf_path
from ..decoding.known_objects import MAX_DEPTH, decoded
from ..decoding.pickle_limits import OBJECT_LIMITS
from ..decoding.record_layouts import BULK_RECORD, Layout, Layouts
from ..decoding.records import (
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
from ..decoding.unpickler import OBJECT_GLOBALS, Opaque, TensorRef, safe_loads
from ..errors import (
    CheckpointError,
    CorruptRecordError,
    FormatError,
    LimitExceededError,
    MismatchError,
    MissingFileError,
    PickleLimitError,
    TruncatedFileError,
)
from ..storage import Storage

#: ``read_object(trust=True)`` loads a whole torch.save file: bounded by its real size only.
TRUSTED_FILE_LIMIT = 1 << 62
#: Chunks fetched and decoded together at most (across small tensors, see
#: :meth:`Reader.read_ahead`): one batch of reads for many tensors, bounded Python lists.
BATCH_CHUNKS = 8192
#: Tensors up to this size are read many at a time once their order is announced
#: (:meth:`Reader.read_ahead`), up to this many record bytes per batch (so a batch, its
#: records and the tensors assembled from them stay well under the 64 MiB of headroom).
SMALL_TENSOR = 1 << 20
AHEAD_BYTES = 16 << 20


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
        self._sources: dict[str, str] = {}  # file → storage.describe(file), for messages
        self._layouts = Layouts()
        self._ahead: list[Entry] = []  # small tensors in the order they will be asked for
        # read ahead, not asked for yet: key → (entry, its bytes)
        self._ready: dict[str, tuple[Entry, memoryview]] = {}
        self.read_ahead([])

    def fresh(self) -> Reader:
        """A reader of the same location with empty caches, for another thread."""
        return Reader(self.storage, self.object_globals, verify_crc=self.verify_crc)

    # -- tensors ---------------------------------------------------------------------------

    def read_array(self, entry: Entry) -> np.ndarray:
        """The whole tensor as a numpy array (bfloat16/fp8 as same-sized unsigned ints)."""
        if entry.kind != "tensor" or entry.dtype is None or entry.shape is None:
            raise FormatError(f"{entry.key!r} is not a tensor")
        return self._assemble(entry, _distinct_chunks(entry))

    def _assemble(self, entry: Entry, chunks: list[Chunk]) -> np.ndarray:
        """``entry`` assembled from its distinct ``chunks`` (coverage already checked), a
        bounded batch of records at a time."""
        _check_record_lengths(entry, chunks)
        out = _allocate(entry)
        for batch in _batches([c for c in chunks if c.record is not None]):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                _place(out, chunk, data, entry, self._source(chunk.record.file))
            data = None  # release this batch's records before the next batch is read
        return out

    def read_ahead(self, entries: Sequence[Entry]) -> None:
        """Announce the order in which :meth:`iter_bytes` will be asked for tensors: the small
        ones (up to :data:`SMALL_TENSOR`) are then fetched and decoded many at a time, one
        batch of reads per :data:`AHEAD_BYTES` / :data:`BATCH_CHUNKS`, instead of a round per
        tensor. Asking in another order still works, only slower."""
        self._ahead = [
            e
            for e in entries
            if e.kind == "tensor"
            and e.dtype is not None
            and e.shape is not None
            and e.nbytes <= SMALL_TENSOR
        ]
        self._ahead_at = {e.key: i for i, e in enumerate(self._ahead)}
        self._taken: set[str] = set()  # announced tensors already read in a batch
        self._alone: set[str] = set()  # announced tensors whose batch failed: read alone
        self._ready = {}

    def iter_bytes(self, entry: Entry) -> Iterator[memoryview]:
        """The tensor's row-major bytes, in pieces: chunk by chunk when they tile the first
        dimension (or a flat range), else :data:`~ckptkit.tunables.ROW_BLOCK_BYTES` of rows at a time (column or
        block shards: bounded memory, one copy). Each piece is its own memory (consumers may
        keep it, or hand it to another thread)."""
        for piece, _ in self.iter_checked(entry):
            yield piece
            del piece  # not held while the next batch is read

    def iter_checked(self, entry: Entry) -> Iterator[tuple[memoryview, int | None]]:
        """:meth:`iter_bytes` with each piece's CRC-32 where it is a whole storage whose CRC
        was just checked against the file's (else None), so a zip writer need not compute it
        again."""
        ready = self._take_ahead(entry)
        if ready is not None:
            yield ready, None
            return
        chunks = _distinct_chunks(entry)
        if not _tiles_first_dim(entry, chunks):
            for block in self._row_blocks(entry, chunks):
                yield block, None
            return
        ordered = sorted((c for c in chunks if c.record is not None), key=_leading_offset)
        for batch in _batches(ordered):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                piece = _chunk_bytes(chunk, data, entry, self._source(chunk.record.file))
                yield piece, data.crc32 if _is_whole_storage(piece, data) else None
            data = piece = None  # release this batch before the next one is read

    def _row_blocks(self, entry: Entry, chunks: list[Chunk]) -> Iterator[memoryview]:
        """The rows of a tensor whose chunks cut more than its first dimension, assembled
        :data:`~ckptkit.tunables.ROW_BLOCK_BYTES` at a time with ``np.copyto``: a chunk's record is fetched for
        the first block that needs it (with the others that block needs, in one batch of
        reads) and dropped after its last row, so only the chunks crossing the current rows
        are held (for column shards: all of them, about the tensor's size)."""
        shape = entry.shape
        if entry.nbytes <= tunables.ROW_BLOCK_BYTES or len(shape) < 2:
            yield _as_bytes(self._assemble(entry, chunks))
            return
        _check_record_lengths(entry, chunks)
        np_dtype = dtypes.to_numpy(entry.dtype)
        step = max(1, tunables.ROW_BLOCK_BYTES // (math.prod(shape[1:]) * np_dtype.itemsize))
        pending = sorted((c for c in chunks if c.record is not None), key=_leading_offset)
        active: list[tuple[Chunk, np.ndarray]] = []
        taken = 0
        for r0 in range(0, shape[0], step):
            r1 = min(shape[0], r0 + step)
            active = [(c, v) for c, v in active if c.offsets[0] + c.sizes[0] > r0]
            first = taken
            while taken < len(pending) and pending[taken].offsets[0] < r1:
                taken += 1
            for batch in _batches(pending[first:taken]):
                for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                    source = self._source(chunk.record.file)
                    active.append((chunk, _chunk_view(chunk, data, entry, source)))
                data = None
            # a fresh block each time: the allocator hands back the last one's memory
            # (measured as fast as reusing one buffer), and no consumer sees it change
            block = np.empty((r1 - r0, *shape[1:]), np_dtype)
            for chunk, view in active:
                top = chunk.offsets[0]
                a, b = max(r0, top), min(r1, top + chunk.sizes[0])
                if a < b:
                    columns = (
                        slice(o, o + n)
                        for o, n in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True)
                    )
                    np.copyto(block[(slice(a - r0, b - r0), *columns)], view[a - top : b - top])
            yield _as_bytes(block)
            block = None

    def _take_ahead(self, entry: Entry) -> memoryview | None:
        """``entry``'s bytes from the read-ahead batch (see :meth:`read_ahead`), reading a
        batch that starts with it when needed (the announced tensors after it not read yet);
        None when it was not announced, or when its batch failed (then each tensor of that
        batch is read alone, so an error names its own tensor)."""
        ready = self._ready.pop(entry.key, None)
        if ready is not None and ready[0] is entry:
            return ready[1]
        at = self._ahead_at.get(entry.key)
        if at is None or self._ahead[at] is not entry or entry.key in self._alone:
            return None
        if sum(len(piece) for _, piece in self._ready.values()) > AHEAD_BYTES:
            # asked for far out of order: those are read again when asked for
            self._taken.difference_update(self._ready)
            self._ready = {}
        batch = [entry]
        size = count = 0
        for candidate in self._ahead[at + 1 : at + BATCH_CHUNKS]:
            if candidate.key in self._ready or candidate.key in self._taken:
                continue
            held = [c.record.length for c in candidate.chunks if c.record is not None]
            if size + sum(held) > AHEAD_BYTES or count + len(held) > BATCH_CHUNKS:
                break
            batch.append(candidate)
            size += sum(held) + candidate.nbytes
            count += len(held)
        try:
            with _collector_paused():
                self._ready.update(self._assemble_many(batch))
        except CheckpointError:
            self._alone.update(e.key for e in batch)
            return None
        self._taken.update(e.key for e in batch)
        return self._ready.pop(entry.key)[1]

    def _assemble_many(self, entries: list[Entry]) -> dict[str, tuple[Entry, memoryview]]:
        """Small tensors' row-major bytes by key, their records fetched in one batch of reads
        and decoded together; whole rows (the common case) joined without numpy."""
        items: list[tuple[Entry, Chunk]] = []
        spans = []
        for entry in entries:
            chunks = distinct_chunks(entry.chunks)
            in_rows = rows_in_order(entry.shape, chunks)  # the common case, checked in one pass
            if not in_rows:
                check_coverage(entry, chunks)
                in_rows = _tiles_first_dim(entry, chunks)
                chunks = sorted(chunks, key=_leading_offset) if in_rows else chunks
            _check_record_lengths(entry, chunks)
            start = len(items)
            items += [(entry, c) for c in chunks if c.record is not None]
            spans.append((entry, start, len(items), in_rows))
        decoded_chunks = self._decode(items)
        out = {}
        for entry, start, end, in_rows in spans:
            pairs = zip(items[start:end], decoded_chunks[start:end], strict=True)
            if in_rows:
                pieces = [
                    _chunk_bytes(chunk, data, entry, self._source(chunk.record.file))
                    for (_, chunk), data in pairs
                ]
                joined = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
                out[entry.key] = (entry, joined)
                continue
            array = _allocate(entry)
            for (_, chunk), data in pairs:
                _place(array, chunk, data, entry, self._source(chunk.record.file))
            out[entry.key] = (entry, _as_bytes(array))
        return out

    def read_chunk(self, entry: Entry, chunk: Chunk) -> memoryview:
        """One stored chunk's elements as row-major bytes."""
        (data,) = self.decode_chunks(entry, [chunk])
        view = strided_view(data, self._source(chunk.record.file))
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
        (:data:`~ckptkit.tunables.BATCH_BYTES`); the caller checks shapes against ``chunk.sizes``."""
        return self._decode([(entry, chunk) for chunk in chunks])

    def _decode(self, items: list[tuple[Entry, Chunk]]) -> list[TensorData]:
        """:meth:`decode_chunks` for chunks of any tensors: ``(entry, chunk)`` pairs. A
        torch.save record laid out like one decoded before (same length, same bytes outside
        its storage and bookkeeping members: :class:`~ckptkit.record_layouts.Layout`) is decoded without parsing."""
        if not items:
            return []
        records = [chunk.record for _, chunk in items]
        self._load_safetensors_headers([r for r in records if r.encoding is Encoding.SAFETENSORS])
        ranges = [
            (r.file, r.offset, r.offset + r.length)
            if r.encoding is not Encoding.SAFETENSORS
            else self._byte_range(r)
            for r in records
        ]
        blobs = self._fetch(ranges, items)
        verify = self.verify_crc
        layouts = self._layouts
        out = []
        bulk = self._decode_by_layout(items, blobs)
        for (entry, chunk), (_, start, _), blob, known in zip(
            items, ranges, blobs, bulk, strict=True
        ):
            if known is not None:
                out.append(known)
                continue
            record = chunk.record
            if verify and record.crc32 is not None and zlib.crc32(blob) != record.crc32:
                check_crc(blob, record.crc32, self._where(record, start, entry))
            if record.encoding is Encoding.TORCH_SAVE:
                layout = None if record.transform else layouts.find(blob)
                if layout is None:
                    data = self._decode_archive(entry, chunk, blob, start)
                else:
                    data = layout.tensor(blob)
                    if verify:
                        stored = layout.stored_crc(blob)
                        if zlib.crc32(data.buffer) != stored:
                            where = f"{self._where(record, start, entry)} member {layout.storage_name!r}"
                            check_crc(data.buffer, stored, where)
                        data = layout.tensor(blob, stored)
            elif record.encoding is Encoding.SAFETENSORS:
                dt, shape, _, _ = self._safetensors_entry(record)
                data = TensorData(dt, shape, _row_major(shape), 0, memoryview(blob))
            else:
                shape = chunk.sizes
                stride = record.stride or _row_major(shape)
                data = TensorData(
                    entry.dtype, shape, stride, record.storage_offset, memoryview(blob)
                )
            if data.dtype is not entry.dtype and data.dtype != entry.dtype:
                raise MismatchError(
                    f"{self._where(record, start, entry)}: record holds {data.dtype.name}, "
                    f"metadata says {entry.dtype.name}"
                )
            out.append(data)
        return out

    def _fetch(
        self, ranges: list[tuple[str, int, int]], items: list[tuple[Entry, Chunk]]
    ) -> list[bytes | memoryview]:
        """The bytes of each range (``items[i]``'s record), adjacent or overlapping ranges of a
        file read as one (worked out in numpy: a batch has thousands), so the storage sorts
        and checks a few ranges, not one per chunk. On any failure the ranges are read one by
        one, so the error names the right key."""
        keys = [entry.key for entry, _ in items] if len(items) > 1 else items[0][0].key
        if len(ranges) < _COALESCE_MIN:
            return self.read_ranges(ranges, keys)
        try:
            merged, pieces = _coalesced(ranges)
            blobs = [memoryview(blob) for blob in self.storage.read_ranges(merged)]
        except (CheckpointError, OverflowError, ValueError):
            return self.read_ranges(ranges, keys)
        out = [blobs[group][a:b] for group, a, b in pieces]
        if any(
            len(piece) != end - start for piece, (_, start, end) in zip(out, ranges, strict=True)
        ):
            return self.read_ranges(ranges, keys)  # a file ends early: raise as one by one
        return out

    def _decode_by_layout(
        self, items: list[tuple[Entry, Chunk]], blobs: list[bytes]
    ) -> list[TensorData | None]:
        """Small torch.save records of known layouts (:class:`~ckptkit.record_layouts.Layout`) decoded many at a
        time: those of one length compared with a layout's fixed bytes in numpy, their
        storages viewed in place. None where a record goes the one-by-one way (no layout of
        its length, other bytes, a CRC-32 or dtype that does not match: that way raises)."""
        found: list[TensorData | None] = [None] * len(items)
        known = self._layouts.by_length
        groups: dict[int, list[int]] = {}
        for i, ((_, chunk), blob) in enumerate(zip(items, blobs, strict=True)):
            record = chunk.record
            if (
                len(blob) in known
                and len(blob) <= BULK_RECORD
                and record.encoding is Encoding.TORCH_SAVE
                and not record.transform
                and record.crc32 is None
            ):
                groups.setdefault(len(blob), []).append(i)
        for length, indices in groups.items():
            if len(indices) < 2:
                continue
            joined = b"".join([blobs[i] for i in indices])
            rows = np.frombuffer(joined, np.uint8).reshape(len(indices), length)
            left = np.arange(len(indices))
            for layout in known[length]:
                matched = layout.matching_rows(rows[left])
                hits = left[matched].tolist()
                bases = [j * length for j in hits]
                self._fill(found, items, [indices[j] for j in hits], joined, bases, layout)
                left = left[~matched]
                if not len(left):
                    break
        return found

    def _fill(
        self,
        found: list[TensorData | None],
        items: list[tuple[Entry, Chunk]],
        indices: list[int],
        joined: bytes,
        bases: list[int],
        layout: Layout,
    ) -> None:
        """``found[i]`` for each record ``items[i]`` that ``layout`` matched, lying at
        ``bases`` in ``joined``; left None when its CRC-32 or dtype disagrees."""
        ref = layout.ref
        dtype, shape, stride, offset = ref.dtype, ref.shape, ref.stride, ref.storage_offset
        start, end = layout.storage
        view = memoryview(joined)
        verify = self.verify_crc
        crc = None
        for i, base in zip(indices, bases, strict=True):
            data = view[base + start : base + end]
            if verify:
                crc = zlib.crc32(data)
                if crc != layout.stored_crc(joined, base):
                    continue
            entry_dtype = items[i][0].dtype
            if dtype is not entry_dtype and dtype != entry_dtype:
                continue
            found[i] = TensorData(dtype, shape, stride, offset, data, crc)

    def _decode_archive(self, entry: Entry, chunk: Chunk, blob: bytes, start: int) -> TensorData:
        """A torch.save record parsed and its pickle decoded (its layout remembered when
        records of its length come again)."""
        record = chunk.record
        source = self._where(record, start, entry)
        raw = undo_transform(
            blob,
            record.transform,
            source,
            limit=tensor_archive_limit(chunk.numel * entry.dtype.itemsize),
        )
        data = decode_tensor_record(raw, source, verify_crc=self.verify_crc)
        if not record.transform:
            self._layouts.learn(raw, source)
        return data

    def _source(self, file: str) -> str:
        """``storage.describe(file)``, kept: messages name it for every chunk."""
        found = self._sources.get(file)
        if found is None:
            found = self._sources[file] = self.storage.describe(file)
        return found

    def _where(self, record: Record, start: int, entry: Entry) -> str:
        return f"{self._source(record.file)} @{start} ({entry.key})"

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

    def read_ranges(
        self, ranges: list[tuple[str, int, int]], key: str | Sequence[str]
    ) -> list[bytes]:
        """``storage.read_ranges`` naming ``key`` in errors (one key per range, or one for
        all); a range past the end of its file raises :class:`TruncatedFileError` with the
        file's size."""
        keys = [key] * len(ranges) if isinstance(key, str) else key
        try:
            return self.storage.read_ranges(ranges)
        except TruncatedFileError:
            raise
        except MissingFileError as exc:
            missing = next(
                (k for (f, _, _), k in zip(ranges, keys, strict=True) if f in str(exc)), keys[0]
            )
            raise MissingFileError(f"{exc} (needed for {missing!r})") from exc
        except CorruptRecordError as exc:
            sizes = self.storage.sizes(sorted({file for file, _, _ in ranges}))
            for (file, start, end), needed in zip(ranges, keys, strict=True):
                size = sizes.get(file)
                if size is not None and end > size:
                    raise TruncatedFileError(
                        f"{self.storage.describe(file)}: truncated: {needed!r} needs bytes "
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
        ``tensors="ref"`` leaves them as descriptions and ``tensors="data"`` loads them as
        :class:`~ckptkit.records.TensorData` (bytes, dtype, layout), both without torch.
        ``decode`` turns placeholders of known benign classes into real values and marks cycles
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
                load = lambda ref, a=archive: a.tensor(ref)  # noqa: E731
            else:
                value = _walk(self._pickle(record, blobs, entry.key), leaf_path(record), source)
                load = lambda ref, r=record, s=source: self._pickled_tensor(r, ref, s)  # noqa: E731
            if decode:
                value = decoded(value)
            if tensors == "torch":
                value = _materialize(value, lambda ref, f=load, s=source: _to_torch(f(ref), s))
            elif tensors == "data":
                value = _materialize(value, load)
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
        return TensorData(ref.dtype, ref.shape, ref.stride, ref.storage_offset, memoryview(blob))


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
    flat = [c.flat for c in chunks]
    if all(flat):
        return True
    if any(flat):
        return False
    rest = entry.shape[1:]
    zeros = (0,) * len(rest)
    return all(c.sizes[1:] == rest and c.offsets[1:] == zeros for c in chunks)


def _as_bytes(array: np.ndarray) -> memoryview:
    """Row-major bytes of ``array`` (copied only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _batches(chunks: list[Chunk]) -> Iterator[list[Chunk]]:
    batch: list[Chunk] = []
    size = 0
    for chunk in chunks:
        if batch and size + chunk.record.length > tunables.BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += chunk.record.length
    if batch:
        yield batch


@functools.lru_cache(maxsize=4096)
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
    shape, stride = data.shape, data.stride
    numel = math.prod(shape)
    if numel == 0:
        return np.empty(shape, dtype=np_dtype)
    extent = data.storage_offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    available = len(data.buffer) // itemsize
    if extent > available or data.storage_offset < 0 or min(stride, default=0) < 0:
        raise MismatchError(
            f"{source}: tensor {list(shape)} with strides {list(stride)} needs {extent} "
            f"elements, the storage has {available}"
        )
    if stride == _row_major(shape):  # contiguous: a plain view, much cheaper to make
        view = np.frombuffer(
            data.buffer, np_dtype, count=numel, offset=data.storage_offset * itemsize
        ).reshape(shape)
        view.flags.writeable = False
        return view
    base = np.frombuffer(data.buffer, dtype=np_dtype, count=available)[data.storage_offset :]
    return np.lib.stride_tricks.as_strided(
        base, shape, tuple(s * itemsize for s in stride), writeable=False
    )


def _place(out: np.ndarray, chunk: Chunk, data: TensorData, entry: Entry, source: str) -> None:
    view = _chunk_view(chunk, data, entry, source)
    if chunk.flat:
        start = chunk.offsets[0]
        out.reshape(-1)[start : start + chunk.numel] = view
        return
    out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))] = view


def _is_whole_storage(piece: memoryview, data: TensorData) -> bool:
    """Whether ``piece`` (from :func:`_chunk_bytes`) is byte for byte all of ``data``'s
    checked storage: row-major from its first element to its last."""
    return (
        data.crc32 is not None
        and data.storage_offset == 0
        and data.stride == _row_major(data.shape)
        and piece.nbytes == data.buffer.nbytes
    )


def _chunk_bytes(chunk: Chunk, data: TensorData, entry: Entry, source: str) -> memoryview:
    """The chunk's elements as row-major bytes: a slice of the record when they lie there
    contiguously (no numpy, no copy), else through :func:`_chunk_view`."""
    shape = data.shape
    numel = math.prod(shape)
    if data.stride == _row_major(shape) and (
        shape == chunk.sizes if not chunk.flat else numel == chunk.numel
    ):
        itemsize = data.dtype.itemsize
        start = data.storage_offset * itemsize
        end = start + numel * itemsize
        buffer = data.buffer if data.buffer.format == "B" else data.buffer.cast("B")
        if start >= 0 and end <= len(buffer):
            return buffer[start:end]
    return _as_bytes(_chunk_view(chunk, data, entry, source))


def _chunk_view(chunk: Chunk, data: TensorData, entry: Entry, source: str) -> np.ndarray:
    """The chunk's elements viewed in its box's shape (a flat chunk: 1-D); a record holding
    another shape raises :class:`MismatchError`."""
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


#: Batches of at least this many ranges are coalesced before they reach the storage.
_COALESCE_MIN = 16


def _coalesced(
    ranges: list[tuple[str, int, int]],
) -> tuple[list[tuple[str, int, int]], list[tuple[int, int, int]]]:
    """``ranges`` merged where they touch or overlap within a file, and for each range
    ``(merged index, start, end)`` inside its merged one. Vectorised; offsets past int64
    raise OverflowError (the caller then reads the ranges as they are)."""
    n = len(ranges)
    names: dict[str, int] = {}
    codes = np.fromiter((names.setdefault(f, len(names)) for f, _, _ in ranges), np.int64, n)
    starts = np.fromiter((s for _, s, _ in ranges), np.int64, n)
    ends = np.fromiter((e for _, _, e in ranges), np.int64, n)
    order = np.lexsort((starts, codes))
    s, e, c = starts[order], ends[order], codes[order]
    other_file = c[1:] != c[:-1]
    reach = np.empty_like(e)  # the furthest end so far within each file
    bounds = [0, *(np.flatnonzero(other_file) + 1).tolist(), n]
    for a, b in itertools.pairwise(bounds):
        reach[a:b] = np.maximum.accumulate(e[a:b])
    new = np.ones(n, dtype=bool)
    new[1:] = other_file | (s[1:] > reach[:-1])  # a gap: another range begins
    heads = np.flatnonzero(new)
    group = np.empty(n, dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    first = np.empty(n, dtype=np.int64)
    first[order] = s[heads][np.cumsum(new) - 1]
    files = list(names)
    merged = [
        (files[code], start, end)
        for code, start, end in zip(
            c[heads].tolist(),
            s[heads].tolist(),
            np.maximum.reduceat(e, heads).tolist(),
            strict=True,
        )
    ]
    inner_start = (starts - first).tolist()
    inner_end = (ends - first).tolist()
    return merged, list(zip(group.tolist(), inner_start, inner_end, strict=True))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a batch of small tensors is decoded: the
    batch makes thousands of small acyclic objects (freed by reference counting), and every
    collection they would trigger walks the whole catalog (measured: 40% of the per-chunk
    cost at 100k chunks). Another thread's pause is left as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _allocate(entry: Entry) -> np.ndarray:
    """An uninitialised array for the whole tensor; a shape too large to allocate (it comes
    from the checkpoint) is a :class:`LimitExceededError`."""
    try:
        return np.empty(entry.shape, dtype=dtypes.to_numpy(entry.dtype))
    except (MemoryError, ValueError) as exc:
        raise LimitExceededError(
            f"{entry.key!r}: {entry.nbytes} bytes of {entry.dtype.name}{list(entry.shape)} "
            f"cannot be allocated ({type(exc).__name__})"
        ) from exc


def _leading_offset(chunk: Chunk) -> tuple[int, ...]:
    """Sort key: the chunk's first offset (empty for a 0-d tensor's one chunk)."""
    return chunk.offsets[:1]


def _to_torch(data: TensorData | TensorRef, source: str):
    if isinstance(data, TensorRef):  # a bare pickle's tensor: no storage to read
        return data
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
