"""DCP metadata (``.metadata``, or the rank-local ``__R.metadata`` set written with
``use_collectives=False``) as entries → chunks → records. Never reads a data file.

Two decoders give the same entries: the purpose-built scan
(:func:`~ckptkit.decoding.dcp_scan.scan_dcp_metadata`), whose per-chunk records come as numpy
columns and are joined here column-wise (:class:`_ColumnUnion`), and the safe unpickler with
plain stand-ins for torch's classes (:class:`_MetadataUnion`). The scan is tried first; anything
it or the column join does not handle exactly (an unusual pickle, or metadata the unpickled path
would refuse) falls back to the unpickler, which then says what is wrong.

Shared by the ``dcp`` adapter and OLMo step directories (``olmo_dcp``), whose DCP sits in
``model_and_optim/``: there every record's file is built with that prefix.

Longer than most: the stand-ins for every torch version's metadata classes, their type checks,
and the column join that must agree with them exactly are one contract.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, Literal

import numpy as np

from ...catalog.model import Chunk, Encoding, Entry, Record
from ...decoding.bounded_repr import bounded_repr
from ...decoding.dcp_scan import (
    ChunkRun,
    ColumnClasses,
    ScanDeclined,
    ScanResult,
    StorageRun,
    scan_dcp_metadata,
)
from ...decoding.pickle_limits import METADATA_LIMITS
from ...decoding.unpickler import COMMON_GLOBALS, paused_gc, safe_loads, unsealed
from ...dtypes import DType
from ...errors import (
    CheckpointError,
    CorruptRecordError,
    FormatError,
    MissingFileError,
    UnsafePathError,
    UnsafePickleError,
)
from ...storage import Store

__all__ = [
    "ALLOWED_GLOBALS",
    "COLUMN_CLASSES",
    "DATA_FILE",
    "MEMORY_FORMAT_MEMBERS",
    "METADATA",
    "RANK_METADATA",
    "MetadataStandin",
    "Standin",
    "metadata_files",
    "read_dcp",
    "restricted_getattr",
]

METADATA = ".metadata"
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_TRANSFORMS = {"stream.zstd/1": "zstd"}
#: Transforms one record may name (torch's writer applies at most a couple).
_MAX_TRANSFORMS = 16
#: Dimensions of a tensor, at most (torch sets no limit; shapes and chunk boxes longer than
#: this are refused, as one shared by every chunk would cost its length per chunk).
_MAX_NDIM = 64
#: Parts of a planner_data path (state-dict nesting), at most; a longer one is ignored, as one
#: in bad shape is (the key is then its own path).
_MAX_PATH = METADATA_LIMITS.max_depth
_SEQUENCES = (tuple, list)
_OFFSETS, _SIZES = attrgetter("offsets"), attrgetter("sizes")


class _Stub:
    """A torch metadata class stand-in that keeps its pickled state as it is."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = _as_dict(state)

    def get(self, name: str, default: Any = None) -> Any:
        state = self.state
        return state.get(name, default) if isinstance(state, dict) else default


def _as_dict(state: Any) -> Any:
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        return {**(state[0] or {}), **state[1]}  # the (dict, slots) form
    return state


def _state_dict(state: Any, what: str) -> dict:
    state = _as_dict(state)
    if not isinstance(state, dict):
        raise CorruptRecordError(f"{what} state is not a dict")
    return state


class _Metadata(_Stub):
    __slots__ = ()


#: The stand-in of torch's ``Metadata``; formats that pickle a subclass of it (Megatron's
#: ``MCoreMetadata``) subclass this one, so :func:`read_dcp` accepts their metadata.
MetadataStandin = _Metadata
#: The base of the stand-ins here: a class that keeps its pickled state (``.get(name)``).
Standin = _Stub


class _TensorStorageMetadata(_Stub):
    __slots__ = ()


class _BytesStorageMetadata(_Stub):
    __slots__ = ()


class _StorageMeta(_Stub):
    __slots__ = ()


class _TensorProperties(_Stub):
    """Pickled as a tuple ``(dtype, layout, requires_grad, memory_format, pin_memory)``."""

    __slots__ = ()

    @property
    def dtype(self) -> Any:
        state = self.state
        return state[0] if isinstance(state, tuple) and state else self.get("dtype")


# The three classes below exist once per chunk (500k at scale). They take their fields out of
# the pickled state dict and empty it, since the unpickler's memo keeps that dict alive; the
# chunk and storage-info stand-ins *are* the catalog's Chunk and Record, so nothing is copied.


class _ChunkStorageMetadata(Chunk):
    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        try:
            self.offsets, self.sizes = state["offsets"], state["sizes"]
            state.clear()
        except (KeyError, TypeError, AttributeError):
            state = _state_dict(state, "ChunkStorageMetadata")
            self.offsets, self.sizes = state.get("offsets"), state.get("sizes")
        self.record = self.rank = None
        self.flat = False


class _StorageInfo(Record):
    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        try:
            self.file, self.offset, self.length = (
                state["relative_path"],
                state["offset"],
                state["length"],
            )
            descriptors = state.get("transform_descriptors")
            state.clear()
        except (KeyError, TypeError, AttributeError):
            state = _state_dict(state, "_StorageInfo")
            self.file, self.offset, self.length = (
                state.get("relative_path"),
                state.get("offset"),
                state.get("length"),
            )
            descriptors = state.get("transform_descriptors")
        self.transform = _transforms(descriptors) if descriptors else None
        self.encoding = Encoding.TORCH_SAVE
        self.name = self.stride = self.crc32 = None
        self.storage_offset = 0


def _transforms(descriptors: Any) -> str:
    """A record's transform descriptors (torch writes a short list of strings) as the record's
    transform names them; anything else as bounded text, not walked (a list shared by every
    record, millions of items long, would be walked once per record)."""
    if type(descriptors) in _SEQUENCES and len(descriptors) <= _MAX_TRANSFORMS:
        return "+".join(map(_transform, descriptors))
    return bounded_repr(descriptors)


def _transform(descriptor: Any) -> str:
    """A transform descriptor as the record's transform names it (any other value as bounded
    text: the stand-in runs while the pickle loads, before anything checked it)."""
    if isinstance(descriptor, str):
        return _TRANSFORMS.get(descriptor, str(descriptor))
    return bounded_repr(descriptor)


class _MetadataIndex:
    __slots__ = ("fqn", "offset", "index")

    def __setstate__(self, state: Any) -> None:
        try:
            self.fqn, self.offset, self.index = (
                state["fqn"],
                state.get("offset"),
                state.get("index"),
            )
            state.clear()
        except (KeyError, TypeError, AttributeError):
            state = _state_dict(state, "MetadataIndex")
            self.fqn, self.offset, self.index = (
                state.get("fqn"),
                state.get("offset"),
                state.get("index"),
            )


