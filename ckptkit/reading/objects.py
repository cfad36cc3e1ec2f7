"""Object entries decoded safely: pickles read by the restricted unpickler (never run), a
file's pickle decoded once for all its keys, and the tensors inside an object handed back as
descriptions, as :class:`~ckptkit.decoding.records.TensorData` or as ``torch.Tensor``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..catalog.model import Encoding, Entry, Record, leaf_path
from ..decoding.known_objects import MAX_DEPTH, decoded
from ..decoding.pickle_limits import OBJECT_LIMITS
from ..decoding.records import (
    TensorData,
    ZipIndex,
    check_crc,
    decode_object_record,
    read_zip_indexes,
    undo_transform,
)
from ..decoding.run_config import parse_document
from ..decoding.unpickler import OBJECT_GLOBALS, Opaque, TensorRef, safe_loads
from ..errors import CorruptRecordError, FormatError, PickleLimitError
from ..storage import Store
from .fetch import RecordFetcher
from .geometry import strided_view, tensor_from_numpy

__all__ = ["ObjectReader", "walk"]


class ObjectReader(RecordFetcher):
    """Fetches the records of one checkpoint location and decodes its object entries."""

    #: Decoded ``data.pkl`` pickles kept for later reads of other keys of the same file.
    PICKLE_CACHE = 8

    def __init__(
        self,
        storage: Store,
        object_globals: Mapping[str, Any] | None = None,
        *,
        verify_crc: bool = True,
    ) -> None:
        super().__init__(storage, verify_crc=verify_crc)
        self.object_globals = object_globals if object_globals is not None else OBJECT_GLOBALS
        self._zip_indexes: dict[str, ZipIndex] = {}  # torch.save file → its located members
        self._pickles: OrderedDict[tuple[str, int, int], Any] = OrderedDict()

    def read_objects(
        self, entries: list[Entry], *, tensors: str = "torch", decode: bool = True
    ) -> list[Any]:
        """Decode object entries in one batch of reads.

        ``tensors="torch"`` turns tensors inside objects into ``torch.Tensor`` (imports torch);
        ``tensors="ref"`` leaves them as descriptions and ``tensors="data"`` loads them as
        :class:`~ckptkit.decoding.records.TensorData` (bytes, dtype, layout), both without torch.
        ``decode`` turns placeholders of known benign classes into real values and marks cycles
        (:func:`ckptkit.decoding.known_objects.decoded`); False keeps every placeholder and cycle as the
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
                value = walk(self._pickle(record, blobs, entry.key), leaf_path(record), source)
                load = lambda ref, r=record, s=source: self._pickled_tensor(r, ref, s)  # noqa: E731
            if decode:
                value = decoded(value)
            if tensors == "torch":
                value = _materialize(value, lambda ref, f=load, s=source: _to_torch(f(ref), s))
            elif tensors == "data":
                value = _materialize(value, load)
            values.append(value)
        return values

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
        elif record.encoding is Encoding.DOCUMENT:
            value = parse_document(blob, record.file, source)
        else:
            raise FormatError(f"{source}: {key!r} has no object record ({record.encoding.value})")
        self._pickles[where] = value
        while len(self._pickles) > self.PICKLE_CACHE:
            self._pickles.popitem(last=False)
        return value

    def _check_crc(self, blob: bytes, record: Record, source: str) -> None:
        if self.verify_crc and record.crc32 is not None:
            check_crc(blob, record.crc32, source)

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


def walk(value: Any, path: list, source: str) -> Any:
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


def _to_torch(data: TensorData | TensorRef, source: str):
    if isinstance(data, TensorRef):  # a bare pickle's tensor: no storage to read
        return data
    array = np.array(strided_view(data, source))  # copy: own, writable memory
    return tensor_from_numpy(array, data.dtype)


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
