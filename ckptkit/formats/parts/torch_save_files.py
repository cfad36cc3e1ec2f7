"""torch.save files as catalog entries, shared by every adapter whose files are torch.save
files (``torch_save``, per-rank files, OLMo local, OLMo-core 0.x side files).

Described lazily: each file's zip directory and its ``data.pkl`` (or, in a pre-1.6 non-zip
file, its main pickle and storage headers, see :mod:`.legacy_torch_save`) are read by range
(never a storage's bytes) and unpickled safely. Tensors become RAW records over their storages'
bytes; every other leaf becomes an object entry read back from the same pickle (PICKLE_LEAF).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ...catalog.model import Chunk, Encoding, Entry, Record, pickle_leaf
from ...catalog.output_names import group_of_file
from ...decoding.records import Member, ZipIndex, read_zip_indexes
from ...decoding.tensor_like import tensor_class
from ...decoding.unpickler import OBJECT_GLOBALS, TensorRef, safe_loads
from ...errors import CorruptRecordError, FormatError
from ...storage import Store
from .legacy_torch_save import MAGIC_PREFIX, LegacyIndex, Span, is_legacy_head, read_legacy

#: Names of torch.save files in a directory (a file the user names is recognised by content).
SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".jit")
ZIP_MAGIC = b"PK\x03\x04"
#: Pre-1.6 torch.save files are bare pickles, the first a 10-byte magic number (protocol 2).
LEGACY_MAGIC = MAGIC_PREFIX


def group_of(name: str) -> str:
    """The group a file in a directory holds (:func:`ckptkit.output_names.group_of_file`), or
    the whole name when it has no checkpoint suffix."""
    group = group_of_file(name)
    return name if group is None else group


def probe(storage: Store, sizes: Mapping[str, int]) -> dict[str, str | None]:
    """Each file's kind by its first bytes: ``"zip"``, ``"legacy"`` (pre-1.6) or None."""
    names = [name for name, size in sizes.items() if size >= 4]
    heads = storage.read_ranges([(name, 0, min(sizes[name], 16)) for name in names])
    kinds: dict[str, str | None] = dict.fromkeys(sizes)
    for name, head in zip(names, heads, strict=True):
        if head.startswith(ZIP_MAGIC):
            kinds[name] = "zip"
        elif is_legacy_head(head):
            kinds[name] = "legacy"
    return kinds


def directory_files(storage: Store) -> dict[str, int]:
    """The torch.save files (zips or pre-1.6) directly in a directory (``*.pt``, ``*.pth``,
    ``*.bin``, ``*.ckpt``, ``*.pth.tar``, ``*.tar``, ``*.jit``) and their sizes."""
    listing = storage.listdir()
    candidates = {n: s for n, s in sorted(listing.items()) if n.endswith(SUFFIXES) and s >= 0}
    kinds = probe(storage, candidates)
    return {name: size for name, size in candidates.items() if kinds[name] is not None}


# --------------------------------------------------------------------------------------------
# Describing the pickled structure.


def describe_files(
    storage: Store, groups: Mapping[str, str], sizes: Mapping[str, int] | None = None
) -> dict[str, Entry]:
    """Entries of torch.save zips; ``groups`` maps each file to the group its leaves go under."""
    files = list(groups)
    if not files:
        return {}
    pickled = load_pickles(storage, files, sizes)
    entries: dict[str, Entry] = {}
    owners: dict[str, str] = {}  # key → the file it came from, for clash messages
    for file in files:
        for entry in pickle_entries(pickled[file], groups[file]):
            if entry.key in owners:
                raise FormatError(
                    f"{pickled[file].source}: key {entry.key!r} is also in {owners[entry.key]}"
                )
            owners[entry.key] = file
            entries[entry.key] = entry
    return entries


#: Where a torch.save file's storages lie: a zip's members, or a pre-1.6 file's storage records.
StorageIndex = ZipIndex | LegacyIndex


