"""Per-layer views of Megatron's stacked layer tensors, without copying a byte.

Megatron-core stores homogeneous transformer layers under one key with a leading layer axis
(``decoder.layers.mlp.linear_fc1.weight`` is ``[L, …]``). A per-layer entry
(``decoder.layers.{i}.mlp.linear_fc1.weight``) has as chunks the stored chunks' slices at layer
``i`` with the layer axis dropped. A DCP record is a whole torch.save archive whose tensor has
the stored chunk's shape, so each slice needs a record of its own: the archive's zip directory
and ``data.pkl`` are read (by range, never the storage bytes) to find the tensor's storage
member, and each slice becomes a RAW record over that member (its strides and offset taken
from ``data.pkl``). The cost is three batched rounds of small range reads per checkpoint.

The layer count is the metadata's claim: before a list per layer is made it is checked against
the layers the records hold (each record's layers in distinct bytes of its storage), so a
checkpoint claiming 10**10 layers over one record costs what that record costs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from ...catalog.model import Chunk, Encoding, Entry, Record
from ...decoding.pickle_limits import RECORD_LIMITS
from ...decoding.records import (
    Member,
    ZipIndex,
    central_directory,
    check_member_spans,
    end_record,
    local_header_range,
    located,
)
from ...decoding.unpickler import TENSOR_GLOBALS, TensorRef, safe_loads
from ...errors import CheckpointError, CorruptRecordError, FormatError, LimitExceededError
from ...storage import Store
from ..parts.torch_save_files import tensor_record

#: ``layers.`` followed by a name, not an index: the stacked layer axis (``decoder.layers.mlp``).
STACKED = re.compile(r"(?:^|\.)layers\.(?!\d+(?:\.|$))")
#: Bytes read from the end of a record to find its zip directory (torch.save archives have a
#: handful of members: their directory is a few hundred bytes).
_TAIL = 4096
#: Layers a stacked tensor without elements (``[L, 0, …]``) may have: no bytes bound its count
#: (Megatron models have at most a few hundred layers).
MAX_EMPTY_LAYERS = 1 << 16

__all__ = [
    "STACKED",
    "MAX_EMPTY_LAYERS",
    "stacked_name",
    "layer_key",
    "layer_chunks",
    "archive_pickles",
]


def stacked_name(key: str) -> bool:
    """True when ``key`` (a stored key) names a tensor with a leading layer axis."""
    return STACKED.search(key) is not None


def layer_key(key: str, layer: int) -> str:
    """``decoder.layers.mlp.x`` → ``decoder.layers.{layer}.mlp.x`` (the first stacked axis)."""
    match = STACKED.search(key)
    return f"{key[: match.end()]}{layer}.{key[match.end() :]}"


@dataclass(frozen=True, slots=True)
class _Located:
    """A record's tensor: its ``data.pkl`` view and the archive's members (file offsets)."""

    ref: TensorRef
    index: ZipIndex


def layer_chunks(
    storage: Store, stacked: list[Entry]
) -> tuple[dict[str, list[tuple[Chunk, ...]]], dict[str, str]]:
    """For each stacked entry (by key), the chunks of each of its ``shape[0]`` layers: the
    stored chunks' slices, each with a RAW record over the stored bytes; and, by key, why an
    entry has none (a damaged record: the checkpoint still opens, ``verify`` names it)."""
    try:
        return _layer_chunks(storage, stacked), {}
    except CheckpointError:
        pass
    out: dict[str, list[tuple[Chunk, ...]]] = {}
    failed: dict[str, str] = {}
    for entry in stacked:  # one by one, to keep every entry that is intact
        try:
            out.update(_layer_chunks(storage, [entry]))
        except CheckpointError as exc:
            failed[entry.key] = str(exc)
    return out, failed


def _layer_chunks(storage: Store, stacked: list[Entry]) -> dict[str, list[tuple[Chunk, ...]]]:
    records = [
        chunk.record
        for entry in stacked
        for chunk in entry.chunks
        if chunk.record is not None and chunk.numel
    ]
    located = _locate(storage, records)
    out: dict[str, list[tuple[Chunk, ...]]] = {}
    for entry in stacked:
        layers: list[list[Chunk]] = [[] for _ in range(_layer_count(entry, located))]
        for chunk in entry.chunks:
            for layer, piece in _slices(entry, chunk, located):
                layers[layer].append(piece)
        out[entry.key] = [tuple(chunks) for chunks in layers]
    return out


def _layer_count(entry: Entry, located: dict[int, _Located]) -> int:
    """``entry.shape[0]`` once checked against the bytes: every chunk lies in the shape, every
    record holds its chunk's layers in distinct bytes of its storage, and a tensor with
    elements claims no more layers than its records hold (each layer needs one). Nothing the
    claimed count says is allocated or looped over before that."""
    held = 0
    for chunk in entry.chunks:
        _check_box(entry, chunk)
        found = _found(chunk, located)
        if found is not None:
            _check_layers_held(entry, chunk, found)
            held += chunk.sizes[0]
    layers = entry.shape[0]
    elements_per_layer = math.prod(entry.shape[1:])
    if elements_per_layer and layers > held:
        raise FormatError(
            f"{entry.key!r}: shape {list(entry.shape)} claims {layers} layers, more than its "
            f"records hold ({held} layer slices in all)"
        )
    if not elements_per_layer and layers > MAX_EMPTY_LAYERS:
        raise LimitExceededError(
            f"{entry.key!r}: shape {list(entry.shape)} claims {layers} layers without "
            f"elements, more than the {MAX_EMPTY_LAYERS} allowed"
        )
    return layers


def _check_box(entry: Entry, chunk: Chunk) -> None:
    """A chunk has the tensor's dimensions and lies inside its layers."""
    if (
        len(chunk.offsets) != len(entry.shape)
        or len(chunk.sizes) != len(entry.shape)
        or chunk.offsets[0] + chunk.sizes[0] > entry.shape[0]
    ):
        raise FormatError(
            f"{entry.key!r}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} is "
            f"outside the shape {list(entry.shape)}"
        )