_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


def _memory_format(value: int) -> str:
    if not isinstance(value, int) or not 0 <= value < len(_MEMORY_FORMATS):
        raise CorruptRecordError(f"unknown memory-format code {bounded_repr(value)}")
    return _MEMORY_FORMATS[value]


#: ``getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')`` and its siblings: how Python >=
#: 3.12 pickles that enum's members (torch's own writer pickles ``_MEM_FORMAT_ENCODING(0)``).
MEMORY_FORMAT_MEMBERS: dict[tuple[Any, str], str] = {
    (_memory_format, f"TORCH_{name.upper()}"): name for name in _MEMORY_FORMATS
}


def _dcp_globals() -> dict[str, Any]:
    classes = {
        "Metadata": _Metadata,
        "TensorStorageMetadata": _TensorStorageMetadata,
        "BytesStorageMetadata": _BytesStorageMetadata,
        "ChunkStorageMetadata": _ChunkStorageMetadata,
        "TensorProperties": _TensorProperties,
        "MetadataIndex": _MetadataIndex,
        "StorageMeta": _StorageMeta,
    }
    allow: dict[str, Any] = dict(COMMON_GLOBALS)
    for module in (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed._shard.checkpoint.metadata",  # torch 1.13
    ):
        allow.update({f"{module}.{name}": cls for name, cls in classes.items()})
        allow[f"{module}._MEM_FORMAT_ENCODING"] = _memory_format
    for module in (
        "torch.distributed._shard.sharded_tensor.metadata",  # torch <= 2.2
        "torch.distributed._shard.checkpoint.metadata",
    ):
        allow[f"{module}.TensorProperties"] = _TensorProperties
        allow[f"{module}.MEM_FORMAT_ENCODING"] = _memory_format
    for module in (
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed._shard.checkpoint.filesystem",
        "olmo_core.distributed.checkpoint.filesystem",  # OLMo-core's own copy
    ):
        allow[f"{module}._StorageInfo"] = _StorageInfo
    return allow


ALLOWED_GLOBALS = _dcp_globals()
#: The stand-ins whose records :func:`~ckptkit.decoding.dcp_scan.scan_dcp_metadata` reads as
#: columns.
COLUMN_CLASSES = ColumnClasses(_ChunkStorageMetadata, _MetadataIndex, _StorageInfo)


def metadata_files(storage: Store) -> list[tuple[str, int | None]]:
    """The metadata file(s) of the DCP at ``storage`` with the rank each describes (None: all)."""
    if storage.exists(METADATA):
        return [(METADATA, None)]
    return sorted(
        ((name, int(m.group(1))) for name in storage.listdir() if (m := RANK_METADATA.match(name))),
        key=lambda item: item[1],
    )


def restricted_getattr(allowed: Mapping[tuple[type, str], Any], what: str) -> Callable[..., Any]:
    """A ``builtins.getattr`` stand-in that answers exactly the ``(stand-in class, attribute
    name)`` pairs in ``allowed`` (an enum member, a nested class) and refuses anything else,
    naming ``what`` is allowed; no attribute of a real object is ever looked up."""
    pairs = dict(allowed)

    def getattr_(obj: Any, name: Any, *default: Any) -> Any:
        obj = unsealed(obj)  # an allowlisted function arrives wrapped
        if not default and type(name) is str and (isinstance(obj, type) or callable(obj)):
            try:
                found = pairs.get((obj, name), _MISSING)
            except TypeError:  # an unhashable stand-in instance
                found = _MISSING
            if found is not _MISSING:
                return found
        raise UnsafePickleError(
            f"pickle calls builtins.getattr({_shown(obj)}, {_shown_name(name)}); only {what} "
            "is allowed, nothing was run",
            global_name="builtins.getattr",
        )

    return getattr_


_MISSING = object()


def _shown_name(name: Any) -> str:
    """The attribute a refused getattr asks for, short (bounded whatever the pickle passed)."""
    return repr(str(name[:40])) if isinstance(name, str) else bounded_repr(name, chars=40)


def _shown(value: Any) -> str:
    """How a refused getattr target is named: an unknown global by its name."""
    global_name = getattr(value, "global_name", None)  # an Opaque placeholder (class)
    if isinstance(global_name, str):
        return global_name
    return value.__name__ if isinstance(value, type) else type(value).__name__


def read_dcp(
    storage: Store,
    prefix: str = "",
    *,
    extra_globals: Mapping[str, Any] | None = None,
    on_metadata: Callable[[str, _Metadata], None] | None = None,
    decoder: Literal["auto", "scan", "unpickler"] = "auto",
) -> tuple[list[Entry], list[str], dict[str, Any]]:
    """The entries of the DCP at ``storage`` from its metadata alone, its data files, and its
    facts (``metadata_files``, ``version``, ``checkpoint_id``, ``save_id``). ``prefix`` is put
    before every file name (records, data and metadata files), for a DCP in a step directory.
    ``extra_globals`` widens :data:`ALLOWED_GLOBALS` for one format's own classes (Megatron's
    ``MCoreMetadata``); ``on_metadata(name, metadata)`` sees each decoded metadata object
    (called once all are decoded when the scan read them). ``decoder``: ``"auto"`` scans and
    falls back to the unpickler; ``"unpickler"`` only unpickles; ``"scan"`` raises
    :class:`~ckptkit.decoding.dcp_scan.ScanDeclined` rather than fall back (tests)."""
    sources = metadata_files(storage)
    if not sources:
        raise MissingFileError(
            f"{storage.describe(METADATA)}: no such file: the .distcp data files are "
            "there but the metadata is not (an interrupted save, or an incomplete copy)"
        )
    allow = {**ALLOWED_GLOBALS, **extra_globals} if extra_globals else ALLOWED_GLOBALS
    with paused_gc(promote=True):  # ~1M objects at scale: see paused_gc
        if decoder != "unpickler":
            try:
                return _read_scanned(storage, prefix, sources, allow, on_metadata)
            except ScanDeclined:
                if decoder == "scan":
                    raise
        return _read_unpickled(storage, prefix, sources, allow, on_metadata)


