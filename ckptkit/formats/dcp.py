"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``__R_K.distcp`` files.

Reads ``.metadata`` (or the rank-local ``__R.metadata`` set written with
``use_collectives=False``) through the safe unpickler, with plain stand-ins for torch's classes,
and describes every item as entries → chunks → records. Never reads a data file.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

from ..catalog import Catalog, Chunk, Encoding, Entry, Record
from ..dtypes import DType
from ..errors import CorruptRecordError, FormatError, MissingFileError, UnsafePathError
from ..pickle_limits import METADATA_LIMITS
from ..storage import Storage
from ..unpickler import COMMON_GLOBALS, paused_gc, safe_loads
from .detection import Detection

NAME = "dcp"
METADATA = ".metadata"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_TRANSFORMS = {"stream.zstd/1": "zstd"}


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
        self.transform = (
            "+".join(_TRANSFORMS.get(d, str(d)) for d in descriptors) if descriptors else None
        )
        self.encoding = Encoding.TORCH_SAVE
        self.name = self.stride = self.crc32 = None
        self.storage_offset = 0


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


def _memory_format(value: int) -> str:
    names = ("contiguous_format", "channels_last", "preserve_format")
    if not isinstance(value, int) or not 0 <= value < len(names):
        raise CorruptRecordError(f"unknown memory-format code {value!r}")
    return names[value]


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


#: Where OLMo ("torch_new") and OLMo-core put the DCP directory inside a step directory.
SUBDIRS = ("model_and_optim",)


def detect(storage: Storage) -> Detection | None:
    """DCP when ``.metadata`` (or rank-local ``__R.metadata``) is here or in ``model_and_optim/``."""
    if storage.exists(METADATA):
        return Detection(NAME, storage, [f"found {METADATA}"])
    for sub in SUBDIRS:
        if storage.exists(f"{sub}/{METADATA}"):
            return Detection(NAME, storage.child(sub), [f"found {sub}/{METADATA}"])
    try:
        names = storage.listdir()
    except MissingFileError:
        return None
    rank_files = sorted(n for n in names if _RANK_METADATA.match(n))
    if rank_files:
        return Detection(NAME, storage, [f"found rank-local {', '.join(rank_files[:4])}"])
    data_files = sorted(n for n in names if _DATA_FILE.match(n))
    if data_files:  # describe() then says that .metadata is missing
        return Detection(NAME, storage, [f"found {data_files[0]} but no {METADATA}"])
    return None


def describe(storage: Storage) -> Catalog:
    """The catalog of a DCP directory, from its metadata file(s) alone."""
    if storage.exists(METADATA):
        sources = [(METADATA, None)]
    else:
        sources = sorted(
            (
                (name, int(m.group(1)))
                for name in storage.listdir()
                if (m := _RANK_METADATA.match(name))
            ),
            key=lambda item: item[1],
        )
        if not sources:
            raise MissingFileError(
                f"{storage.describe(METADATA)}: no such file: the .distcp data files are "
                "there but the metadata is not (an interrupted save, or an incomplete copy)"
            )
    builder = _CatalogBuilder(storage)
    with paused_gc():
        for name, rank in sources:
            builder.add(name, _load_metadata(storage, name), rank)
        return builder.finish()


def _load_metadata(storage: Storage, name: str) -> _Metadata:
    source = storage.describe(name)
    with storage.open_sequential(name, max_bytes=METADATA_LIMITS.max_bytes) as stream:
        metadata = safe_loads(stream, allow=ALLOWED_GLOBALS, source=source, limits=METADATA_LIMITS)
    if not isinstance(metadata, _Metadata) or not isinstance(
        metadata.get("state_dict_metadata"), dict
    ):
        raise FormatError(f"{source}: not a DCP Metadata object ({type(metadata).__name__})")
    return metadata


