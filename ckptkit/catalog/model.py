"""The format-free description of a checkpoint: entries → chunks → byte records.

Format adapters (``ckptkit.formats``) produce a :class:`Catalog`; every operation (tables,
reading, unsharding, diffing) consumes one and never needs to know the on-disk format.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Literal

from ..dtypes import DType
from ..errors import FormatError, TensorsLeftAsObjectsError
from .keys import MODEL_GROUP, model_root

__all__ = [
    "Encoding",
    "Record",
    "distinct_chunks",
    "pickle_leaf",
    "leaf_path",
    "shared",
    "Chunk",
    "Entry",
    "Facts",
    "Catalog",
    "CatalogBuilder",
    "tensors_left_as_objects",
    "left_as_objects_text",
    "left_as_objects_warning",
    "refuse_tensors_left_as_objects",
]


class Encoding(StrEnum):
    """How a record's bytes hold its value."""

    TORCH_SAVE = "torch_save"  # one complete torch.save zip archive (DCP .distcp items)
    SAFETENSORS = "safetensors"  # a tensor named ``Record.name`` inside a safetensors blob
    RAW = "raw"  # the element bytes themselves, little-endian (``stride`` None = row-major)
    # a torch.save zip's whole data.pkl; the value is the leaf at ``Record.name``, a JSON list
    # path into the unpickled structure such as '["param_groups", 0, "lr"]'
    PICKLE_LEAF = "pickle_leaf"
    # the record's bytes are one bare pickle (e.g. held in a uint8 tensor), decoded with the object
    # allowlist; the value is the leaf at ``Record.name`` (a JSON list path, None = all of it)
    PICKLE_BYTES = "pickle_bytes"
    # a JSON or YAML text file (its suffix says which), parsed without running anything; the
    # value is the leaf at ``Record.name`` (a JSON list path)
    DOCUMENT = "document"


# Record and Chunk are plain (unfrozen) slotted classes so that an adapter may build them straight
# out of a pickle (DCP metadata has ~500k of each at scale); treat them as read-only.


@dataclass(slots=True)
class Record:
    """Where a chunk's bytes are: ``length`` bytes at ``offset`` in ``file`` (relative path)."""

    file: str
    offset: int
    length: int
    encoding: Encoding = Encoding.TORCH_SAVE
    transform: str | None = None  # a byte transform to undo first, e.g. "zstd"
    name: str | None = None  # SAFETENSORS: the tensor's name in the blob header
    stride: tuple[int, ...] | None = None  # RAW: element strides, None = row-major
    storage_offset: int = 0  # RAW: elements to skip before the first one
    crc32: int | None = None  # CRC-32 of exactly these bytes when the format stores one


def distinct_chunks(chunks: Iterable[Chunk]) -> list[Chunk]:
    """One chunk per stored box: replicas (the same box saved by several ranks) dropped, the
    first copy (rank 0's) kept."""
    seen: dict[tuple, Chunk] = {}
    for chunk in chunks:
        seen.setdefault((chunk.flat, chunk.offsets, chunk.sizes), chunk)
    return list(seen.values())


def pickle_leaf(
    file: str,
    offset: int,
    length: int,
    path: Sequence[str | int],
    *,
    encoding: Encoding = Encoding.PICKLE_LEAF,
    crc32: int | None = None,
) -> Record:
    """A record for the value at ``path`` inside the pickle these bytes hold (``PICKLE_LEAF``:
    a torch.save ``data.pkl``; ``PICKLE_BYTES``: a bare pickle), or the document
    (``DOCUMENT``: a JSON/YAML file)."""
    return Record(file, offset, length, encoding, name=json.dumps(list(path)), crc32=crc32)


def leaf_path(record: Record) -> list[str | int]:
    """The path inside the pickle that :func:`pickle_leaf` stored (empty: the whole value)."""
    return json.loads(record.name) if record.name is not None else []


def shared(record: Record) -> bool:
    """True when the record is a whole pickle that other entries' leaves come from too."""
    return record.encoding in (Encoding.PICKLE_LEAF, Encoding.DOCUMENT) or (
        record.encoding is Encoding.PICKLE_BYTES and record.name is not None
    )