def _read_unpickled(
    storage: Store,
    prefix: str,
    sources: list[tuple[str, int | None]],
    allow: Mapping[str, Any],
    on_metadata: Callable[[str, _Metadata], None] | None,
) -> tuple[list[Entry], list[str], dict[str, Any]]:
    """:func:`read_dcp` through the allowlisting unpickler (the reference decoder)."""
    union = _MetadataUnion(storage, prefix)
    for name, rank in sources:
        metadata = _load_metadata(storage, name, allow)
        if on_metadata is not None:
            on_metadata(name, metadata)
        union.add(name, metadata, rank)
        del metadata  # its index objects are garbage now: freed before the GC resumes
    return union.entries(), list(union.files.values()), union.facts


def _read_scanned(
    storage: Store,
    prefix: str,
    sources: list[tuple[str, int | None]],
    allow: Mapping[str, Any],
    on_metadata: Callable[[str, _Metadata], None] | None,
) -> tuple[list[Entry], list[str], dict[str, Any]]:
    """:func:`read_dcp` through the scan and the column join; raises ScanDeclined for
    anything either does not handle exactly (a file that cannot be read raises as it would
    for the unpickler)."""
    union = _ColumnUnion(storage, prefix)
    decoded = []
    for name, rank in sources:
        source = storage.describe(name)
        with storage.open_sequential(name, max_bytes=METADATA_LIMITS.max_bytes) as stream:
            data = [stream.read()]
        try:
            # handed over in lists, so that the pickle and then the columns go once used
            scanned = [_scan(data, allow, source)]
            decoded.append((name, union.add(name, scanned, rank)))
        except ScanDeclined:
            raise
        except Exception as exc:  # columns the join did not foresee: the unpickler decides
            raise ScanDeclined(f"{source}: {type(exc).__name__} joining columns") from exc
    entries = union.entries()
    if on_metadata is not None:
        for name, metadata in decoded:
            on_metadata(name, metadata)
    return entries, list(union.files.values()), union.facts


def _scan(data: list[bytes], allow: Mapping[str, Any], source: str) -> ScanResult:
    """The scan of the pickle taken out of ``data``."""
    return scan_dcp_metadata(
        data.pop(), allow=allow, classes=COLUMN_CLASSES, limits=METADATA_LIMITS, source=source
    )


def _load_metadata(storage: Store, name: str, allow: Mapping[str, Any]) -> _Metadata:
    source = storage.describe(name)
    with storage.open_sequential(name, max_bytes=METADATA_LIMITS.max_bytes) as stream:
        metadata = safe_loads(stream, allow=allow, source=source, limits=METADATA_LIMITS)
    if not isinstance(metadata, _Metadata) or not isinstance(
        metadata.get("state_dict_metadata"), dict
    ):
        raise FormatError(f"{source}: not a DCP Metadata object ({type(metadata).__name__})")
    return metadata