def storage_bytes(index: StorageIndex, key: str, source: str) -> Member | Span:
    """Where storage ``key``'s bytes are in the file ``index`` describes (offset, size and the
    CRC-32 the format stores, if any)."""
    if isinstance(index, ZipIndex):
        return index.member(f"data/{key}", source)
    return index.storage(key, source)


@dataclass(frozen=True, slots=True)
class Pickled:
    """One torch.save file's main pickle (a zip's ``data.pkl``), decoded safely, and where its
    pieces lie in the file."""

    file: str
    value: Any
    index: StorageIndex
    offset: int  # of the pickle in the file
    length: int
    source: str

    @property
    def crc32(self) -> int | None:
        """The CRC-32 of the pickle's bytes, when the format stores one (zips)."""
        if isinstance(self.index, ZipIndex):
            return self.index.member("data.pkl", self.source).crc32
        return None


def load_pickles(
    storage: Store,
    files: list[str],
    sizes: Mapping[str, int | None] | None = None,
    allow: Mapping[str, Any] = OBJECT_GLOBALS,
) -> dict[str, Pickled]:
    """Each torch.save file's decoded main pickle (unknown globals as placeholders), reading
    zip directories, pre-1.6 storage headers and pickles only, in batched rounds."""
    if sizes is None or any(sizes.get(file) is None for file in files):
        sizes = {**(sizes or {}), **storage.sizes(files)}
    kinds = probe(storage, {file: sizes[file] for file in files if sizes[file] is not None})
    legacy = [file for file in files if kinds.get(file) == "legacy"]
    pickled = {}
    for file, found in read_legacy(storage, legacy, sizes, allow).items():
        source = storage.describe(file)
        pickled[file] = Pickled(file, found.value, found.index, found.offset, found.length, source)
    zips = [file for file in files if file not in pickled]
    pickled.update(_load_zip_pickles(storage, zips, sizes, allow))
    return {file: pickled[file] for file in files}


def _load_zip_pickles(
    storage: Store, files: list[str], sizes: Mapping[str, int | None], allow: Mapping[str, Any]
) -> dict[str, Pickled]:
    """:func:`load_pickles` for torch.save zips."""
    if not files:
        return {}
    indexes = read_zip_indexes(storage, files, sizes)
    wanted = []  # (file, start, end) of each file's data.pkl, then of its byteorder record
    for file in files:
        index = indexes[file]
        data_pkl = index.member("data.pkl", storage.describe(file))
        order = index.members.get(index.prefix + "byteorder", Member(data_pkl.offset, 0, 0))
        wanted += [
            (file, data_pkl.offset, data_pkl.offset + data_pkl.size),
            (file, order.offset, order.offset + order.size),
        ]
    blobs = storage.read_ranges(wanted)
    pickled = {}
    for position, file in enumerate(files):
        source = storage.describe(file)
        data, order = blobs[2 * position], blobs[2 * position + 1]
        if order not in (b"", b"little"):
            raise CorruptRecordError(f"{source}: big-endian torch.save files are not supported")
        value = safe_loads(data, allow=allow, source=source, unknown="opaque")
        offset = wanted[2 * position][1]
        pickled[file] = Pickled(file, value, indexes[file], offset, len(data), source)
    return pickled


def pickle_entries(pickled: Pickled, group: str, exclude: Collection[str] = ()) -> Iterator[Entry]:
    """An entry per leaf of a decoded file, under ``group``: tensors as RAW records, other
    leaves as PICKLE_LEAF (a placeholder of a tensor class marked with its ``tensor_class``);
    top-level keys in ``exclude`` are left out."""
    for inner, leaf in leaves(pickled.value):
        if inner and inner[0] in exclude:
            continue
        path = (group, *inner)
        key = ".".join(map(str, path))
        if isinstance(leaf, TensorRef):
            yield tensor_entry(key, path, leaf, pickled.index, pickled.source)
        else:
            record = pickle_leaf(
                pickled.file, pickled.offset, pickled.length, inner, crc32=pickled.crc32
            )
            chunks = (Chunk((), (), record),)
            yield Entry(key, path, "object", chunks, tensor_class=tensor_class(leaf))