@dataclass(slots=True)
class Chunk:
    """A box of a tensor: ``sizes`` elements starting at global ``offsets``.

    With ``flat`` the box is a range of the tensor flattened to 1-D (flat-parameter shards).
    ``record`` is None for a chunk that holds no elements.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    record: Record | None
    rank: int | None = None
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Entry:
    """One leaf of the state dict: a tensor (with chunks) or a non-tensor object (one record)."""

    key: str  # dotted, as torch's flattening spells it
    path: tuple[str | int, ...]  # the nesting to rebuild: ("optim", "param_groups", 0, "lr")
    kind: Literal["tensor", "object"]
    chunks: tuple[Chunk, ...]
    dtype: DType | None = None
    shape: tuple[int, ...] | None = None
    #: objects only: the tensor class (``DTensor``, ``ShardedTensor``…) when the object is a
    #: tensor ckptkit left undecoded as an object (see :func:`tensors_left_as_objects`)
    tensor_class: str | None = None
    #: how many leading path parts make up the ``model`` group, when the layout keeps its model
    #: elsewhere than under a top-level ``model`` key (Lightning's ``("last", "state_dict")``: 2;
    #: a flat-key DCP: 0); None: the group is the top-level key. Set by
    #: :class:`CatalogBuilder` from :func:`~ckptkit.catalog.keys.model_root`.
    model_depth: int | None = None

    @property
    def group(self) -> str:
        """The group: ``model`` for the model's state dict wherever the layout keeps it
        (:attr:`model_depth`), else the top-level key (``model``, ``optim``, ``train``…)."""
        if self.model_depth is not None:
            return MODEL_GROUP
        return str(self.path[0]) if self.path else self.key.split(".", 1)[0]

    @property
    def inner_path(self) -> tuple[str | int, ...]:
        """The path inside the group, as its output file holds it (``model.safetensors`` key
        ``embed.weight``); an entry that is its whole group keeps its last part."""
        depth = 1 if self.model_depth is None else self.model_depth
        return self.path[depth:] or self.path[-1:]

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def n_chunks(self) -> int:
        """Distinct boxes the tensor is stored in (a box saved by several ranks counts once)."""
        return len({(c.offsets, c.flat) for c in self.chunks})

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor's elements; for objects, the bytes of their own records
        (0 for a leaf inside a shared pickle, whose share of it is unknown)."""
        if self.kind == "tensor" and self.dtype is not None:
            return self.numel * self.dtype.itemsize
        return sum(
            c.record.length for c in self.chunks if c.record is not None and not shared(c.record)
        )