class _MetadataUnion:
    """Accumulates entries from one or more metadata files (rank-local sets are unioned)."""

    def __init__(self, storage: Store, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self.chunks: dict[str, list[Chunk]] = {}
        self.kinds: dict[str, tuple[str, DType | None, tuple[int, ...] | None]] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.files: dict[str, str] = {}  # data file as the metadata names it → as recorded
        self.facts: dict[str, Any] = {"metadata_files": ()}

    def add(self, name: str, metadata: _Metadata, metadata_rank: int | None) -> None:
        """Union the items of one metadata file (``metadata_rank``: the rank it describes)."""
        source = self.storage.describe(name)
        self._note_facts(name, metadata)
        tensor_chunks = self._declare(metadata, source)
        storage_data = metadata.get("storage_data") or {}
        if not isinstance(storage_data, dict):
            raise FormatError(f"{source}: storage_data is not a mapping")
        self._attach(storage_data, tensor_chunks, metadata_rank, source)
        self._close(tensor_chunks, metadata_rank, source)

    def _note_facts(self, name: str, metadata: _Metadata) -> None:
        _note_facts(self.facts, self.prefix + name, metadata)

    def _declare(self, metadata: _Metadata, source: str) -> dict[str, list[Chunk]]:
        """Every key's path and kind (dtype, shape); this file's chunks of each tensor."""
        planner_data = metadata.get("planner_data")
        if not isinstance(planner_data, dict):
            planner_data = {}
        tensor_chunks: dict[str, list[Chunk]] = {}
        for fqn, item in metadata.get("state_dict_metadata").items():
            if not isinstance(fqn, str):
                raise FormatError(f"{source}: non-string key {bounded_repr(fqn)}")
            self.paths.setdefault(fqn, _path_of(planner_data, fqn))
            if isinstance(item, _BytesStorageMetadata):
                self._kind(fqn, ("object", None, None), source)
            elif isinstance(item, _TensorStorageMetadata):
                tensor_chunks[fqn] = self._tensor(fqn, item, source)
            else:
                raise FormatError(
                    f"{source}: {fqn!r} has unknown storage metadata {type(item).__name__}"
                )
            self.chunks.setdefault(fqn, [])
        return tensor_chunks

    def _tensor(self, fqn: str, item: _TensorStorageMetadata, source: str) -> list[Chunk]:
        properties = item.get("properties")
        dtype = properties.dtype if isinstance(properties, _TensorProperties) else None
        if not isinstance(dtype, DType):
            raise FormatError(
                f"{source}: tensor {fqn!r} has no known dtype ({bounded_repr(dtype)})"
            )
        shape = item.get("size")
        if not _is_box(shape, None):
            raise FormatError(
                f"{source}: tensor {fqn!r} has a malformed size {bounded_repr(shape)}"
            )
        self._kind(fqn, ("tensor", dtype, shape), source)
        chunks = item.get("chunks") or []
        if not isinstance(chunks, list) or not all(
            type(chunk) is _ChunkStorageMetadata for chunk in chunks
        ):
            raise FormatError(f"{source}: tensor {fqn!r} has a malformed chunk")
        if not _numbers_only(chunks):  # the catalog builder checks the numbers' values
            chunk = next((c for c in chunks if not _numbers_only([c])), chunks[0])
            raise FormatError(
                f"{source}: tensor {fqn!r} has a malformed chunk at {bounded_repr(chunk.offsets)} "
                f"of size {bounded_repr(chunk.sizes)} (not sequences of at most {_MAX_NDIM} ints)"
            )
        return chunks

    def _attach(
        self,
        storage_data: dict,
        tensor_chunks: dict[str, list[Chunk]],
        metadata_rank: int | None,
        source: str,
    ) -> None:
        """Give every chunk (and object) its record; the record's file, rank and encoding are
        settled here, as the record is built. Hot at scale (one pass over 500k records): the
        common case (a tensor record whose index hint names its chunk) stays inline."""
        ranks: dict[str, int | None] = {}
        by_offsets: dict[str, dict[tuple[int, ...], Chunk]] = {}
        files, prefix = self.files, self.prefix
        itemsizes = {fqn: self.kinds[fqn][1].itemsize for fqn in tensor_chunks}
        for index, info in storage_data.items():
            if type(index) is not _MetadataIndex or type(info) is not _StorageInfo:
                raise FormatError(f"{source}: malformed storage_data entry")
            fqn, file = index.fqn, info.file
            if not (
                type(fqn) is str
                and type(file) is str
                and type(info.offset) is int
                and type(info.length) is int
                and info.offset >= 0
                and info.length >= 0
            ):
                raise FormatError(f"{source}: {_shown_key(fqn)} has a malformed storage record")
            rank = ranks.get(file, -1)
            if rank == -1:
                _check_file_name(self.storage, source, fqn, file)
                rank = ranks[file] = _rank(file, metadata_rank)
                files.setdefault(file, prefix + file)
            if prefix:  # the record is built relative to the step directory
                info.file = files[file]
            chunks = tensor_chunks.get(fqn)
            position = index.index
            if (
                chunks is not None
                and type(position) is int
                and 0 <= position < len(chunks)
                and chunks[position].offsets == index.offset
            ):
                chunk = chunks[position]
            elif index.offset is None:
                self._attach_object(fqn, info, rank, source)
                continue
            elif chunks is None:
                raise FormatError(f"{source}: storage record for unknown tensor {fqn!r}")
            else:  # no usable index hint: look the chunk up by its offsets
                chunk = self._chunk_at(fqn, index, chunks, by_offsets, source)
            chunk.record, chunk.rank = info, rank
            # SerializationFormat.SAFETENSORS: the record is the file's safetensors blob and its
            # length is the chunk's element bytes, which no torch.save zip record can be.
            if info.transform is None:
                try:
                    nbytes = math.prod(chunk.sizes) * itemsizes[fqn]
                except TypeError:  # malformed sizes: the catalog builder names them
                    continue
                if info.length == nbytes:
                    info.encoding, info.name = Encoding.SAFETENSORS, fqn

    def _attach_object(self, fqn: str, info: _StorageInfo, rank: int | None, source: str) -> None:
        if self.kinds.get(fqn, ("",))[0] != "object":
            raise FormatError(f"{source}: storage record for unknown object {fqn!r}")
        self.chunks[fqn].append(Chunk((), (), info, rank))

    def _chunk_at(
        self, fqn: str, index: _MetadataIndex, chunks: list[Chunk], by_offsets: dict, source: str
    ) -> Chunk:
        """The chunk of ``fqn`` a record's offsets name (when its index hint does not fit)."""
        if fqn not in by_offsets:
            by_offsets[fqn] = {c.offsets: c for c in chunks if _is_box(c.offsets, None)}
        offset = index.offset
        fits = isinstance(offset, list | tuple) and len(offset) <= _MAX_NDIM
        offset = tuple(offset) if fits else None
        chunk = by_offsets[fqn].get(offset) if _is_box(offset, len(self.kinds[fqn][2])) else None
        if chunk is None:
            raise FormatError(
                f"{source}: {fqn!r} has a record for no chunk ({bounded_repr(index.offset)})"
            )
        return chunk

    def _close(
        self, tensor_chunks: dict[str, list[Chunk]], metadata_rank: int | None, source: str
    ) -> None:
        """Every chunk with elements has a record; every object one at least."""
        for fqn, chunks in tensor_chunks.items():
            for chunk in chunks:
                if chunk.record is None:
                    # an empty chunk is listed but never written (a malformed one is left to
                    # the catalog builder to name)
                    if _is_box(chunk.sizes, None) and 0 not in chunk.sizes:
                        raise FormatError(
                            f"{source}: {fqn!r} chunk at {list(chunk.offsets)} has no storage record"
                        )
                    chunk.rank = metadata_rank
            self.chunks[fqn].extend(chunks)
        for fqn, (kind, _, _) in self.kinds.items():
            if kind == "object" and not self.chunks[fqn]:
                raise FormatError(f"{source}: object {fqn!r} has no storage record")

    def _kind(self, fqn: str, kind: tuple, source: str) -> None:
        known = self.kinds.setdefault(fqn, kind)
        if known != kind:
            raise FormatError(
                f"{source}: {fqn!r} is described differently by another metadata file"
            )

    def entries(self) -> list[Entry]:
        out = []
        for fqn, chunks in self.chunks.items():
            kind, dtype, shape = self.kinds[fqn]
            out.append(Entry(fqn, self.paths[fqn], kind, tuple(chunks), dtype, shape))
        return out


class _Declined(ScanDeclined):
    """The column join leaves this metadata to the unpickled path (which says what is wrong,
    or builds it in a way the columns cannot follow)."""


@dataclass
class _Tensor:
    """One tensor's chunks declared by one metadata file, as columns (``(chunks, ndim)``)."""

    fqn: str
    dtype: DType
    offsets: np.ndarray
    sizes: np.ndarray


@dataclass
class _Records:
    """A file's ``storage_data`` items in order, as columns; strings are codes into
    ``strings`` (``transform``: into ``transforms``, -1 for None)."""

    strings: list[str]
    fqn: np.ndarray
    index: np.ndarray
    index_none: np.ndarray
    offsets: np.ndarray
    offsets_ndim: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    transforms: list[str]
    transform: np.ndarray


class _ColumnUnion:
    """:class:`_MetadataUnion` for scanned metadata: the same entries, computed on the scan's
    columns, with records and chunks built once at the end. Whatever the unpickled path would
    refuse, or builds in a way columns cannot follow (one object in two places), raises
    :class:`~ckptkit.decoding.dcp_scan.ScanDeclined` instead, so that path runs and says."""

    def __init__(self, storage: Store, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self.chunks: dict[str, list[Chunk]] = {}
        self.kinds: dict[str, tuple[str, DType | None, tuple[int, ...] | None]] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.files: dict[str, str] = {}
        self.facts: dict[str, Any] = {"metadata_files": ()}

    def add(self, name: str, scanned: list[ScanResult], metadata_rank: int | None) -> _Metadata:
        """Union the items of one scanned metadata file (``metadata_rank``: its rank), taking
        the one scan out of ``scanned`` so that its columns go once copied; its metadata."""
        scan = scanned.pop()
        metadata = scan.value
        if not isinstance(metadata, _Metadata) or not isinstance(
            metadata.get("state_dict_metadata"), dict
        ):
            raise _Declined("not a DCP Metadata object")
        _note_facts(self.facts, self.prefix + name, metadata)
        tensors = self._declare(metadata, scan)
        storage_data = metadata.get("storage_data") or {}
        if not isinstance(storage_data, dict):
            raise _Declined("storage_data is not a mapping")
        handed = [_records(storage_data, scan), tensors]
        del scan, tensors  # the columns go as soon as _attach is done with them
        self._attach(handed, metadata_rank, self.storage.describe(name))
        return metadata

    def _declare(self, metadata: _Metadata, scanned: ScanResult) -> list[_Tensor]:
        """Every key's path and kind; this file's tensors with their chunks as columns."""
        planner_data = metadata.get("planner_data")
        if not isinstance(planner_data, dict):
            planner_data = {}
        shared = _Shared(scanned.row_objects)
        tensors = []
        for fqn, item in metadata.get("state_dict_metadata").items():
            if not isinstance(fqn, str):
                raise _Declined("a non-string key")
            self.paths.setdefault(fqn, _path_of(planner_data, fqn))
            if isinstance(item, _BytesStorageMetadata):
                self._kind(fqn, ("object", None, None))
            elif isinstance(item, _TensorStorageMetadata):
                tensors.append(self._tensor(fqn, item, scanned, shared))
            else:
                raise _Declined("unknown storage metadata")
            self.chunks.setdefault(fqn, [])
        return tensors

    def _tensor(
        self, fqn: str, item: _TensorStorageMetadata, scanned: ScanResult, shared: _Shared
    ) -> _Tensor:
        properties = item.get("properties")
        dtype = properties.dtype if isinstance(properties, _TensorProperties) else None
        shape = item.get("size")
        if not isinstance(dtype, DType) or not _is_box(shape, None):
            raise _Declined("a tensor without a dtype or size")
        self._kind(fqn, ("tensor", dtype, shape))
        chunks = item.get("chunks") or []
        if type(chunks) is not list:
            raise _Declined("malformed chunks")
        shared.once(chunks)
        ndim = len(shape)
        offsets, sizes = [], []
        columns = scanned.chunks
        for chunk in chunks:
            if type(chunk) is ChunkRun:
                rows = slice(chunk.start, chunk.stop)
                if (columns.offsets_ndim[rows] != ndim).any() or (
                    columns.sizes_ndim[rows] != ndim
                ).any():
                    raise _Declined("a chunk box of another length than the tensor's")
                offsets.append(columns.offsets[rows, :ndim])
                sizes.append(columns.sizes[rows, :ndim])
            elif type(chunk) is _ChunkStorageMetadata:
                shared.once(chunk)
                offsets.append(_box_row(chunk.offsets, ndim))
                sizes.append(_box_row(chunk.sizes, ndim))
            else:
                raise _Declined("a malformed chunk")
        tensor = _Tensor(fqn, dtype, _rows(offsets, ndim), _rows(sizes, ndim))
        if (tensor.offsets < 0).any() or (tensor.sizes < 0).any():
            raise _Declined("a negative chunk offset or size")
        return tensor

    def _attach(self, handed: list, metadata_rank: int | None, source: str) -> None:
        """Every chunk (and object) its record, as :meth:`_MetadataUnion._attach` and
        :meth:`_MetadataUnion._close` decide, then this file's chunks built. ``handed`` holds
        the records and tensors (emptied here: they are let go once no longer needed)."""
        records, tensors = handed
        handed.clear()
        ranks = self._note_files(records, metadata_rank, source)
        strings = records.strings
        codes = {text: code for code, text in enumerate(strings)}
        counts = np.array([len(t.offsets) for t in tensors], np.int64)
        bases = np.concatenate([[0], np.cumsum(counts)])
        slot_of = np.full(len(strings) + 1, -1, np.int64)
        for slot, tensor in enumerate(tensors):
            code = codes.get(tensor.fqn)
            if code is not None:
                slot_of[code] = slot
        slot = slot_of[records.fqn]
        target = self._hinted(records, tensors, slot, bases, counts)
        unhinted = np.flatnonzero(target < 0)
        if len(unhinted):
            target = self._unhinted(records, tensors, slot, bases, target, unhinted, ranks)
        total = int(bases[-1])
        record_of = np.full(total, -1, np.int32)
        tensor_rows = np.flatnonzero(target >= 0)
        if len(tensor_rows):  # a chunk named by several records keeps the last
            last = len(tensor_rows) - 1 - np.unique(target[tensor_rows][::-1], return_index=True)[1]
            record_of[target[tensor_rows][last]] = tensor_rows[last]
        del target, slot, tensor_rows
        handed.append(_Fields(records, ranks, self.prefix))
        del records, ranks
        handed.append(tensors)
        del tensors
        self._close(handed, bases, record_of, metadata_rank)

    def _note_files(self, records: _Records, metadata_rank: int | None, source: str) -> np.ndarray:
        """Each record's rank (-1: None), its file checked and noted in first-seen order."""
        ranks = np.full(len(records.strings) + 1, -1, np.int64)
        if not len(records.file):
            return ranks[records.file]
        codes, first = np.unique(records.file, return_index=True)
        for at in np.argsort(first, kind="stable").tolist():
            code, row = int(codes[at]), int(first[at])
            file = records.strings[code]
            try:
                _check_file_name(self.storage, source, records.strings[records.fqn[row]], file)
            except CheckpointError:
                raise _Declined("a record names a file outside the checkpoint") from None
            rank = _rank(file, metadata_rank)
            ranks[code] = -1 if rank is None else rank
            self.files.setdefault(file, self.prefix + file)
        return ranks[records.file]

    @staticmethod
    def _hinted(
        records: _Records,
        tensors: list[_Tensor],
        slot: np.ndarray,
        bases: np.ndarray,
        counts: np.ndarray,
    ) -> np.ndarray:
        """The chunk each record's index hint names when its offsets match (-1: none)."""
        target = np.full(len(slot), -1, np.int64)
        if not tensors:
            return target
        ndims = np.array([t.offsets.shape[1] for t in tensors], np.int64)
        width = max(int(ndims.max()), records.offsets.shape[1])
        offsets = np.zeros((int(bases[-1]), width), np.int64)
        for tensor, base in zip(tensors, bases.tolist(), strict=False):
            offsets[base : base + len(tensor.offsets), : tensor.offsets.shape[1]] = tensor.offsets
        theirs = np.zeros((len(slot), width), np.int64)
        theirs[:, : records.offsets.shape[1]] = records.offsets
        known = slot >= 0
        position = records.index
        hinted = (
            known
            & ~records.index_none
            & (position >= 0)
            & (position < np.where(known, counts[slot], 0))
        )
        hinted &= records.offsets_ndim == np.where(known, ndims[slot], -2)
        rows = np.flatnonzero(hinted)
        chunk = bases[slot[rows]] + position[rows]
        same = (offsets[chunk] == theirs[rows]).all(axis=1)
        target[rows[same]] = chunk[same]
        return target

    def _unhinted(
        self,
        records: _Records,
        tensors: list[_Tensor],
        slot: np.ndarray,
        bases: np.ndarray,
        target: np.ndarray,
        rows: np.ndarray,
        ranks: np.ndarray,
    ) -> np.ndarray:
        """Records whose hint did not name their chunk: objects (no offsets), and tensor
        records looked up by their offsets (the last chunk with those offsets)."""
        by_offsets: dict[int, dict[tuple[int, ...], int]] = {}
        for row in rows.tolist():
            fqn = records.strings[records.fqn[row]]
            ndim = int(records.offsets_ndim[row])
            if ndim < 0:  # offset None: an object's record
                if self.kinds.get(fqn, ("",))[0] != "object":
                    raise _Declined("a storage record for an unknown object")
                rank = int(ranks[row])
                chunk = Chunk(
                    (), (), _record(records, row, self.prefix), None if rank < 0 else rank
                )
                self.chunks[fqn].append(chunk)
                continue
            at = int(slot[row])
            if at < 0:
                raise _Declined("a storage record for an unknown tensor")
            tensor = tensors[at]
            if at not in by_offsets:
                by_offsets[at] = {tuple(o): i for i, o in enumerate(tensor.offsets.tolist())}
            offsets = tuple(records.offsets[row, :ndim].tolist())
            found = by_offsets[at].get(offsets) if ndim == tensor.offsets.shape[1] else None
            if found is None or min(offsets, default=0) < 0:
                raise _Declined("a storage record for no chunk")
            target[row] = bases[at] + found
        return target

    def _close(
        self,
        handed: list,
        bases: np.ndarray,
        record_of: np.ndarray,
        metadata_rank: int | None,
    ) -> None:
        """Refuse what :meth:`_MetadataUnion._close` refuses, then build this file's chunks
        (``handed``: the records' fields and the tensors, let go as they are built)."""
        fields, tensors = handed
        handed.clear()
        for tensor, base in zip(tensors, bases.tolist(), strict=False):
            missing = record_of[base : base + len(tensor.offsets)] < 0
            if missing.any() and (tensor.sizes[missing] > 0).all(axis=1).any():
                raise _Declined("a chunk with elements has no storage record")
        for fqn, (kind, _, _) in self.kinds.items():
            if kind == "object" and not self.chunks[fqn]:
                raise _Declined("an object has no storage record")
        fqns = [t.fqn for t in tensors]
        built = _built_chunks(fields, tensors, record_of, metadata_rank)
        for fqn, base, stop in zip(fqns, bases.tolist(), bases[1:].tolist(), strict=False):
            self.chunks[fqn].extend(built[base:stop])

    def _kind(self, fqn: str, kind: tuple) -> None:
        if self.kinds.setdefault(fqn, kind) != kind:
            raise _Declined("a key described differently by another metadata file")

    def entries(self) -> list[Entry]:
        out = []
        for fqn, chunks in self.chunks.items():
            kind, dtype, shape = self.kinds[fqn]
            out.append(Entry(fqn, self.paths[fqn], kind, tuple(chunks), dtype, shape))
        return out


class _Shared:
    """Refuses (declines) an object met twice: a chunk list or chunk named from two places
    (or also by a save plan) would be one object the unpickled path updates once for both."""

    def __init__(self, objects: list[Any]) -> None:
        self.seen = {id(o) for o in objects}
        self.keep = list(objects)

    def once(self, obj: Any) -> None:
        if id(obj) in self.seen:
            raise _Declined("one object in two places")
        self.seen.add(id(obj))
        self.keep.append(obj)


def _box_row(box: Any, ndim: int) -> np.ndarray:
    """A generic chunk's offsets or sizes as one row: a tuple of ``ndim`` ints (int64)."""
    if type(box) is not tuple or len(box) != ndim or not all(type(v) is int for v in box):
        raise _Declined("a chunk box that is not a tuple of the tensor's length")
    try:
        return np.array([box], np.int64).reshape(1, ndim)
    except OverflowError:
        raise _Declined("a chunk box beyond int64") from None


def _rows(blocks: list[np.ndarray], ndim: int) -> np.ndarray:
    return np.concatenate(blocks) if blocks else np.zeros((0, ndim), np.int64)


def _records(storage_data: dict, scanned: ScanResult) -> _Records:
    """``storage_data``'s items in order as columns: the scan's rows for its runs, the
    generic items (the first of their kind, those a frame split) checked and added."""
    strings = list(scanned.strings)
    codes = {text: code for code, text in enumerate(strings)}
    transforms: list[str] = []
    transform_codes: dict[str, int] = {}
    columns = scanned.storage
    parts: list[dict[str, np.ndarray]] = []
    loose: list[tuple] = []
    seen: set[int] = set()

    def code_of(text: str, table: list[str], index: dict[str, int]) -> int:
        if text not in index:
            index[text] = len(table)
            table.append(text)
        return index[text]

    def flush() -> None:
        if loose:
            parts.append(_loose_columns(loose))
            loose.clear()

    def transform_of(descriptor_code: int) -> int:
        if descriptor_code < 0:
            return -1
        return code_of(_transform(strings[descriptor_code]), transforms, transform_codes)

    for key, info in storage_data.items():
        if type(key) is StorageRun:
            flush()
            rows = slice(key.start, key.stop)
            run_transforms = columns.transform[rows]
            named = np.unique(run_transforms[run_transforms >= 0]).tolist()
            mapping = {code: transform_of(code) for code in named}
            parts.append(
                {
                    "fqn": columns.fqn[rows],
                    "index": columns.index[rows],
                    "index_none": columns.index_none[rows],
                    "offsets": columns.offsets[rows],
                    "offsets_ndim": columns.offsets_ndim[rows],
                    "file": columns.file[rows],
                    "offset": columns.offset[rows],
                    "length": columns.length[rows],
                    "transform": _recode(run_transforms, mapping),
                }
            )
            continue
        loose.append(
            _loose_item(
                key,
                info,
                seen,
                lambda t: code_of(t, strings, codes),
                lambda t: code_of(t, transforms, transform_codes),
            )
        )
    flush()
    joined = {k: _concat_rows([p[k] for p in parts]) for k in _RECORD_COLUMNS} if parts else {}
    if not parts:
        empty = np.zeros(0, np.int64)
        joined = {k: empty for k in _RECORD_COLUMNS}
        joined["index_none"] = np.zeros(0, bool)
        joined["offsets"] = np.zeros((0, 0), np.int64)
    if (joined["offset"] < 0).any() or (joined["length"] < 0).any():
        raise _Declined("a negative record offset or length")
    return _Records(strings=strings, transforms=transforms, **joined)


_RECORD_COLUMNS = (
    "fqn",
    "index",
    "index_none",
    "offsets",
    "offsets_ndim",
    "file",
    "offset",
    "length",
    "transform",
)


def _loose_item(
    key: Any,
    info: Any,
    seen: set[int],
    string_code: Callable[[str], int],
    transform_code: Callable[[str], int],
) -> tuple:
    """One ``storage_data`` item the scan built as objects, checked as
    :meth:`_MetadataUnion._attach` checks it, as a row."""
    if type(key) is not _MetadataIndex or type(info) is not _StorageInfo:
        raise _Declined("a malformed storage_data entry")
    if id(info) in seen:
        raise _Declined("one record for two keys")
    seen.add(id(info))
    fqn, file, index, offsets = key.fqn, info.file, key.index, key.offset
    if not (
        type(fqn) is str
        and type(file) is str
        and type(info.offset) is int
        and type(info.length) is int
        and (index is None or type(index) is int)
        and (offsets is None or (type(offsets) is tuple and len(offsets) <= _MAX_NDIM))
        and (offsets is None or all(type(v) is int for v in offsets))
        and (info.transform is None or type(info.transform) is str)
    ):
        raise _Declined("a storage record not of plain strings and ints")
    return (
        string_code(fqn),
        0 if index is None else index,
        index is None,
        offsets,
        string_code(file),
        info.offset,
        info.length,
        -1 if info.transform is None else transform_code(info.transform),
    )


def _loose_columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    fqn, index, index_none, offsets, file, offset, length, transform = zip(*rows, strict=True)
    width = max((len(o) for o in offsets if o is not None), default=0)
    matrix = np.zeros((len(rows), width), np.int64)
    ndim = np.full(len(rows), -1, np.int8)
    try:
        for i, box in enumerate(offsets):
            if box is not None:
                matrix[i, : len(box)] = box
                ndim[i] = len(box)
        return {
            "fqn": np.array(fqn, np.int32),
            "index": np.array(index, np.int64),
            "index_none": np.array(index_none, bool),
            "offsets": matrix,
            "offsets_ndim": ndim,
            "file": np.array(file, np.int32),
            "offset": np.array(offset, np.int64),
            "length": np.array(length, np.int64),
            "transform": np.array(transform, np.int32),
        }
    except OverflowError:
        raise _Declined("a storage record beyond int64") from None


def _concat_rows(blocks: list[np.ndarray]) -> np.ndarray:
    if blocks[0].ndim == 2:
        width = max(b.shape[1] for b in blocks)
        blocks = [np.pad(b, ((0, 0), (0, width - b.shape[1]))) for b in blocks]
    return np.concatenate(blocks)


def _recode(codes: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    """``codes`` through ``mapping`` (-1 stays -1)."""
    out = np.full(len(codes), -1, np.int32)
    for old, new in mapping.items():
        out[codes == old] = new
    return out


def _record(records: _Records, row: int, prefix: str) -> _StorageInfo:
    """The record of one row (an object's), as the unpickled path builds it."""
    transform = int(records.transform[row])
    return _StorageInfo(
        prefix + records.strings[records.file[row]],
        int(records.offset[row]),
        int(records.length[row]),
        Encoding.TORCH_SAVE,
        None if transform < 0 else records.transforms[transform],
    )


class _Fields:
    """What a record of a chunk still needs once records are matched to chunks: its file
    (as the catalog names it), offset, length, transform and rank."""

    def __init__(self, records: _Records, ranks: np.ndarray, prefix: str) -> None:
        self.files = [prefix + f for f in records.strings]
        self.transforms = [*records.transforms, None]  # code -1: None
        self.file = records.file.astype(np.int32)
        self.offset = records.offset
        self.length = records.length
        self.transform = records.transform.astype(np.int32)
        self.rank = ranks.astype(np.int32)


def _built_chunks(
    fields: _Fields, tensors: list[_Tensor], record_of: np.ndarray, metadata_rank: int | None
) -> list[_ChunkStorageMetadata]:
    """This file's tensor chunks (in declaration order) with their records, built in batches
    (the lists on the way stay small): boxes, file names and lengths shared; a record whose
    length is its chunk's element bytes (and no transform) a safetensors blob
    (``SerializationFormat.SAFETENSORS``). The tensors' columns are let go here. Values are
    picked from object arrays (numpy's take beats a ``map`` of ``__getitem__``)."""
    if not tensors:
        return []
    counts = [len(t.offsets) for t in tensors]
    itemsize = np.repeat(np.array([t.dtype.itemsize for t in tensors], np.int64), counts)
    nbytes = _nbytes(tensors, itemsize)
    del itemsize
    owner = np.repeat(np.arange(len(tensors), dtype=np.int32), counts)
    fqns = _objects([t.fqn for t in tensors])
    offsets, offset_boxes = _box_codes([t.offsets for t in tensors])
    sizes, size_boxes = _box_codes([t.sizes for t in tensors])
    tensors.clear()
    lengths, length_values = _int_codes(fields.length)
    offsets_in_file, offset_values = _int_codes(fields.offset)  # ranks lay out files alike
    files = _objects(fields.files)
    transforms = _objects(fields.transforms)  # code -1: None
    encodings = _objects([Encoding.TORCH_SAVE, Encoding.SAFETENSORS])
    ranks = _objects([*range(int(fields.rank.max(initial=-1)) + 1), None])  # -1: None
    default_rank = -1 if metadata_rank is None else metadata_rank
    out: list[_ChunkStorageMetadata] = []
    for at in range(0, len(record_of), _BATCH):
        rows = record_of[at : at + _BATCH]
        has = np.flatnonzero(rows >= 0)
        named = rows[has]
        transform = fields.transform[named]
        safetensors = (transform < 0) & (fields.length[named] == nbytes[at + has])
        names = np.where(safetensors, fqns[owner[at + has]], None)
        records = np.full(len(rows), None, object)  # chunks without elements have none
        records[has] = list(
            map(
                _StorageInfo,
                files[fields.file[named]].tolist(),
                offset_values[offsets_in_file[named]].tolist(),
                length_values[lengths[named]].tolist(),
                encodings[safetensors.astype(np.int8)].tolist(),
                transforms[transform].tolist(),
                names.tolist(),
            )
        )
        rank = np.full(len(rows), default_rank, np.int64)
        rank[has] = fields.rank[named]
        out.extend(
            map(
                _ChunkStorageMetadata,
                offset_boxes[offsets[at : at + _BATCH]].tolist(),
                size_boxes[sizes[at : at + _BATCH]].tolist(),
                records.tolist(),
                ranks[rank].tolist(),
                repeat(False),
            )
        )
    return out


def _objects(values: list[Any]) -> np.ndarray:
    """``values`` as a numpy object array (to pick from by code arrays)."""
    array = np.empty(len(values), object)
    array[:] = values
    return array


#: Chunks built per batch (bounds the lists built on the way).
_BATCH = 1 << 15


def _box_codes(blocks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``blocks`` (one per tensor, in order) as codes into a table of tuples (an
    object array), one per distinct box (boxes repeat across tensors sharded alike)."""
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).tolist()
    codes = np.zeros(bounds[-1], np.int32)
    table: list[tuple[int, ...]] = []
    for ndim in sorted({b.shape[1] for b in blocks}):
        picked = [i for i, b in enumerate(blocks) if b.shape[1] == ndim and len(b)]
        if not picked:
            continue
        where = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in picked])
        if ndim == 0:
            codes[where] = len(table)
            table.append(())
            continue
        unique, inverse = _unique_rows(np.concatenate([blocks[i] for i in picked]))
        codes[where] = inverse + len(table)
        table.extend(map(tuple, unique.tolist()))
    return codes, _objects(table)


def _int_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as codes into a table of Python ints (an object array), one object per
    distinct value."""
    unique, inverse = np.unique(values, return_inverse=True)
    return inverse.reshape(-1).astype(np.int32), _objects(unique.tolist())


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a non-negative int64 matrix and each row's index among them:
    rows packed into one int64 when their bits fit (sorting rows as records is slow)."""
    bits = [max(int(column.max()).bit_length(), 1) for column in rows.T]
    if sum(bits) > 62:
        unique, inverse = np.unique(rows, axis=0, return_inverse=True)
        return unique, inverse.reshape(-1)
    key = np.zeros(len(rows), np.int64)
    for column, width in zip(rows.T, bits, strict=True):
        key = (key << width) | column
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return rows[first], inverse.reshape(-1)


def _nbytes(tensors: list[_Tensor], itemsize: np.ndarray) -> np.ndarray:
    """Element bytes of every chunk, exact (-1 beyond int64, where no record length can be);
    boxes whose product might not fit int64 are multiplied as Python ints."""
    parts = []
    for tensor in tensors:
        sizes = tensor.sizes
        if sizes.shape[1] == 0:
            parts.append(np.ones(len(sizes), np.int64))
            continue
        rough = np.prod(sizes.astype(np.float64), axis=1)
        exact = np.prod(np.where(rough < 2.0**58, sizes.T, 0).T, axis=1)
        large = np.flatnonzero(rough >= 2.0**58)
        parts.append(exact)
        for row in large.tolist():
            exact[row] = _clip(math.prod(sizes[row].tolist()))
    numel = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    fits = (numel >= 0) & (numel < (1 << 58))
    out = np.where(fits, numel * itemsize, -1)
    for row in np.flatnonzero(~fits & (numel >= 0)).tolist():
        out[row] = _clip(int(numel[row]) * int(itemsize[row]))
    return out


def _clip(value: int) -> int:
    """``value`` when it fits int64, else -1 (no record's length)."""
    return value if value < (1 << 63) else -1


def _note_facts(facts: dict[str, Any], name: str, metadata: _Metadata) -> None:
    """The facts one metadata file adds: its name, the version, the storage_meta ids."""
    facts["metadata_files"] += (name,)
    facts.setdefault("version", _text(metadata.get("version")))
    storage_meta = metadata.get("storage_meta")
    if isinstance(storage_meta, _StorageMeta) and "save_id" not in facts:
        facts["checkpoint_id"] = _text(storage_meta.get("checkpoint_id"))
        facts["save_id"] = _text(storage_meta.get("save_id"))


def _path_of(planner_data: dict, fqn: str) -> tuple[str | int, ...]:
    """The nesting ``planner_data`` gives ``fqn``, when well-formed; else the key alone."""
    path = planner_data.get(fqn)
    if not (
        isinstance(path, tuple | list) and 0 < len(path) <= _MAX_PATH and all(map(_is_part, path))
    ):
        path = (fqn,)
    return tuple(path)


def _check_file_name(storage: Store, source: str, fqn: str, name: str) -> None:
    """Refuse a storage record naming a file outside the checkpoint, naming the entry."""
    try:
        storage.path(name)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{source}: {fqn!r} has a record in {name!r}: {exc}") from None


def _numbers_only(chunks: list[Chunk]) -> bool:
    """Every chunk's offsets and sizes are tuples (or lists) of at most :data:`_MAX_NDIM` ints,
    so comparing, hashing and printing them is cheap whatever else the pickle built (a deep
    shared list would take 2**depth steps). Their values (signs, lengths, the box inside the
    tensor) are the catalog builder's to check. Column-wise in C builtins: 500k chunks at scale."""
    boxes = [*map(_OFFSETS, chunks), *map(_SIZES, chunks)]
    if not boxes:
        return True
    if not {*map(type, boxes)}.issubset(_SEQUENCES) or max(map(len, boxes)) > _MAX_NDIM:
        return False
    try:  # a float makes the sum a float; anything else not an int makes it fail
        return type(sum(chain.from_iterable(boxes))) is int
    except TypeError:
        return False


def _shown_key(fqn: Any) -> str:
    """A key as an error names it: a string as ``repr`` shows it, anything else bounded."""
    return repr(fqn) if type(fqn) is str else bounded_repr(fqn)


def _is_box(value: Any, ndim: int | None) -> bool:
    """A tuple of non-negative ints (of length ``ndim`` when given, else at most
    :data:`_MAX_NDIM`). Called for every chunk, so it leans on C builtins: a float or a string
    anywhere makes the sum fail to be an int."""
    if type(value) is not tuple or len(value) > _MAX_NDIM:
        return False
    if ndim is not None and len(value) != ndim:
        return False
    try:
        return not value or (type(sum(value)) is int and min(value) >= 0)
    except TypeError:
        return False


def _text(value: Any) -> str | None:
    """A metadata field kept for display: a string or number as text, else dropped (it could
    be any structure the pickle built)."""
    return str(value) if isinstance(value, str | int | float) else None


def _is_part(part: Any) -> bool:
    """A step of a planner_data path: a dict key (str) or a list index (int)."""
    return type(part) is str or type(part) is int


def _rank(file: str, default: int | None) -> int | None:
    """The writing rank, from a ``__R_K.distcp`` name (or the rank-local metadata file)."""
    match = DATA_FILE.match(file)
    return int(match.group(1)) if match else default