class _CatalogBuilder:
    """Accumulates entries from one or more metadata files (rank-local sets are unioned)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.chunks: dict[str, list[Chunk]] = {}
        self.kinds: dict[str, tuple[str, DType | None, tuple[int, ...] | None]] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.files: dict[str, int | None] = {}  # data file → writing rank
        self.info: dict[str, Any] = {"metadata_files": []}

    def add(self, name: str, metadata: _Metadata, metadata_rank: int | None) -> None:
        source = self.storage.describe(name)
        self.info["metadata_files"].append(name)
        self.info.setdefault("version", _scalar(metadata.get("version")))
        storage_meta = metadata.get("storage_meta")
        if isinstance(storage_meta, _StorageMeta) and "save_id" not in self.info:
            self.info["checkpoint_id"] = _scalar(storage_meta.get("checkpoint_id"))
            self.info["save_id"] = _scalar(storage_meta.get("save_id"))
        planner_data = metadata.get("planner_data")
        if not isinstance(planner_data, dict):
            planner_data = {}
        tensor_chunks: dict[str, list[Chunk]] = {}  # this file's chunks, by key

        for fqn, item in metadata.get("state_dict_metadata").items():
            if not isinstance(fqn, str):
                raise FormatError(f"{source}: non-string key {fqn!r}")
            path = planner_data.get(fqn)
            if not (isinstance(path, tuple | list) and path and all(map(_is_part, path))):
                path = (fqn,)
            self.paths.setdefault(fqn, tuple(path))
            if isinstance(item, _BytesStorageMetadata):
                self._kind(fqn, ("object", None, None), source)
            elif isinstance(item, _TensorStorageMetadata):
                properties = item.get("properties")
                dtype = properties.dtype if isinstance(properties, _TensorProperties) else None
                if not isinstance(dtype, DType):
                    raise FormatError(f"{source}: tensor {fqn!r} has no known dtype ({dtype!r})")
                shape = item.get("size")
                if not _is_box(shape, None):
                    raise FormatError(f"{source}: tensor {fqn!r} has a malformed size {shape!r}")
                self._kind(fqn, ("tensor", dtype, shape), source)
                chunks = item.get("chunks") or []
                for chunk in chunks:
                    if not isinstance(chunk, _ChunkStorageMetadata) or not (
                        _is_box(chunk.offsets, len(shape)) and _is_box(chunk.sizes, len(shape))
                    ):
                        raise FormatError(f"{source}: tensor {fqn!r} has a malformed chunk")
                tensor_chunks[fqn] = chunks
            else:
                raise FormatError(
                    f"{source}: {fqn!r} has unknown storage metadata {type(item).__name__}"
                )
            self.chunks.setdefault(fqn, [])

        storage_data = metadata.get("storage_data") or {}
        if not isinstance(storage_data, dict):
            raise FormatError(f"{source}: storage_data is not a mapping")
        ranks: dict[str, int | None] = {}
        by_offsets: dict[str, dict[tuple[int, ...], Chunk]] = {}
        for index, info in storage_data.items():
            if not isinstance(index, _MetadataIndex) or not isinstance(info, _StorageInfo):
                raise FormatError(f"{source}: malformed storage_data entry")
            fqn = index.fqn
            if (
                type(fqn) is not str
                or not isinstance(info.file, str)
                or type(info.offset) is not int
                or type(info.length) is not int
                or info.offset < 0
                or info.length < 0
            ):
                raise FormatError(f"{source}: {fqn!r} has a malformed storage record")
            rank = ranks.get(info.file, -1)
            if rank == -1:
                _check_file_name(self.storage, source, fqn, info.file)
                rank = ranks[info.file] = _rank(info.file, metadata_rank)
                self.files.setdefault(info.file, rank)
            if index.offset is None:  # an object
                if self.kinds.get(fqn, ("",))[0] != "object":
                    raise FormatError(f"{source}: storage record for unknown object {fqn!r}")
                self.chunks[fqn].append(Chunk((), (), info, rank))
                continue
            chunks = tensor_chunks.get(fqn)
            if chunks is None:
                raise FormatError(f"{source}: storage record for unknown tensor {fqn!r}")
            position = index.index
            if (
                type(position) is int
                and 0 <= position < len(chunks)
                and chunks[position].offsets == index.offset
            ):
                chunk = chunks[position]
            else:  # no usable index hint: look the chunk up by its offsets
                if fqn not in by_offsets:
                    by_offsets[fqn] = {c.offsets: c for c in chunks}
                offset = index.offset
                offset = tuple(offset) if isinstance(offset, list | tuple) else None
                chunk = (
                    by_offsets[fqn].get(offset)
                    if _is_box(offset, len(self.kinds[fqn][2]))
                    else None
                )
                if chunk is None:
                    raise FormatError(
                        f"{source}: {fqn!r} has a record for no chunk "
                        f"({reprlib.repr(index.offset)})"
                    )
            chunk.record, chunk.rank = info, rank
            # SerializationFormat.SAFETENSORS: the record is the file's safetensors blob and its
            # length is the chunk's element bytes, which no torch.save zip record can be.
            nbytes = math.prod(chunk.sizes) * self.kinds[fqn][1].itemsize
            if info.transform is None and info.length == nbytes:
                info.encoding, info.name = Encoding.SAFETENSORS, fqn

        for fqn, chunks in tensor_chunks.items():
            for chunk in chunks:
                if chunk.record is None:
                    if 0 not in chunk.sizes:  # an empty chunk is listed but never written
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

    def finish(self) -> Catalog:
        entries = {}
        for fqn, chunks in self.chunks.items():
            kind, dtype, shape = self.kinds[fqn]
            entries[fqn] = Entry(fqn, self.paths[fqn], kind, tuple(chunks), dtype, shape)
        return Catalog(NAME, entries, list(self.files), self.info)


def _check_file_name(storage: Storage, source: str, fqn: str, name: str) -> None:
    """Refuse a storage record naming a file outside the checkpoint, naming the entry."""
    try:
        storage.path(name)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{source}: {fqn!r} has a record in {name!r}: {exc}") from None


def _is_box(value: Any, ndim: int | None) -> bool:
    """A tuple of non-negative ints (of length ``ndim`` when given). Called for every chunk, so
    it leans on C builtins: a float or a string anywhere makes the sum fail to be an int."""
    if type(value) is not tuple or (ndim is not None and len(value) != ndim):
        return False
    try:
        return not value or (type(sum(value)) is int and min(value) >= 0)
    except TypeError:
        return False


def _scalar(value: Any) -> Any:
    """A metadata field kept for display: a string or number, else dropped (it could be any
    structure the pickle built)."""
    return value if isinstance(value, str | int | float) else None


def _is_part(part: Any) -> bool:
    """A step of a planner_data path: a dict key (str) or a list index (int)."""
    return type(part) is str or type(part) is int


def _rank(file: str, default: int | None) -> int | None:
    """The writing rank, from a ``__R_K.distcp`` name (or the rank-local metadata file)."""
    match = _DATA_FILE.match(file)
    return int(match.group(1)) if match else default