@dataclass(frozen=True)
class Facts:
    """What an adapter learned about a checkpoint besides its entries; every field optional.

    Operations read these by name (``compare_sizes`` counts ``metadata_files``, ``config``
    parses ``config_file``), so a fact an adapter knows is never silently missing elsewhere.
    """

    #: Files that only describe the checkpoint: DCP ``.metadata``, an HF ``index.json``,
    #: OLMo-core ``metadata.json`` / ``.metadata.json``, OLMo ``metadata.yaml``.
    metadata_files: tuple[str, ...] = ()
    #: The run config saved beside the checkpoint (``config.yaml`` / ``config.json``).
    config_file: str | None = None
    world_size: int | None = None
    #: Why the save looks unfinished (a ``stepN-tmp`` folder, a missing completion marker).
    unfinished: str | None = None
    #: DCP ``Metadata.version`` and ``storage_meta`` ids.
    version: str | None = None
    checkpoint_id: str | None = None
    save_id: str | None = None
    #: ``"OLMo torch_new"`` / ``"OLMo-core"`` for OLMo step directories.
    layout: str | None = None
    #: ``"ShardedTensor"`` / ``"DTensor"`` for per-rank files.
    sharding: str | None = None
    #: Lines on how the checkpoint was found that ``inspect`` shows first (the only checkpoint
    #: in the folder the user named, opened).
    notes: tuple[str, ...] = ()
    #: Per-rank files (``rank{N}.pt``, ``train/rank{N}.pt``) in rank order.
    rank_files: tuple[str, ...] = ()
    #: Files in the checkpoint folder that no entry comes from, with why: the adapter's own
    #: (``model.pt`` beside ``model.safetensors``: read from safetensors) and, in a local folder,
    #: every other one (``train/rank0.pt``, ``meta.pt``; a folder not looked into as ``logs/``),
    #: see :mod:`ckptkit.formats.unread_files`. Shown by ``inspect`` and counted by ``sizes``.
    skipped_files: Mapping[str, str] = field(default_factory=dict)
    #: Each safetensors file's ``__metadata__`` header.
    header_metadata: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Safetensors files whose keys are OLMo's base64-pickled key paths.
    base64_key_files: tuple[str, ...] = ()
    #: Bookkeeping keys an adapter read and left out of the entries (OLMo-core 0.x).
    bookkeeping_keys: tuple[str, ...] = ()
    #: OLMo-core's completion marker ``.metadata.json``, parsed.
    olmo_core_metadata: Mapping[str, Any] | None = None
    #: Groups that re-expose, in another shape, bytes other groups already hold (Megatron's
    #: stacked layer tensors as stored, beside their per-layer keys). Listed and readable, but
    #: left out of whole-checkpoint operations (unshard, convert, diff, stats) unless named in
    #: ``groups=`` or matched by ``keys=``: otherwise every such tensor would be written twice.
    alternate_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Catalog:
    """Everything known about a checkpoint without reading tensor bytes; immutable, built and
    validated by :class:`CatalogBuilder`."""

    format: str
    entries: Mapping[str, Entry]
    files: tuple[str, ...]  # data files the records point into, relative to the checkpoint root
    facts: Facts = Facts()
    #: The allowlist PICKLE_LEAF pickles are decoded with (None: ``unpickler.OBJECT_GLOBALS``);
    #: set by formats whose torch.save pickles name more classes (ShardedTensor rank files).
    object_globals: Mapping[str, Any] | None = field(default=None, repr=False)

    def tensors(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.kind == "tensor"]

    def objects(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.kind == "object"]

    def select(
        self, keys: Sequence[str] | str | None = None, groups: Sequence[str] | str | None = None
    ) -> list[Entry]:
        """Entries whose dotted key matches any glob in ``keys`` and whose group is in ``groups``.

        ``None`` selects everything but the :attr:`Facts.alternate_groups` (views of bytes other
        entries hold); ``keys=["model.blocks.0.*", "optim.state.*.exp_avg"]``.
        """
        keys = [keys] if isinstance(keys, str) else keys
        groups = (
            {groups} if isinstance(groups, str) else set(groups) if groups is not None else None
        )
        skipped = set(self.facts.alternate_groups) if keys is None and groups is None else set()
        return [
            e
            for e in self.entries.values()
            if (groups is None or e.group in groups)
            and e.group not in skipped
            and (keys is None or any(fnmatch.fnmatchcase(e.key, pattern) for pattern in keys))
        ]

    def hint(
        self, keys: Sequence[str] | str | None = None, groups: Sequence[str] | str | None = None
    ) -> str:
        """For an error when ``keys`` / ``groups`` name nothing here: the groups there are
        and, per key pattern, the closest keys (``difflib``), e.g. ``groups: model, optim;
        did you mean 'model.embed.weight'?``."""
        import difflib

        listed = list(dict.fromkeys(e.group for e in self.entries.values()))
        parts = [f"groups: {', '.join(listed[:20])}" + (" …" if len(listed) > 20 else "")]
        close: list[str] = []
        for pattern in [keys] if isinstance(keys, str) else list(keys or ()):
            literal = pattern.replace("*", "").replace("?", "")
            close += difflib.get_close_matches(literal, list(self.entries), n=3, cutoff=0.6)
        if close:
            parts.append("did you mean " + ", ".join(repr(k) for k in dict.fromkeys(close)) + "?")
        return "; ".join(parts)


def tensors_left_as_objects(entries: Iterable[Entry]) -> list[Entry]:
    """The object entries that are tensors ckptkit did not read (DTensors, ShardedTensors,
    tensor subclasses kept as placeholders): the one test every report and writer applies, so
    "no tensors" is never mistaken for an empty checkpoint."""
    return [e for e in entries if e.kind == "object" and e.tensor_class is not None]


def left_as_objects_text(found: Sequence[Entry], *, shown: int = 3) -> str:
    """``'12 tensors left as objects (DTensor): model.a, model.b, model.c …'``."""
    classes = ", ".join(sorted({e.tensor_class for e in found if e.tensor_class}))
    keys = ", ".join(e.key for e in found[:shown]) + (" …" if len(found) > shown else "")
    noun = "tensor" if len(found) == 1 else "tensors"
    return f"{len(found)} {noun} left as objects ({classes}): {keys}"


def left_as_objects_warning(entries: Iterable[Entry]) -> str:
    """The first line of a summary of a checkpoint holding tensors left as objects (``''``
    when it holds none): ``'⚠ 12 tensors left as objects (DTensor): … — not read as …'``."""
    found = tensors_left_as_objects(entries)
    if not found:
        return ""
    return (
        f"⚠ {left_as_objects_text(found)} — not read as tensors: missing from the tensor "
        "tables, reads, unshard and convert (one rank's file of a sharded save? open the "
        "folder holding every rank's file)"
    )