def _found(chunk: Chunk, located: dict[int, _Located]) -> _Located | None:
    """The located tensor of ``chunk``'s record (None when the chunk holds no elements)."""
    record = chunk.record
    return located.get(id(record)) if record is not None and chunk.numel else None


def _check_layers_held(entry: Entry, chunk: Chunk, found: _Located) -> None:
    """The record's tensor has the chunk's shape, fits in its storage and steps to new
    elements from layer to layer (a layer stride of 0 would let one element stand for any
    number of layers): the chunk's layer count is then at most its storage's element count."""
    record = chunk.record
    source = f"{record.file} @{record.offset}"
    ref = found.ref
    if tuple(ref.shape) != tuple(chunk.sizes):
        raise FormatError(
            f"{source}: {entry.key!r} record holds shape {list(ref.shape)}, the metadata says "
            f"{list(chunk.sizes)}"
        )
    tensor_record(entry.key, ref, found.index, source)  # the whole view fits in its storage
    if chunk.sizes[0] > 1 and ref.stride[0] < 1:
        raise CorruptRecordError(
            f"{source}: {entry.key!r} has a layer stride of {ref.stride[0]}: its "
            f"{chunk.sizes[0]} layers would share their elements"
        )


def _slices(
    entry: Entry, chunk: Chunk, located: dict[int, _Located]
) -> Iterator[tuple[int, Chunk]]:
    """``(layer, chunk)`` for each layer ``chunk`` spans (checked by :func:`_layer_count`):
    its box without the layer axis and a RAW record over the layer's elements."""
    first, count = chunk.offsets[0], chunk.sizes[0]
    record = chunk.record
    found = _found(chunk, located)
    for step in range(count):
        piece = None
        if found is not None:
            ref = found.ref
            sliced = TensorRef(
                ref.storage,
                ref.storage_offset + step * ref.stride[0],
                ref.shape[1:],
                ref.stride[1:],
                ref.dtype,
            )
            source = f"{record.file} @{record.offset}"
            piece = tensor_record(entry.key, sliced, found.index, source)
        yield first + step, Chunk(chunk.offsets[1:], chunk.sizes[1:], piece, chunk.rank)


