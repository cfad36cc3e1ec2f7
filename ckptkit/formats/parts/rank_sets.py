"""Per-rank torch.save files ``rank{N}.pt``: FSDP1 ``SHARDED_STATE_DICT``, OLMo "legacy" /
"torch_legacy" checkpoints, and per-rank ``torch.save`` of FSDP2 DTensors; and *named* sets of
them, one per group, as training libraries write them (:func:`named_rank_sets`): verl / SkyRL
``model_world_size_2_rank_0.pt`` (+ ``optim_…``, ``extra_state_…``), Accelerate FSDP
``use_dcp=False`` ``pytorch_model_fsdp_0_rank0.bin`` (+ ``optimizer_0_rank0.bin``).

Each rank's file holds that rank's local piece of every sharded tensor:

- a ShardedTensor (FSDP1): its local ``Shard`` (a tensor plus ``ShardMetadata`` offsets, sizes
  and placement) and the global ``ShardedTensorMetadata`` listing every rank's shard;
- a DTensor (FSDP2): its local tensor plus its placements on a device mesh and this rank's
  coordinate in the mesh.

torch cannot unpickle ShardedTensors without a process group. Here the pickles go through the
safe unpickler with plain stand-ins for those classes (nothing from torch is imported or run),
and all ranks' pieces become one catalog: each tensor's chunks carry global offsets/sizes and
RAW records into the rank files' storage members. No tensor bytes are read to describe it.

Groups. A file with a top-level ``model`` or ``optim`` key keeps those as groups; a top-level
``train`` dict is group ``train``, and every other top-level key is trainer state put under
``train`` (OLMo spreads its trainer state at the top level: ``global_step`` → ``train.global_step``),
so ``unshard`` writes the ``model.pt`` / ``optim.pt`` / ``train.pt`` split OLMo's own unsharder
does. A bare dict holding sharded tensors is a model state dict (group ``model``); any other bare
dict is trainer state (group ``train``, e.g. OLMo's ``train/rank{N}.pt``).

Per-rank values. A key that is not sharded (optimizer ``step`` tensors, buffers, trainer state)
is one entry whose chunks are every rank's copy, rank 0 first, each with its ``rank``: reads give
rank 0's value (what OLMo keeps), ``ckpt.chunks`` / ``ckpt.objects`` show which ranks hold it and
``Checkpoint.read(key, rank=N)`` / ``read_object(key, rank=N)`` give another rank's.

Validation. Ranks 0..N-1 must all be present: the world size comes from the ShardedTensors'
``ProcessGroupState`` and shard placements and from DTensor meshes (at least the highest rank
file + 1); a missing ``rankK.pt`` is a :class:`FormatError` naming it, as is a file whose contents
say another rank wrote it (a duplicated rank) or a shard no file holds. A ``stepN-tmp``
directory (OLMo saves there and renames it when done) opens with ``info["unfinished"]`` and a
warning; plain FSDP rank files have no completion marker to check.

Named sets. ``<stem>[_world_size_<N>]_rank[_]<r>.{pt,bin,pth}``: each stem is one set, its whole
content under one group named after what it holds (:func:`named_group`): ``model`` for the
model's state dict (``model``, ``pytorch_model``, ``pytorch_model_fsdp``, index 0 or none),
``optim`` for the optimizer's (``optim``, ``optimizer``), the stem itself otherwise (verl's
``extra_state``: the name its files and loader use). Names decide only which files form a set;
whether a set is a sharded checkpoint at all is decided by content (:func:`sniff_sharding`:
one file's pickle holds DTensors or ShardedTensors). The name's world size, when it has one,
must match the files present (every rank 0..N-1) and what the contents say.

Pickle safety. The rank files' pickles are decoded with
:data:`.fsdp_pickles.ALLOWED_GLOBALS`: plain stand-ins for the ShardedTensor and DTensor
classes, nothing from torch imported or run (see :mod:`.fsdp_pickles`).

Longer than most: one rank-set builder for four layouts (FSDP1, FSDP2, OLMo legacy, named
library sets), whose geometry checks only make sense together.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...catalog.model import Chunk, Entry, pickle_leaf
from ...decoding.tensor_like import tensor_class
from ...decoding.unpickler import TensorRef
from ...dtypes import DType
from ...errors import CheckpointError, CoverageError, FormatError
from ...limits import count_missing, first_missing, ranks_text
from ...storage import Store
from .fsdp_pickles import (
    ALLOWED_GLOBALS,
    _DeviceMesh,
    _DTensor,
    _DTensorSpec,
    _MeshLayout,
    _ProcessGroupState,
    _RemoteDevice,
    _ReplicatePlacement,
    _Shard,
    _ShardedTensor,
    _ShardedTensorMetadata,
    _ShardMetadata,
    _ShardPlacement,
    _Standin,
    value_name,
)
from .torch_save_files import Pickled, leaves, load_pickles, tensor_record

RANK_FILE = re.compile(r"^rank(\d+)\.pt$")
#: A rank file of a named set: ``model_world_size_2_rank_0.pt``, ``optimizer_0_rank1.bin``.
NAMED_RANK_FILE = re.compile(
    r"^(?P<stem>[A-Za-z0-9][A-Za-z0-9_-]*?)(?:_world_size_(?P<world>\d+))?"
    r"_rank_?(?P<rank>\d+)\.(?:pt|bin|pth)$"
)
#: Stems of the model's and the optimizer's state dict, with an optional model index.
_MODEL_STEM = re.compile(r"^(?:pytorch_model_fsdp|pytorch_model|model)(?:_(\d+))?$")
_OPTIM_STEM = re.compile(r"^(?:optimizer|optim)(?:_(\d+))?$")
#: Top-level keys that are groups of their own; every other top-level key is trainer state.
STATE_GROUPS = ("model", "optim")
TRAIN_GROUP = "train"

# --------------------------------------------------------------------------------------------
# Finding the rank files.


def rank_files(storage: Store, listing: Mapping[str, int], prefix: str = "") -> dict[int, str]:
    """``{rank: name}`` of the ``rank{N}.pt`` files in ``listing``; a rank named twice
    (``rank1.pt`` and ``rank01.pt``) is a :class:`FormatError`."""
    found: dict[int, str] = {}
    for name in sorted(listing):
        match = RANK_FILE.match(name)
        if not match or listing[name] < 0:
            continue
        rank = int(match.group(1))
        if rank in found:
            raise CoverageError(
                f"{storage.describe(prefix + name)}: rank {rank} is also {prefix + found[rank]}; "
                "a rank must have exactly one file"
            )
        found[rank] = name
    return {rank: prefix + found[rank] for rank in sorted(found)}


@dataclass(frozen=True)
class NamedRankSet:
    """The rank files of one stem (``model_world_size_2_rank_{r}.pt``): their group, the world
    size the names state (None when they state none) and ``{rank: name}``."""

    group: str
    template: str  # a rank's file name with ``{rank}`` for the rank
    world_size: int | None
    files: dict[int, str]

    def check_names(self, storage: Store) -> None:
        """A :class:`CoverageError` naming the missing files when the names leave a rank out
        (0..N-1 by the world size the names state, else up to the highest rank present), or
        name a rank beyond the world size they state. Reads nothing."""
        world = self.world_size if self.world_size is not None else max(self.files) + 1
        missing = first_missing(self.files, world)
        if missing:
            shown = ", ".join(storage.describe(self.template.format(rank=r)) for r in missing)
            said = (
                f"the names say world size {world}"
                if self.world_size is not None
                else f"files go up to {self.files[max(self.files)]}"
            )
            raise CoverageError(
                f"{shown}: missing; {said} but only ranks {ranks_text(self.files)} have files "
                f"({count_missing(self.files, world)} missing)"
            )
        beyond = [rank for rank in self.files if rank >= world]
        if beyond:
            raise CoverageError(
                f"{storage.describe(self.files[beyond[0]])}: rank {beyond[0]} is beyond the "
                f"world size {world} its name states; mixed checkpoints?"
            )

    @property
    def shown(self) -> str:
        """``'model_world_size_2_rank_{0..1}.pt'``, for evidence and messages."""
        return self.template.replace("{rank}", f"{{{min(self.files)}..{max(self.files)}}}")


def named_group(stem: str) -> str:
    """The group a named set's content goes under: ``model`` / ``optim`` for the model's and
    the optimizer's state dict (``model_1`` / ``optim_1`` for Accelerate's second model),
    else the stem itself (verl's ``extra_state``, the name its loader uses)."""
    for pattern, group in ((_MODEL_STEM, "model"), (_OPTIM_STEM, "optim")):
        match = pattern.match(stem)
        if match:
            index = match.group(1)
            return group if index in (None, "0") else f"{group}_{int(index)}"
    return stem


def named_rank_sets(
    storage: Store, listing: Mapping[str, int], *, strict: bool = True
) -> list[NamedRankSet]:
    """The named sets of rank files in ``listing`` (see the module notes), model first, then
    optim, then the rest by name. With ``strict``, a rank named twice in one set and two sets
    under one group (``model_world_size_2_…`` beside ``model_world_size_4_…``) are a
    :class:`CoverageError`; without it (detection) the first wins. Reads nothing."""
    by_template: dict[str, tuple[str, int | None, dict[int, str]]] = {}
    for name in sorted(listing):
        match = NAMED_RANK_FILE.match(name)
        if not match or listing[name] < 0:
            continue
        rank = int(match.group("rank"))
        template = name[: match.start("rank")] + "{rank}" + name[match.end("rank") :]
        world = match.group("world")
        stem, _, files = by_template.setdefault(
            template, (match.group("stem"), int(world) if world else None, {})
        )
        if rank in files:
            if strict:
                raise CoverageError(
                    f"{storage.describe(name)}: rank {rank} is also {files[rank]}; a rank must "
                    "have exactly one file"
                )
            continue
        files[rank] = name
    sets: dict[str, NamedRankSet] = {}
    for template, (stem, world, files) in by_template.items():
        group = named_group(stem)
        if group in sets:
            if strict:
                raise CoverageError(
                    f"{storage.describe()}: two sets of rank files hold group {group!r}: "
                    f"{sets[group].shown} and {template.replace('{rank}', '*')}; "
                    "one folder, one checkpoint"
                )
            continue
        sets[group] = NamedRankSet(group, template, world, dict(sorted(files.items())))
    order = {"model": 0, "optim": 1}
    return sorted(sets.values(), key=lambda s: (order.get(s.group, 2), s.group))


def sniff_sharding(storage: Store, file: str, size: int | None = None) -> str | None:
    """``"DTensor"`` or ``"ShardedTensor"`` when the pickle of the rank file ``file`` holds
    sharded tensors, else None: what decides that a named set is a sharded checkpoint. Reads
    that one file's zip directory and pickle (decoded safely, no tensor bytes); a file that
    cannot be decoded so (damaged, another tensor subclass) is None, left to other readers."""
    sizes = {file: size} if size is not None else None
    try:
        pickled = load_pickles(storage, [file], sizes, allow=ALLOWED_GLOBALS)[file]
    except (CheckpointError, OSError):
        return None
    if not isinstance(pickled.value, Mapping):
        return None
    kinds = {type(leaf) for _, leaf in leaves(pickled.value) if _is_sharded(leaf)}
    if not kinds:
        return None
    return "ShardedTensor" if _ShardedTensor in kinds else "DTensor"


def sharded_sets_evidence(sets: Iterable[NamedRankSet], kind: str) -> str:
    """``'per-rank torch.save files holding DTensors: model_world_size_2_rank_{0..1}.pt
    (model), …'``."""
    shown = ", ".join(f"{s.shown} ({s.group})" for s in sets)
    return f"per-rank torch.save files holding {kind}s: {shown}"


# --------------------------------------------------------------------------------------------
# Describing a set of rank files.


@dataclass
class _Item:
    """One key gathered over the ranks."""

    path: tuple[str | int, ...]
    kind: str
    dtype: DType | None
    shape: tuple[int, ...] | None
    first: str  # the file it was first seen in, as messages name it
    chunks: list[Chunk] = field(default_factory=list)
    expected: tuple | None = None  # ShardedTensor: every shard's (offsets, sizes) as metadata says
    tensor_class: str | None = None  # an object that is a tensor left undecoded


@dataclass
class RankSet:
    """The entries of a set of rank files, and what the files say about the world size."""

    entries: dict[str, Entry]
    files: dict[int, str]
    world_size: int
    world_size_from: str
    authoritative: bool  # the world size was written down (not inferred from files)
    sharding: str | None  # "ShardedTensor", "DTensor" or None
    template: str = "rank{rank}.pt"  # a rank's file name, as messages name a missing one

    def missing(self) -> list[int]:
        """The first few ranks below the world size without a file (bounded, see
        :func:`ckptkit.limits.first_missing`)."""
        return first_missing(self.files, self.world_size)

    def raise_for_missing(self, storage: Store) -> None:
        """A :class:`FormatError` naming the missing rank files (and surplus ones)."""
        missing = self.missing()
        if missing:
            names = [_sibling(self.files, rank, self.template) for rank in missing]
            shown = ", ".join(storage.describe(name) for name in names)
            count = count_missing(self.files, self.world_size)
            raise CoverageError(
                f"{shown}: missing; world size {self.world_size} ({self.world_size_from}) but "
                f"only ranks {ranks_text(self.files)} have files ({count} missing)"
            )
        surplus = [rank for rank in self.files if rank >= self.world_size]
        if surplus and self.authoritative:
            raise CoverageError(
                f"{storage.describe(self.files[surplus[0]])}: rank {surplus[0]} is beyond the "
                f"world size {self.world_size} ({self.world_size_from}); mixed checkpoints?"
            )


def describe_ranks(
    storage: Store,
    files: Mapping[int, str],
    sizes: Mapping[str, int | None] | None = None,
    group: str | None = None,
    require_all: bool = True,
    template: str = "rank{rank}.pt",
) -> RankSet:
    """Entries of the rank files ``{rank: path}``, merged over ranks (see the module notes).

    ``group`` puts every file's whole content under that group (``train`` for OLMo's
    ``train/rank{N}.pt``); None applies the grouping rule of legacy rank files. With
    ``require_all`` a missing rank is a :class:`FormatError` naming its file (``template``
    spells it); otherwise the caller checks :meth:`RankSet.missing`.
    """
    pickled = load_pickles(storage, list(files.values()), sizes, allow=ALLOWED_GLOBALS)
    builder = _Builder()
    for rank, file in files.items():
        builder.add_rank(rank, pickled[file], group)
    world, source, authoritative = builder.world_size(files, template)
    ranks = RankSet({}, dict(files), world, source, authoritative, builder.sharding, template)
    if require_all:
        ranks.raise_for_missing(storage)  # before the shards they lack are reported
    ranks.entries = builder.finish()
    return ranks


class _Builder:
    def __init__(self) -> None:
        self.items: dict[str, _Item] = {}
        self.world_sizes: dict[int, str] = {}  # world size → where it was read
        self.sharding: str | None = None

    # -- one rank file -------------------------------------------------------------------

    def add_rank(self, rank: int, pickled: Pickled, group: str | None) -> None:
        for path, inner, leaf in _grouped_leaves(pickled, group):
            key = ".".join(map(str, path))
            if isinstance(leaf, _ShardedTensor):
                self.sharding = "ShardedTensor"
                dtype, shape, chunks, expected = self._sharded_tensor(key, leaf, rank, pickled)
                self._add(key, path, "tensor", dtype, shape, chunks, pickled, expected)
            elif isinstance(leaf, _DTensor):
                self.sharding = self.sharding or "DTensor"
                dtype, shape, chunk = self._dtensor(key, leaf, rank, pickled)
                self._add(key, path, "tensor", dtype, shape, [chunk], pickled)
            elif isinstance(leaf, TensorRef):
                record = tensor_record(key, leaf, pickled.index, pickled.source)
                chunk = Chunk((0,) * len(leaf.shape), leaf.shape, record, rank)
                self._add(key, path, "tensor", leaf.dtype, leaf.shape, [chunk], pickled)
            else:
                record = pickle_leaf(pickled.file, pickled.offset, pickled.length, inner)
                chunks = [Chunk((), (), record, rank)]
                self._add(key, path, "object", None, None, chunks, pickled, None, leaf)

    def _add(self, key, path, kind, dtype, shape, chunks, pickled, expected=None, leaf=None):
        item = self.items.get(key)
        if item is None:
            item = self.items[key] = _Item(path, kind, dtype, shape, pickled.source, [], expected)
            item.tensor_class = tensor_class(leaf) if kind == "object" else None
        elif (item.kind, item.dtype, item.shape) != (kind, dtype, shape):
            raise FormatError(
                f"{pickled.source}: {key!r} is {_what(kind, dtype, shape)} here but "
                f"{_what(item.kind, item.dtype, item.shape)} in {item.first}"
            )
        elif item.expected != expected:
            raise FormatError(
                f"{pickled.source}: {key!r} is sharded differently here than in {item.first}; "
                "are these rank files from one checkpoint?"
            )
        item.chunks.extend(chunks)

    def _sharded_tensor(self, key: str, st: _ShardedTensor, rank: int, pickled: Pickled):
        source = f"{pickled.source}: {key!r}"
        meta = st.metadata
        if not isinstance(meta, _ShardedTensorMetadata):
            raise FormatError(f"{source}: ShardedTensor without ShardedTensorMetadata")
        shape = _box(meta.get("size"), None, source, "size")
        properties = meta.get("tensor_properties")
        dtype = getattr(properties, "dtype", None)
        if not isinstance(dtype, DType) or dtype != st.dtype:
            raise FormatError(f"{source}: ShardedTensor dtype {dtype!r} / {st.dtype!r} unknown")
        if st.shape != shape:
            raise FormatError(f"{source}: ShardedTensor size {st.shape} != metadata {shape}")
        pg = st.pg_state
        local_rank = self._process_group(pg, rank, pickled, source)
        expected = []
        shards = meta.get("shards_metadata")
        if not isinstance(shards, list):
            raise FormatError(f"{source}: ShardedTensorMetadata without shards_metadata")
        placements = []
        for shard_meta in shards:
            offsets, sizes, placed = _shard_box(shard_meta, shape, source)
            expected.append((offsets, sizes))
            placements.append(placed)
        if not isinstance(pg, _ProcessGroupState):
            known = [p for p in placements if p is not None]
            if known:
                self.world_sizes.setdefault(
                    max(known) + 1, f"ShardedTensor placements in {pickled.file}"
                )
        chunks = [
            _local_shard(key, shard, shape, dtype, rank, local_rank, pickled)
            for shard in st.local_shards or ()
        ]
        return dtype, shape, chunks, tuple(sorted(expected))

    def _process_group(self, pg: Any, rank: int, pickled: Pickled, source: str) -> int:
        """The writer's local rank from a ShardedTensor's process-group state (checked against
        the file's rank; its world size noted), or ``rank`` when there is none."""
        if not isinstance(pg, _ProcessGroupState):
            return rank
        global_rank, local_rank = pg.get("global_rank"), pg.get("local_rank")
        world = pg.get("global_world_size")
        if type(global_rank) is not int or type(local_rank) is not int or type(world) is not int:
            raise FormatError(f"{source}: malformed ShardedTensor process-group state")
        if global_rank != rank:
            raise CoverageError(
                f"{pickled.source}: holds rank {global_rank}'s shards, not rank {rank}'s "
                "(a duplicated or renamed rank file?)"
            )
        self.world_sizes.setdefault(world, f"ShardedTensor process group in {pickled.file}")
        return local_rank

    def _dtensor(self, key: str, dt: _DTensor, rank: int, pickled: Pickled):
        source = f"{pickled.source}: {key!r}"
        spec, local = dt.get("_spec"), dt.get("_local_tensor")
        if not isinstance(spec, _DTensorSpec) or not isinstance(local, TensorRef):
            raise FormatError(f"{source}: DTensor without a local tensor and spec")
        shape = _box(dt.shape, None, source, "size")
        dtype = dt.dtype
        if not isinstance(dtype, DType) or local.dtype != dtype:
            raise FormatError(f"{source}: DTensor dtype {dtype!r} / local {local.dtype!r}")
        mesh = spec.get("mesh")
        placements = spec.get("placements")
        if not isinstance(mesh, _DeviceMesh) or not isinstance(placements, (tuple, list)):
            raise FormatError(f"{source}: DTensor spec without a device mesh and placements")
        mesh_shape = _mesh_shape(mesh, source)
        coordinate = mesh.get("_coordinate_on_dim")
        if (
            not isinstance(coordinate, (tuple, list))
            or len(coordinate) != len(mesh_shape)
            or len(placements) != len(mesh_shape)
        ):
            raise FormatError(f"{source}: DTensor mesh coordinate {coordinate!r} does not fit")
        for entry in spec.get("shard_order") or ():  # torch >= 2.10: (tensor dim, mesh dims)
            mesh_dims = entry.args[1] if isinstance(entry, _Standin) and len(entry.args) > 1 else ()
            if isinstance(mesh_dims, (tuple, list)) and list(mesh_dims) != sorted(mesh_dims):
                raise FormatError(
                    f"{source}: DTensor shard order {list(mesh_dims)} is not supported "
                    "(only the default, mesh dimensions left to right)"
                )
        mesh_rank = mesh.get("_rank")
        if type(mesh_rank) is int and mesh_rank != rank:
            raise CoverageError(
                f"{pickled.source}: holds rank {mesh_rank}'s DTensors, not rank {rank}'s "
                "(a duplicated or renamed rank file?)"
            )
        self.world_sizes.setdefault(math.prod(mesh_shape), f"DTensor device mesh in {pickled.file}")
        offsets, sizes = list((0,) * len(shape)), list(shape)
        for placement, n, coord in zip(placements, mesh_shape, coordinate, strict=True):
            if isinstance(placement, _ReplicatePlacement):
                continue
            dim = placement.get("dim") if isinstance(placement, _ShardPlacement) else None
            if type(dim) is not int or not -len(shape) <= dim < len(shape):
                raise FormatError(
                    f"{source}: DTensor placement {value_name(placement)} is not supported "
                    "(only Shard and Replicate)"
                )
            size, offset = _torch_chunk(sizes[dim], n, coord)
            offsets[dim] += offset
            sizes[dim] = size
        sizes = tuple(sizes)
        if local.shape != sizes:
            raise FormatError(
                f"{source}: local tensor has shape {list(local.shape)}, the placements give "
                f"{list(sizes)}"
            )
        record = tensor_record(key, local, pickled.index, pickled.source)
        return dtype, shape, Chunk(tuple(offsets), sizes, record, rank)

    # -- all ranks -------------------------------------------------------------------------

    def world_size(
        self, files: Mapping[int, str], template: str = "rank{rank}.pt"
    ) -> tuple[int, str, bool]:
        """The world size, where it was read, and whether it was written down."""
        inferred = max(files) + 1
        if self.world_sizes:
            world = max(self.world_sizes)
            if world >= inferred:
                return world, self.world_sizes[world], True
        return inferred, f"rank files up to {template.format(rank=max(files))}", False

    def finish(self) -> dict[str, Entry]:
        entries = {}
        for key, item in self.items.items():
            chunks = tuple(item.chunks)
            if item.expected is not None:
                held = {(c.offsets, c.sizes) for c in chunks}
                lost = [box for box in item.expected if box not in held and math.prod(box[1])]
                if lost:
                    offsets, sizes = lost[0]
                    raise FormatError(
                        f"{item.first}: no rank file holds the shard of {key!r} at offsets "
                        f"{list(offsets)} (sizes {list(sizes)})"
                    )
            entries[key] = Entry(
                key, item.path, item.kind, chunks, item.dtype, item.shape, item.tensor_class
            )
        return entries


def _grouped_leaves(
    pickled: Pickled, group: str | None
) -> Iterator[tuple[tuple[str | int, ...], tuple[str | int, ...], Any]]:
    """``(catalog path, path in the pickle, leaf)`` of one rank file (grouping: module notes)."""
    value = pickled.value
    if not isinstance(value, Mapping):
        raise FormatError(f"{pickled.source}: holds {value_name(value)}, not a state dict")
    if group is not None:
        for inner, leaf in leaves(value):
            yield (group, *inner), inner, leaf
        return
    keys = {str(k) for k in value}
    trainer_layout = any(name in keys for name in STATE_GROUPS)
    bare_group = (
        "model"
        if not trainer_layout and any(_is_sharded(leaf) for _, leaf in leaves(value))
        else TRAIN_GROUP
    )
    for inner, leaf in leaves(value):
        top = inner[0] if inner else None
        if trainer_layout and (
            top in STATE_GROUPS or (top == TRAIN_GROUP and isinstance(value[top], Mapping))
        ):
            yield inner, inner, leaf
        elif trainer_layout:
            yield (TRAIN_GROUP, *inner), inner, leaf
        else:
            yield (bare_group, *inner), inner, leaf


def _local_shard(
    key: str,
    shard: Any,
    shape: tuple[int, ...],
    dtype: DType,
    rank: int,
    local_rank: int,
    pickled: Pickled,
) -> Chunk:
    """The chunk of one local ``Shard`` of a ShardedTensor, checked against its metadata."""
    source = f"{pickled.source}: {key!r}"
    if not isinstance(shard, _Shard):
        raise FormatError(f"{source}: local shard is {value_name(shard)}, not a Shard")
    offsets, sizes, placed = _shard_box(shard.get("metadata"), shape, source)
    if placed is not None and placed != local_rank:
        raise CoverageError(
            f"{pickled.source}: holds the shard placed on rank {placed} of {key!r}, "
            f"not rank {local_rank}'s (a duplicated or renamed rank file?)"
        )
    tensor = shard.get("tensor")
    if not isinstance(tensor, TensorRef):
        raise FormatError(f"{source}: local shard holds {value_name(tensor)}, not a tensor")
    if tensor.shape != sizes or tensor.dtype != dtype:
        raise FormatError(
            f"{source}: local shard is {_what('tensor', tensor.dtype, tensor.shape)}, "
            f"its metadata says {_what('tensor', dtype, sizes)}"
        )
    record = tensor_record(key, tensor, pickled.index, pickled.source)
    return Chunk(offsets, sizes, record, rank)


def _is_sharded(leaf: Any) -> bool:
    return isinstance(leaf, (_ShardedTensor, _DTensor))


def _shard_box(meta: Any, shape: tuple[int, ...], source: str):
    """``(offsets, sizes, placement rank)`` of a ShardMetadata, checked against the shape."""
    if not isinstance(meta, _ShardMetadata):
        raise FormatError(f"{source}: shard without ShardMetadata")
    offsets = _box(meta.get("shard_offsets"), len(shape), source, "shard offsets")
    sizes = _box(meta.get("shard_sizes"), len(shape), source, "shard sizes")
    if any(o + n > full for o, n, full in zip(offsets, sizes, shape, strict=True)):
        raise FormatError(f"{source}: shard {list(offsets)}+{list(sizes)} exceeds {list(shape)}")
    placement = meta.get("placement")
    placed = placement.get("_rank") if isinstance(placement, _RemoteDevice) else None
    return offsets, sizes, placed if type(placed) is int else None


def _box(value: Any, ndim: int | None, source: str, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, (tuple, list))
        or (ndim is not None and len(value) != ndim)
        or not all(type(n) is int and n >= 0 for n in value)
    ):
        raise FormatError(f"{source}: malformed {what} {value!r}")
    return tuple(value)