def refuse_tensors_left_as_objects(entries: Iterable[Entry], where: str) -> None:
    """Raise :class:`TensorsLeftAsObjectsError` naming the tensors left as objects among
    ``entries`` (writing without them would be a silently partial output)."""
    found = tensors_left_as_objects(entries)
    if found:
        raise TensorsLeftAsObjectsError(
            f"{where}: {left_as_objects_text(found, shown=8)}; ckptkit could not read them as "
            "tensors, so the output would lack them (open the whole set of rank files, or pass "
            "objects='keep' / --objects keep to write them back as pickled objects)",
            keys=tuple(e.key for e in found),
        )


class CatalogBuilder:
    """The one place a catalog is assembled: adapters add entries (and data files no record
    names), :meth:`build` checks them and returns an immutable :class:`Catalog`.

    Checks, each a :class:`FormatError` naming the key: keys unique; paths of str parts and
    non-negative int indices; tensors with a dtype and a shape of non-negative ints, chunks with
    as many offsets and sizes as the shape has dimensions (flat chunks: one), non-negative ints;
    objects without dtype and with a record; records naming a file, at a non-negative offset and
    length. Coverage (every element exactly once) is checked when a tensor is read or verified
    (:mod:`ckptkit.coverage`), so one damaged tensor does not hide the rest.
    """

    def __init__(self, format: str, *, object_globals: Mapping[str, Any] | None = None) -> None:
        self.format = format
        self.object_globals = object_globals
        self.entries: dict[str, Entry] = {}
        self._files: dict[str, None] = {}

    def add(self, entry: Entry, *, source: str = "") -> None:
        """Add one entry; a second entry under the same key is refused."""
        if entry.key in self.entries:
            raise FormatError(f"{source or self.format}: key {entry.key!r} is described twice")
        self.entries[entry.key] = entry

    def add_all(self, entries: Iterable[Entry], *, source: str = "") -> None:
        for entry in entries:
            self.add(entry, source=source)

    def add_files(self, names: Iterable[str]) -> None:
        """Data files that belong to the checkpoint whether or not a record names them."""
        self._files.update(dict.fromkeys(names))

    def build(self, facts: Facts = Facts()) -> Catalog:
        """The checked, immutable catalog (files: those added, then those records name), the
        entries of a model kept under another key marked as group ``model``
        (:func:`~ckptkit.catalog.keys.model_root`)."""
        files = dict(self._files)
        entries = list(self.entries.values())
        if not _all_well_formed(entries):
            for entry in entries:  # find the first culprit, for the message
                _check_entry(entry, self.format)
        files.update(
            (c.record.file, None) for e in entries for c in e.chunks if c.record is not None
        )
        return Catalog(
            self.format,
            MappingProxyType(_with_model_group(self.entries)),
            tuple(files),
            facts,
            self.object_globals,
        )


def _with_model_group(entries: dict[str, Entry]) -> dict[str, Entry]:
    """``entries`` with :attr:`Entry.model_depth` set on those below the layout's model root
    and cleared elsewhere (entries re-described by a composite format start afresh)."""
    root = model_root(entries)
    depth = len(root) if root is not None else None
    for key, entry in entries.items():
        wanted = depth if depth is not None and entry.path[:depth] == root else None
        if wanted is not None and len(entry.path) <= wanted:
            wanted = None  # the root itself as a leaf: not a state dict
        if entry.model_depth != wanted:
            entries[key] = dataclasses.replace(entry, model_depth=wanted)
    return entries


def _all_well_formed(entries: list[Entry]) -> bool:
    """What :func:`_check_entry` checks, for all ``entries`` at once and column-wise in C
    builtins (a DCP of 50k small tensors has 50k entries): False when any might fail, so the
    entries are then checked one by one to name the first that does."""
    if {*map(type, map(_KEY, entries))} - {str}:
        return False
    parts = [part for entry in entries for part in entry.path]
    if not all(map(_PATH, entries)) or not _names_or_naturals(parts):
        return False
    tensors = [e for e in entries if e.kind == "tensor"]
    objects = [e for e in entries if e.kind == "object"]
    if len(tensors) + len(objects) != len(entries):
        return False
    if any(e.dtype is not None or not e.chunks or e.chunks[0].record is None for e in objects):
        return False
    if {*map(type, map(_DTYPE, tensors))} - {DType}:
        return False
    shapes = list(map(_SHAPE, tensors))
    if {*map(type, shapes)} - {tuple} or not _naturals([d for shape in shapes for d in shape]):
        return False
    by_ndim: dict[int, list[Chunk]] = {}
    for entry in tensors:
        if entry.chunks:
            by_ndim.setdefault(len(entry.shape), []).extend(entry.chunks)
    if not all(_boxes_well_formed(tuple(c), ndim) for ndim, c in by_ndim.items()):
        return False
    records = [c.record for e in entries for c in e.chunks if c.record is not None]
    return not records or _records_well_formed(records)


