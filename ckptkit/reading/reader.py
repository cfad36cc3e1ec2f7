""":class:`Reader`, the front of :mod:`ckptkit.reading`: tensors assembled from their chunks
(whole, or streamed as row-major pieces in bounded memory), small tensors read ahead many at a
time, and objects (:class:`~ckptkit.reading.objects.ObjectReader`), over the record fetching
and decoding of :class:`~ckptkit.reading.fetch.RecordFetcher`."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .. import dtypes, tunables
from ..catalog.coverage import rows_in_order
from ..catalog.model import Chunk, Entry, distinct_chunks
from ..decoding.unpickler import paused_gc
from ..errors import CheckpointError, FormatError, MismatchError
from ..storage import Store
from . import trusted
from .fetch import batches
from .geometry import (
    allocate,
    as_bytes,
    check_coverage,
    check_record_lengths,
    chunk_bytes,
    chunk_view,
    covering_chunks,
    is_whole_storage,
    leading_offset,
    place,
    strided_view,
    tensor_from_numpy,
    tiles_first_dim,
)
from .objects import ObjectReader

__all__ = ["AHEAD_BYTES", "BATCH_CHUNKS", "SMALL_TENSOR", "Reader"]

#: Chunks fetched and decoded together at most (across small tensors, see
#: :meth:`Reader.read_ahead`): one batch of reads for many tensors, bounded Python lists.
BATCH_CHUNKS = 8192
#: Tensors up to this size are read many at a time once their order is announced
#: (:meth:`Reader.read_ahead`), up to this many record bytes per batch (so a batch, its
#: records and the tensors assembled from them stay well under the 64 MiB of headroom).
SMALL_TENSOR = 1 << 20
AHEAD_BYTES = 16 << 20


class Reader(ObjectReader):
    """Fetches and decodes records of one checkpoint location."""

    def __init__(
        self,
        storage: Store,
        object_globals: Mapping[str, Any] | None = None,
        *,
        verify_crc: bool = True,
    ) -> None:
        super().__init__(storage, object_globals, verify_crc=verify_crc)
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
        return self._assemble(entry, covering_chunks(entry))

    def _assemble(self, entry: Entry, chunks: list[Chunk]) -> np.ndarray:
        """``entry`` assembled from its distinct ``chunks`` (coverage already checked), a
        bounded batch of records at a time."""
        check_record_lengths(entry, chunks)
        out = allocate(entry)
        for batch in batches([c for c in chunks if c.record is not None]):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                place(out, chunk, data, entry, self._source(chunk.record.file))
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
        chunks = covering_chunks(entry)
        if not tiles_first_dim(entry, chunks):
            for block in self._row_blocks(entry, chunks):
                yield block, None
                del block  # let go of it before the next block is leased
            return
        ordered = sorted((c for c in chunks if c.record is not None), key=leading_offset)
        for batch in batches(ordered):
            for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                piece = chunk_bytes(chunk, data, entry, self._source(chunk.record.file))
                yield piece, data.crc32 if is_whole_storage(piece, data) else None
            data = piece = None  # release this batch before the next one is read

    def _row_blocks(self, entry: Entry, chunks: list[Chunk]) -> Iterator[memoryview]:
        """The rows of a tensor whose chunks cut more than its first dimension, assembled
        :data:`~ckptkit.tunables.ROW_BLOCK_BYTES` at a time with ``np.copyto``: a chunk's record is fetched for
        the first block that needs it (with the others that block needs, in one batch of
        reads) and dropped after its last row, so only the chunks crossing the current rows
        are held (for column shards: all of them, about the tensor's size)."""
        shape = entry.shape
        if entry.nbytes <= tunables.ROW_BLOCK_BYTES or len(shape) < 2:
            yield as_bytes(self._assemble(entry, chunks))
            return
        check_record_lengths(entry, chunks)
        np_dtype = dtypes.to_numpy(entry.dtype)
        step = max(1, tunables.ROW_BLOCK_BYTES // (math.prod(shape[1:]) * np_dtype.itemsize))
        pending = sorted((c for c in chunks if c.record is not None), key=leading_offset)
        active: list[tuple[Chunk, np.ndarray]] = []
        taken = 0
        for r0 in range(0, shape[0], step):
            r1 = min(shape[0], r0 + step)
            active = [(c, v) for c, v in active if c.offsets[0] + c.sizes[0] > r0]
            first = taken
            while taken < len(pending) and pending[taken].offsets[0] < r1:
                taken += 1
            for batch in batches(pending[first:taken]):
                for chunk, data in zip(batch, self.decode_chunks(entry, batch), strict=True):
                    source = self._source(chunk.record.file)
                    active.append((chunk, chunk_view(chunk, data, entry, source)))
                data = None
            # a block of this reader's reused buffers: the one the last block used once its
            # consumer let go of it, so no consumer sees its bytes change
            block = self._block((r1 - r0, *shape[1:]), np_dtype)
            for chunk, view in active:
                top = chunk.offsets[0]
                a, b = max(r0, top), min(r1, top + chunk.sizes[0])
                if a < b:
                    columns = (
                        slice(o, o + n)
                        for o, n in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True)
                    )
                    np.copyto(block[(slice(a - r0, b - r0), *columns)], view[a - top : b - top])
            yield as_bytes(block)
            block = None

    def _block(self, shape: tuple[int, ...], np_dtype: np.dtype) -> np.ndarray:
        """An uninitialised row block of ``shape`` in a buffer leased from :attr:`buffers`."""
        nbytes = math.prod(shape) * np_dtype.itemsize
        if not nbytes:
            return np.empty(shape, np_dtype)
        return np.frombuffer(self.buffers.lease(nbytes), np_dtype).reshape(shape)

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
        ready, taken = self._ready, self._taken
        for candidate in self._ahead[at + 1 : at + BATCH_CHUNKS]:
            key = candidate.key
            if key in ready or key in taken:
                continue
            held = held_count = 0
            for chunk in candidate.chunks:
                record = chunk.record
                if record is not None:
                    held += record.length
                    held_count += 1
            if size + held > AHEAD_BYTES or count + held_count > BATCH_CHUNKS:
                break
            batch.append(candidate)
            size += held + candidate.nbytes
            count += held_count
        try:
            # the cyclic GC paused: a batch makes thousands of small acyclic objects (freed by
            # reference counting), and every collection they would trigger walks the whole
            # catalog (measured: 40% of the per-chunk cost at 100k chunks)
            with paused_gc():
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
                in_rows = tiles_first_dim(entry, chunks)
                chunks = sorted(chunks, key=leading_offset) if in_rows else chunks
            check_record_lengths(entry, chunks)
            start = len(items)
            items += [(entry, c) for c in chunks if c.record is not None]
            spans.append((entry, start, len(items), in_rows))
        decoded_chunks = self._decode(items)
        out = {}
        source = self._source
        for entry, start, end, in_rows in spans:
            pairs = zip(items[start:end], decoded_chunks[start:end], strict=True)
            if in_rows:
                pieces = [
                    chunk_bytes(chunk, data, entry, source(chunk.record.file))
                    for (_, chunk), data in pairs
                ]
                joined = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
                out[entry.key] = (entry, joined)
                continue
            array = allocate(entry)
            for (_, chunk), data in pairs:
                place(array, chunk, data, entry, self._source(chunk.record.file))
            out[entry.key] = (entry, as_bytes(array))
        return out

    def read_chunk(self, entry: Entry, chunk: Chunk) -> memoryview:
        """One stored chunk's elements as row-major bytes."""
        (data,) = self.decode_chunks(entry, [chunk])
        view = strided_view(data, self._source(chunk.record.file))
        if view.size != chunk.numel:
            raise MismatchError(
                f"{entry.key!r}: chunk record holds {view.size} elements, expected {chunk.numel}"
            )
        return as_bytes(view)

    def read_tensor(self, entry: Entry):
        """The whole tensor as a ``torch.Tensor`` with the entry's dtype (imports torch)."""
        array = self.read_array(entry)
        return tensor_from_numpy(array, entry.dtype)

    # -- objects, unsafe -------------------------------------------------------------------

    def read_object_trusted(self, entry: Entry) -> Any:
        """UNSAFE: ``entry``'s value as torch itself loads it (``torch.load(weights_only=False)``
        or ``pickle.loads``), which runs whatever code the pickle names. Only for checkpoints
        whose origin you trust; see :meth:`ckptkit.Checkpoint.read_object` and
        :mod:`ckptkit.reading.trusted`."""
        return trusted.read_object_trusted(self, entry)
