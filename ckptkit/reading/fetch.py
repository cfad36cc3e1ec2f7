"""Records fetched and decoded: byte ranges read in batches (adjacent ones coalesced), CRC-32s
checked, and what a tensor chunk's record stores decoded by its encoding — torch.save records
of a layout seen before without parsing, safetensors through their cached headers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from .. import tunables
from ..catalog.model import Chunk, Encoding, Entry, Record
from ..crc32 import crc32
from ..decoding.pickle_limits import OBJECT_LIMITS
from ..decoding.record_layouts import BULK_RECORD, Layout, Layouts
from ..decoding.records import (
    SafetensorsHeader,
    TensorData,
    TorchArchive,
    check_crc,
    decode_tensor_record,
    read_safetensors_headers,
    tensor_archive_limit,
    undo_transform,
)
from ..errors import (
    CheckpointError,
    CorruptRecordError,
    FormatError,
    MismatchError,
    MissingFileError,
    TruncatedFileError,
)
from ..storage import Store
from ..storage.local import ReadBuffers
from .geometry import row_major

__all__ = ["RecordFetcher", "batches"]

#: Batches of at least this many ranges are coalesced before they reach the storage.
_COALESCE_MIN = 16


class RecordFetcher:
    """Fetches the records of one checkpoint location and decodes what tensor chunks store."""

    def __init__(self, storage: Store, *, verify_crc: bool = True) -> None:
        self.storage = storage
        #: Check what is read against the CRC-32 the format stores (torch.save zip members).
        self.verify_crc = verify_crc
        self._safetensors_headers: dict[tuple[str, int], SafetensorsHeader] = {}
        self._sources: dict[str, str] = {}  # file → storage.describe(file), for messages
        self._layouts = Layouts()
        #: This reader's reused buffers: large local reads land in them (see
        #: :class:`~ckptkit.storage.local.ReadBuffers` for how long a view keeps one leased).
        self.buffers = ReadBuffers()

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
        its storage and bookkeeping members: :class:`~ckptkit.decoding.record_layouts.Layout`) is decoded without parsing."""
        if not items:
            return []
        ranges = self._ranges([chunk.record for _, chunk in items])
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
            if verify and record.crc32 is not None and crc32(blob) != record.crc32:
                check_crc(blob, record.crc32, self._where(record, start, entry))
            if record.encoding is Encoding.TORCH_SAVE:
                layout = None if record.transform else layouts.find(blob)
                if layout is None:
                    data = self._decode_archive(entry, chunk, blob, start)
                else:
                    data = layout.tensor(blob)
                    if verify:
                        stored = layout.stored_crc(blob)
                        if crc32(data.buffer) != stored:
                            where = f"{self._where(record, start, entry)} member {layout.storage_name!r}"
                            check_crc(data.buffer, stored, where)
                        data = layout.tensor(blob, stored)
            elif record.encoding is Encoding.SAFETENSORS:
                dt, shape, _, _ = self._safetensors_entry(record)
                data = TensorData(dt, shape, row_major(shape), 0, memoryview(blob))
            else:
                shape = chunk.sizes
                stride = record.stride or row_major(shape)
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

    def _ranges(self, records: list[Record]) -> list[tuple[str, int, int]]:
        """The byte range each record's tensor lies in: the record itself, or inside a
        safetensors blob (its header read first, once)."""
        in_safetensors = [r for r in records if r.encoding is Encoding.SAFETENSORS]
        if not in_safetensors:  # the common case
            return [(r.file, r.offset, r.offset + r.length) for r in records]
        self._load_safetensors_headers(in_safetensors)
        return [
            (r.file, r.offset, r.offset + r.length)
            if r.encoding is not Encoding.SAFETENSORS
            else self._byte_range(r)
            for r in records
        ]

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
            with self.buffers.reading():
                blobs = [memoryview(blob) for blob in self.storage.read_ranges(merged)]
        except (CheckpointError, OverflowError, ValueError):
            return self.read_ranges(ranges, keys)
        out = [blobs[group][a:b] for group, a, b in pieces]
        # every merged range read whole: every piece is whole (else look at each piece)
        if any(
            len(blob) != end - start for blob, (_, start, end) in zip(blobs, merged, strict=True)
        ) and any(
            len(piece) != end - start for piece, (_, start, end) in zip(out, ranges, strict=True)
        ):
            return self.read_ranges(ranges, keys)  # a file ends early: raise as one by one
        return out

    def _decode_by_layout(
        self, items: list[tuple[Entry, Chunk]], blobs: list[bytes]
    ) -> list[TensorData | None]:
        """Small torch.save records of known layouts (:class:`~ckptkit.decoding.record_layouts.Layout`) decoded many at a
        time: those of one length compared with a layout's fixed bytes in numpy, their
        storages viewed in place. None where a record goes the one-by-one way (no layout of
        its length, other bytes, a CRC-32 or dtype that does not match: that way raises)."""
        found: list[TensorData | None] = [None] * len(items)
        known = self._layouts.by_length
        groups: dict[int, list[int]] = {}
        torch_save = Encoding.TORCH_SAVE
        for i, ((_, chunk), blob) in enumerate(zip(items, blobs, strict=True)):
            length = len(blob)
            if length in known and length <= BULK_RECORD:
                record = chunk.record
                if record.encoding is torch_save and not record.transform and record.crc32 is None:
                    groups.setdefault(length, []).append(i)
        for length, indices in groups.items():
            if len(indices) < 2:
                continue
            joined = b"".join([blobs[i] for i in indices])
            rows = np.frombuffer(joined, np.uint8).reshape(len(indices), length)
            left = np.arange(len(indices))
            for layout in known[length]:
                matched = layout.matching_rows(rows[left])
                hit_rows = left[matched]
                hits = hit_rows.tolist()
                bases = [j * length for j in hits]
                at = layout.crc_at  # the CRC-32s the records store, read in one go
                stored = np.ascontiguousarray(rows[hit_rows, at : at + 4]).view("<u4").ravel()
                self._fill(
                    found, items, [indices[j] for j in hits], joined, bases, layout, stored.tolist()
                )
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
        stored: list[int],
    ) -> None:
        """``found[i]`` for each record ``items[i]`` that ``layout`` matched, lying at
        ``bases`` in ``joined`` and storing the CRC-32s ``stored``; left None when its
        CRC-32 or dtype disagrees."""
        ref = layout.ref
        dtype, shape, stride, offset = ref.dtype, ref.shape, ref.stride, ref.storage_offset
        start, end = layout.storage
        view = memoryview(joined)
        verify = self.verify_crc
        crc = None
        for i, base, stored_crc in zip(indices, bases, stored, strict=True):
            data = view[base + start : base + end]
            if verify:
                crc = crc32(data)
                if crc != stored_crc:
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
            with self.buffers.reading():
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

    # -- the safetensors header cache ------------------------------------------------------

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


def batches(chunks: list[Chunk]) -> Iterator[list[Chunk]]:
    """``chunks`` in order, cut into batches of at most :data:`~ckptkit.tunables.BATCH_BYTES`
    of records (a larger record alone), to be fetched and decoded one batch at a time."""
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