def _locate(storage: Store, records: Iterable[Record]) -> dict[int, _Located]:
    """Each TORCH_SAVE record's tensor view and storage member, by ``id(record)``."""
    out = {}
    records = list(records)
    # chunks of one shape pickle to the same bytes: decode each distinct data.pkl once (the
    # stand-ins it builds are immutable)
    decoded: dict[bytes, TensorRef] = {}
    for record, (index, data) in zip(records, archive_pickles(storage, records), strict=True):
        ref = decoded.get(data)
        if ref is None:
            source = f"{storage.describe(record.file)} @{record.offset}"
            ref = safe_loads(data, allow=TENSOR_GLOBALS, source=source, limits=RECORD_LIMITS)
            if not isinstance(ref, TensorRef) or not ref.shape:
                raise CorruptRecordError(f"{source}: the record holds no stacked tensor")
            decoded[data] = ref
        out[id(record)] = _Located(ref, index)
    return out


def archive_pickles(storage: Store, records: list[Record]) -> list[tuple[ZipIndex, bytes]]:
    """For each TORCH_SAVE record (a torch.save archive inside a larger file): its members,
    located in that file, and its ``data.pkl`` bytes; three batched rounds of range reads (the
    archives' last bytes, the members' local headers, the pickles), no storage bytes."""
    if any(r.encoding is not Encoding.TORCH_SAVE or r.transform for r in records):
        raise FormatError("only plain torch.save records (no zstd) can be indexed here")
    tails = storage.read_ranges(
        [(r.file, max(r.offset, r.offset + r.length - _TAIL), r.offset + r.length) for r in records]
    )
    listed = []
    for record, tail in zip(records, tails, strict=True):
        source = f"{storage.describe(record.file)} @{record.offset}"
        start = max(0, record.length - _TAIL)
        count, offset, size = end_record(tail, start, source)
        if offset < start or offset + size > record.length:
            raise CorruptRecordError(f"{source}: zip directory outside the record's last bytes")
        members = central_directory(tail[offset - start : offset - start + size], count, source)
        listed.append(([m for m in members if _needed(m[0])], offset))
    heads = iter(
        storage.read_ranges(
            [
                (r.file, r.offset + begin, r.offset + end)
                for r, (members, _) in zip(records, listed, strict=True)
                for name, local, _ in members
                for begin, end in [local_header_range(local, name)]
            ]
        )
    )
    indexes = [
        _index(storage, record, members, directory, heads)
        for record, (members, directory) in zip(records, listed, strict=True)
    ]
    wanted = []
    for record, index in zip(records, indexes, strict=True):
        source = f"{storage.describe(record.file)} @{record.offset}"
        data_pkl = index.member("data.pkl", source)
        order = index.members.get(index.prefix + "byteorder", Member(data_pkl.offset, 0, 0))
        wanted += [
            (record.file, data_pkl.offset, data_pkl.offset + data_pkl.size),
            (record.file, order.offset, order.offset + order.size),
        ]
    blobs = storage.read_ranges(wanted)
    out = []
    for position, (record, index) in enumerate(zip(records, indexes, strict=True)):
        if blobs[2 * position + 1] not in (b"", b"little"):
            raise CorruptRecordError(
                f"{storage.describe(record.file)} @{record.offset}: big-endian records are not "
                "supported"
            )
        out.append((index, blobs[2 * position]))
    return out


def _needed(name: str) -> bool:
    """The members a record is read through: its pickle, byte order and storages."""
    return name.endswith(("/data.pkl", "/byteorder")) or "/data/" in name


def _index(
    storage: Store, record: Record, members: list, directory: int, heads: Iterator[bytes]
) -> ZipIndex:
    """A record's zip members with their data offsets in the record's file (each agreeing with
    its local header, none overlapping another or the directory at ``directory``)."""
    source = f"{storage.describe(record.file)} @{record.offset}"
    inside: dict[str, Member] = {}
    for name, local, listed_member in members:
        member = located(listed_member, next(heads), local, name, source)
        if member.offset + member.size > record.length:
            raise CorruptRecordError(f"{source}: zip member {name!r} extends past the record")
        inside[name] = member
    check_member_spans(inside, {name: local for name, local, _ in members}, directory, source)
    found = {
        name: replace(member, offset=record.offset + member.offset)
        for name, member in inside.items()
    }
    pickles = [name for name in found if name.endswith("data.pkl")]
    if len(pickles) != 1:
        raise CorruptRecordError(f"{source}: expected one data.pkl, found {len(pickles)}")
    return ZipIndex(record.file, pickles[0][: -len("data.pkl")], found)
