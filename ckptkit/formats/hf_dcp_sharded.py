"""Per-rank safetensors written by torch's ``HuggingFaceStorageWriter(save_distributed=True)``.

Each rank writes ``shard-{rank+1:05d}-model-0000i-of-0000N.safetensors`` (into ``sharded/`` when
consolidation is on, next to the consolidated ``model-…`` files the safetensors adapter reads).
Every tensor in such a file is the rank's local box of a global tensor; the header's
``__metadata__["DCP_SHARDING_INFO"]`` (JSON ``{fqn: {"saved_offsets": [...]}}``) gives its
global offsets. The shards do not record global shapes: when this is the ``sharded/`` directory
of a consolidated save, they come from the consolidated files' headers (found through the parent's
``model.safetensors.index.json``); otherwise, as torch's ``HuggingFaceStorageReader`` does, each is
the largest ``offset + size`` per dimension over all shards. Either way the boxes must tile the
shape exactly, and shard numbers must run 1..N: a missing shard is an error naming it (except the
last one of an unconsolidated save, which nothing else records). Keys are ``<group>.<fqn>``
(group ``model`` from the file names), as for the consolidated files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from ..catalog.coverage import check_chunks
from ..catalog.model import (
    Catalog,
    CatalogBuilder,
    Chunk,
    Encoding,
    Entry,
    Facts,
    Record,
    distinct_chunks,
)
from ..decoding.records import SafetensorsHeader, safetensors_file_headers
from ..dtypes import DType
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..limits import first_missing
from ..storage import Store
from .detection import Detection, file_location

__all__ = ["NAME", "SHARDED_DIR", "SHARDING_INFO", "INDEX_SUFFIX", "detect", "describe"]

NAME = "hf_dcp_sharded"
SHARDED_DIR = "sharded"
SHARDING_INFO = "DCP_SHARDING_INFO"
INDEX_SUFFIX = ".safetensors.index.json"
_SHARD = re.compile(r"^shard-(\d+)-(.+)-\d+-of-\d+\.safetensors$")


def detect(storage: Store) -> Detection | None:
    """``shard-*-of-*.safetensors`` files whose header carries ``DCP_SHARDING_INFO``, in the
    directory or, when it holds no safetensors of its own, in its ``sharded/``."""
    if file_location(storage) is not None:
        return None
    try:
        listing = storage.listdir()
    except MissingFileError:
        return None
    shards = _shards(listing)
    if not shards and listing.get(SHARDED_DIR) == -1:
        if any(name.endswith(".safetensors") for name in listing):
            return None  # the consolidated files are the checkpoint here
        storage = storage.child(SHARDED_DIR)
        shards = _shards(storage.listdir())
    if not shards:
        return None
    first = next(iter(shards))
    (header,) = safetensors_file_headers(storage, [first]).values()
    if SHARDING_INFO not in header.metadata:
        return None
    return Detection(
        NAME, storage, [f"{first} … ({len(shards)} rank files)", f"{SHARDING_INFO} in headers"]
    )


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of a directory of per-rank shard files; reads headers only."""
    listing = storage.listdir()
    shards = _shards(listing)
    if not shards:
        raise FormatError(f"{storage.describe()}: no shard-*-of-*.safetensors files")
    numbers = sorted({rank for rank, _ in shards.values()})
    if numbers != list(range(len(numbers))):
        (gap,) = first_missing(numbers, numbers[-1] + 1, limit=1)
        example = next(iter(shards))
        name = f"shard-{gap + 1:05d}-" + example.split("-", 2)[2]
        raise MissingFileError(f"{storage.describe(name)}: missing (rank {gap}'s shard)")
    headers = safetensors_file_headers(storage, list(shards))
    consolidated = _consolidated_shapes(storage)
    boxes: dict[str, list[Chunk]] = {}
    kinds: dict[str, tuple[DType, str]] = {}  # key → dtype, the first file holding it
    for file, header in headers.items():
        source = storage.describe(file)
        rank, group = shards[file]
        offsets_of = _sharding_info(header, source)
        for name, (dt, shape, begin, end) in header.tensors.items():
            key = f"{group}.{name}"
            offsets = offsets_of.get(name)
            if offsets is None or len(offsets) != len(shape):
                raise FormatError(
                    f"{source}: {SHARDING_INFO} gives {name!r} offsets {offsets!r} for its "
                    f"{len(shape)}-d local shape"
                )
            dt0, first = kinds.setdefault(key, (dt, file))
            if dt0 != dt:
                raise FormatError(f"{source}: {name!r} is {dt.name}, {dt0.name} in {first}")
            if end - begin != math.prod(shape) * dt.itemsize:
                raise CorruptRecordError(f"{source}: {name!r} byte range does not fit its shape")
            if not 0 <= begin <= end or header.data_start + end > listing[file]:
                raise CorruptRecordError(f"{source}: {name!r} bytes lie outside the file")
            record = (
                Record(file, header.data_start + begin, end - begin, Encoding.RAW)
                if end > begin
                else None
            )
            boxes.setdefault(key, []).append(Chunk(tuple(offsets), shape, record, rank))
    entries = {}
    for key, chunks in boxes.items():
        dt, first = kinds[key]
        shape = _global_shape(key, chunks, storage.describe(first), consolidated.get(key))
        path = tuple(key.split(".", 1))
        entries[key] = Entry(key, path, "tensor", tuple(chunks), dt, shape)
    builder = CatalogBuilder(NAME)
    builder.add_files(headers)
    builder.add_all(entries.values(), source=storage.describe())
    metadata = {file: header.metadata for file, header in headers.items()}
    return builder.build(Facts(world_size=len(numbers), header_metadata=metadata))


