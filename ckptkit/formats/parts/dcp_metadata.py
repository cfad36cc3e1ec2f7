"""DCP metadata (``.metadata``, or the rank-local ``__R.metadata`` set written with
``use_collectives=False``) read through the safe unpickler with plain stand-ins for torch's
classes, as entries → chunks → records. Never reads a data file.

Shared by the ``dcp`` adapter and OLMo step directories (``olmo_dcp``), whose DCP sits in
``model_and_optim/``: there every record's file is built with that prefix.

Longer than most: the stand-ins for every torch version's metadata classes and their type checks
are one contract.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from itertools import chain
from operator import attrgetter
from typing import Any

from ...catalog.model import Chunk, Encoding, Entry, Record
from ...decoding.bounded_repr import bounded_repr
from ...decoding.pickle_limits import METADATA_LIMITS
from ...decoding.unpickler import COMMON_GLOBALS, paused_gc, safe_loads, unsealed
from ...dtypes import DType
from ...errors import (
    CorruptRecordError,
    FormatError,
    MissingFileError,
    UnsafePathError,
    UnsafePickleError,
)
from ...storage import Store

__all__ = [
    "ALLOWED_GLOBALS",
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
) -> tuple[list[Entry], list[str], dict[str, Any]]:
    """The entries of the DCP at ``storage`` from its metadata alone, its data files, and its
    facts (``metadata_files``, ``version``, ``checkpoint_id``, ``save_id``). ``prefix`` is put
    before every file name (records, data and metadata files), for a DCP in a step directory.
    ``extra_globals`` widens :data:`ALLOWED_GLOBALS` for one format's own classes (Megatron's
    ``MCoreMetadata``); ``on_metadata(name, metadata)`` sees each decoded metadata object."""
    sources = metadata_files(storage)
    if not sources:
        raise MissingFileError(
            f"{storage.describe(METADATA)}: no such file: the .distcp data files are "
            "there but the metadata is not (an interrupted save, or an incomplete copy)"
        )
    allow = {**ALLOWED_GLOBALS, **extra_globals} if extra_globals else ALLOWED_GLOBALS
    union = _MetadataUnion(storage, prefix)
    with paused_gc(promote=True):  # ~1M objects at scale: see paused_gc
        for name, rank in sources:
            metadata = _load_metadata(storage, name, allow)
            if on_metadata is not None:
                on_metadata(name, metadata)
            union.add(name, metadata, rank)
            del metadata  # its index objects are garbage now: freed before the GC resumes
        return union.entries(), list(union.files.values()), union.facts


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
        self.facts["metadata_files"] += (self.prefix + name,)
        self.facts.setdefault("version", _text(metadata.get("version")))
        storage_meta = metadata.get("storage_meta")
        if isinstance(storage_meta, _StorageMeta) and "save_id" not in self.facts:
            self.facts["checkpoint_id"] = _text(storage_meta.get("checkpoint_id"))
            self.facts["save_id"] = _text(storage_meta.get("save_id"))

    def _declare(self, metadata: _Metadata, source: str) -> dict[str, list[Chunk]]:
        """Every key's path and kind (dtype, shape); this file's chunks of each tensor."""
        planner_data = metadata.get("planner_data")
        if not isinstance(planner_data, dict):
            planner_data = {}
        tensor_chunks: dict[str, list[Chunk]] = {}
        for fqn, item in metadata.get("state_dict_metadata").items():
            if not isinstance(fqn, str):
                raise FormatError(f"{source}: non-string key {bounded_repr(fqn)}")
            path = planner_data.get(fqn)
            if not (
                isinstance(path, tuple | list)
                and 0 < len(path) <= _MAX_PATH
                and all(map(_is_part, path))
            ):
                path = (fqn,)
            self.paths.setdefault(fqn, tuple(path))
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