def _names_or_naturals(parts: list) -> bool:
    """Every part a str or a non-negative int (column-wise)."""
    numbers = [p for p in parts if type(p) is not str]
    return {*map(type, numbers)} <= {int} and (not numbers or min(numbers) >= 0)


def _check_entry(entry: Entry, source: str) -> None:
    """Raise :class:`FormatError` unless ``entry`` is well-formed (see :class:`CatalogBuilder`)."""
    where = f"{source}: {entry.key!r}"
    if not isinstance(entry.key, str) or not entry.path:
        raise FormatError(f"{where}: no key or path")
    if not all(type(p) is str or (type(p) is int and p >= 0) for p in entry.path):
        raise FormatError(f"{where}: path {entry.path!r} has a part that is not a name or index")
    if entry.kind == "tensor":
        _check_tensor(entry, where)
    elif entry.kind == "object":
        if entry.dtype is not None or not entry.chunks or entry.chunks[0].record is None:
            raise FormatError(f"{where}: an object needs a record and no dtype")
    else:
        raise FormatError(f"{where}: unknown kind {entry.kind!r}")
    records = [c.record for c in entry.chunks if c.record is not None]
    if records and not _records_well_formed(records):
        record = next(r for r in records if not _records_well_formed([r]))
        raise FormatError(
            f"{where}: malformed record ({record.file!r} @{record.offset!r}, "
            f"{record.length!r} bytes)"
        )


def _records_well_formed(records: list[Record]) -> bool:
    """Every record names a file (a non-empty str) at a non-negative int offset and length;
    column-wise in C builtins."""
    files = list(map(_FILE, records))
    numbers = [*map(_OFFSET, records), *map(_LENGTH, records)]
    return (
        {*map(type, files)} == {str}
        and all(files)
        and {*map(type, numbers)} == {int}
        and min(numbers) >= 0
    )


def _check_tensor(entry: Entry, where: str) -> None:
    shape = entry.shape
    if not isinstance(entry.dtype, DType) or type(shape) is not tuple or not _naturals(shape):
        raise FormatError(f"{where}: a tensor needs a dtype and a shape of non-negative ints")
    chunks = entry.chunks
    if not chunks or _boxes_well_formed(chunks, len(shape)):
        return
    for chunk in chunks:  # find the culprit for the message
        if not _box_ok(chunk, 1 if chunk.flat else len(shape)):
            raise FormatError(
                f"{where}: malformed chunk at {chunk.offsets!r} of size {chunk.sizes!r} "
                f"for shape {list(shape)}"
            )


def _boxes_well_formed(chunks: tuple[Chunk, ...], ndim: int) -> bool:
    """Every chunk's offsets and sizes are tuples of ``ndim`` (flat chunks: 1) non-negative
    ints. Column-wise in C builtins: DCP metadata at scale has 500k chunks."""
    flat = any(map(_FLAT, chunks))
    dims = 1 if flat else ndim
    if flat and not all(map(_FLAT, chunks)):
        return all(_box_ok(c, 1 if c.flat else ndim) for c in chunks)
    offsets = list(map(_OFFSETS, chunks))
    sizes = list(map(_SIZES, chunks))
    if {*map(type, offsets), *map(type, sizes)} != {tuple}:
        return False
    if {*map(len, offsets), *map(len, sizes)} != {dims}:
        return False
    if not dims:
        return True
    try:
        return (
            type(sum(map(sum, offsets)) + sum(map(sum, sizes))) is int
            and min(map(min, offsets)) >= 0
            and min(map(min, sizes)) >= 0
        )
    except TypeError:
        return False


def _box_ok(chunk: Chunk, dims: int) -> bool:
    return (
        type(chunk.offsets) is tuple
        and type(chunk.sizes) is tuple
        and len(chunk.offsets) == dims
        and len(chunk.sizes) == dims
        and _naturals(chunk.offsets + chunk.sizes)
    )


_KEY = attrgetter("key")
_PATH = attrgetter("path")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_FILE = attrgetter("file")
_OFFSET = attrgetter("offset")
_LENGTH = attrgetter("length")
_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")
_FLAT = attrgetter("flat")


def _naturals(values: tuple) -> bool:
    """Every value a non-negative int (checked with C builtins: this runs for every chunk)."""
    try:
        return not values or (type(sum(values)) is int and min(values) >= 0)
    except TypeError:
        return False