def _shards(listing: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    """Shard file → (rank, group), in rank order."""
    found = {}
    for name, size in listing.items():
        match = _SHARD.match(name)
        if match and size >= 0:
            found[name] = (int(match.group(1)) - 1, match.group(2))
    return dict(sorted(found.items(), key=lambda item: (item[1][0], item[0])))


def _sharding_info(header: SafetensorsHeader, source: str) -> dict[str, list[int]]:
    """``{fqn: saved_offsets}`` from the header's ``DCP_SHARDING_INFO``."""
    try:
        info = json.loads(header.metadata[SHARDING_INFO])
        return {
            name: [int(o) for o in spec["saved_offsets"]]
            for name, spec in info.items()
            if isinstance(spec, dict)
        }
    except KeyError:
        raise FormatError(f"{source}: no {SHARDING_INFO} in the header's __metadata__") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"{source}: unreadable {SHARDING_INFO}: {exc}") from exc


def _consolidated_shapes(storage: Store) -> dict[str, tuple[int, ...]]:
    """``{<group>.<fqn>: shape}`` from the consolidated files beside a ``sharded/`` directory
    (through ``<group>.safetensors.index.json``); empty when there are none."""
    parent, name = storage.parent()
    if name != SHARDED_DIR:
        return {}
    try:
        indexes = [n for n in parent.listdir() if n.endswith(INDEX_SUFFIX)]
    except MissingFileError:
        return {}
    files: dict[str, str] = {}  # consolidated file → group
    for index in indexes:
        source = parent.describe(index)
        try:
            weight_map = json.loads(parent.read_file(index))["weight_map"]
            files.update(dict.fromkeys(weight_map.values(), index[: -len(INDEX_SUFFIX)]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{source}: not a safetensors index: {exc}") from exc
    shapes = {}
    for file, header in safetensors_file_headers(parent, sorted(files)).items():
        for fqn, (_, shape, _, _) in header.tensors.items():
            shapes[f"{files[file]}.{fqn}"] = shape
    return shapes


def _global_shape(
    key: str, chunks: list[Chunk], source: str, known: tuple[int, ...] | None
) -> tuple[int, ...]:
    """The consolidated shape (``known``) or else the smallest shape holding every box; the
    distinct boxes must fill it exactly."""
    ndims = {len(c.sizes) for c in chunks}
    if len(ndims) != 1:
        raise FormatError(f"{source}: {key!r} has boxes of different ranks {sorted(ndims)}")
    shape = known
    if shape is None:
        shape = tuple(
            max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes))
        )
    pieces = "the shards' boxes (a missing or overlapping shard?)"
    check_chunks(key, shape, distinct_chunks(chunks), source=source, pieces=pieces)
    return shape