def leaves(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs as torch's DCP flattening (``traverse_state_dict``) finds them.

    Dicts are walked (keys as ``str``); lists are walked only when they hold tensors or dicts,
    else they are one leaf. Unlike DCP, tuples are walked like lists (``nest`` rebuilds them as
    lists) and an empty dict is kept as a leaf rather than dropped.
    """
    if isinstance(value, Mapping):
        if not value:
            yield path, value
        for key, item in value.items():
            yield from leaves(item, (*path, str(key)))
    elif isinstance(value, (list, tuple)) and _walked(value):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path, value


def _walked(items: list | tuple) -> bool:
    """True when a list holds a tensor or a dict, directly or in a nested list (DCP's rule)."""
    return any(
        isinstance(item, (TensorRef, Mapping))
        or (isinstance(item, (list, tuple)) and _walked(item))
        for item in items
    )


def tensor_entry(
    key: str, path: tuple[str | int, ...], ref: TensorRef, index: StorageIndex, source: str
) -> Entry:
    """A tensor as one chunk whose RAW record covers exactly the bytes its view spans."""
    record = tensor_record(key, ref, index, source)
    return Entry(
        key,
        path,
        "tensor",
        (Chunk((0,) * len(ref.shape), ref.shape, record),),
        ref.dtype,
        ref.shape,
    )


def tensor_record(key: str, ref: TensorRef, index: StorageIndex, source: str) -> Record | None:
    """The RAW record of the bytes ``ref``'s view spans in its storage (None when the tensor
    has no elements); checks that the view fits in the storage."""
    member = storage_bytes(index, ref.storage.key, source)
    dt, shape, stride = ref.dtype, ref.shape, ref.stride
    storage_dtype = ref.storage.dtype
    if ref.storage.numel * storage_dtype.itemsize > member.size:
        raise CorruptRecordError(
            f"{source}: {key!r}: storage {ref.storage.key} has {member.size} bytes, the pickle "
            f"says {ref.storage.numel} {storage_dtype.name} elements"
        )
    available = ref.storage.numel * storage_dtype.itemsize // dt.itemsize  # in elements of dt
    if (
        not all(type(n) is int and n >= 0 for n in shape)
        or not all(type(s) is int for s in stride)
        or len(stride) != len(shape)
    ):
        raise CorruptRecordError(
            f"{source}: {key!r} has a malformed shape {shape!r} or strides {stride!r}"
        )
    record = None
    if math.prod(shape):
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if (
            ref.storage_offset < 0
            or min(stride, default=0) < 0
            or ref.storage_offset + extent > available
        ):
            raise CorruptRecordError(
                f"{source}: {key!r} (shape {list(shape)}, strides {list(stride)}, offset "
                f"{ref.storage_offset}) does not fit in storage {ref.storage.key} of "
                f"{available} elements"
            )
        whole = ref.storage_offset == 0 and extent * dt.itemsize == member.size
        record = Record(
            index.file,
            member.offset + ref.storage_offset * dt.itemsize,
            extent * dt.itemsize,
            Encoding.RAW,
            stride=stride,
            crc32=member.crc32 if whole else None,  # a zip's CRC covers the whole storage
        )
    return record


__all__ = [
    "LEGACY_MAGIC",
    "SUFFIXES",
    "ZIP_MAGIC",
    "Pickled",
    "StorageIndex",
    "describe_files",
    "directory_files",
    "group_of",
    "leaves",
    "load_pickles",
    "pickle_entries",
    "probe",
    "storage_bytes",
    "tensor_entry",
    "tensor_record",
]