def _mesh_shape(mesh: _DeviceMesh, source: str) -> tuple[int, ...]:
    """The device mesh's size per dimension: from its layout (torch >= 2.10) or its rank tensor."""
    layout = mesh.get("_layout")
    if isinstance(layout, _MeshLayout):
        axes = layout.get("axes")
        if isinstance(axes, (tuple, list)) and all(isinstance(a, _MeshLayout) for a in axes):
            shapes = [a.get("shape") for a in axes]
            if all(isinstance(s, tuple) and all(type(n) is int for n in s) for s in shapes):
                return tuple(math.prod(s) for s in shapes)
    ranks = mesh.get("mesh")
    if isinstance(ranks, TensorRef):
        return ranks.shape
    raise FormatError(f"{source}: cannot tell the DTensor device mesh's shape")


def _torch_chunk(n: int, chunks: int, index: Any) -> tuple[int, int]:
    """``(size, offset)`` of piece ``index`` when ``torch.chunk`` splits ``n`` into ``chunks``."""
    if type(index) is not int or not 0 <= index < chunks:
        raise FormatError(f"mesh coordinate {index!r} outside a mesh dimension of {chunks}")
    full = -(-n // chunks)
    start = min(n, full * index)
    return max(0, min(n, start + full) - start), start


def _sibling(files: Mapping[int, str], rank: int, template: str = "rank{rank}.pt") -> str:
    """The name rank ``rank``'s file would have, beside the others."""
    directory = posixpath.dirname(next(iter(files.values()))) if files else ""
    return posixpath.join(directory, template.format(rank=rank))


def _what(kind: str, dtype: DType | None, shape: tuple[int, ...] | None) -> str:
    return f"a {dtype.name}{list(shape)} tensor" if kind == "tensor" and dtype else "an object"


__all__ = [
    "NAMED_RANK_FILE",
    "RANK_FILE",
    "STATE_GROUPS",
    "TRAIN_GROUP",
    "NamedRankSet",
    "RankSet",
    "describe_ranks",
    "named_group",
    "named_rank_sets",
    "rank_files",
    "sharded_sets_evidence",
    "sniff_sharding",
]
