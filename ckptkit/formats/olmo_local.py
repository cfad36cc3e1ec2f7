"""OLMo "local" sharded checkpoints (``LocalShardedCheckpointer``): raw FSDP1 flat-parameter shards.

Layout: ``metadata.yaml`` (``world_size``), ``model/rank{N}.pt`` (per FSDP module, per handle:
the rank's 1-D ``flat_param.data`` shard plus flat-param metadata), ``optim/rank{N}.pt`` (the
rank-local ``optim.state_dict()``: int parameter ids, 1-D pieces), ``train/rank{N}.pt`` and
``config.yaml`` (written last). Each original parameter's piece on a rank becomes a flat chunk
whose RAW record is its range inside the flat shard (alignment padding is never read).

Keys are those of OLMo's own unsharder (``LocalShardedCheckpointer.unshard_checkpoint``):
``model.<fqn>`` (``_fsdp_wrapped_module.`` dropped), ``optim.state.<id>.<name>`` (same pieces as
the parameter, by way of ``param_groups[*].param_names``), ``optim.param_groups.<i>.<field>``
and ``train.…``; values every rank saved (``step``, param groups, trainer state) keep every
rank's copy as a chunk and read as rank 0's, which is what OLMo keeps. One difference: the
``param_names`` are shown as stored, with the FSDP prefixes OLMo's unsharder strips.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import yaml

from ..catalog.coverage import check_chunks
from ..catalog.model import Catalog, CatalogBuilder, Chunk, Encoding, Entry, Facts, Record
from ..decoding.unpickler import OBJECT_GLOBALS, TensorRef
from ..dtypes import DType
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..limits import count_missing, first_missing
from ..storage import Store
from .detection import Detection, file_location
from .parts import torch_save_files
from .parts.rank_sets import RANK_FILE, TRAIN_GROUP, describe_ranks
from .parts.unfinished import check_olmo_config

__all__ = [
    "NAME",
    "METADATA",
    "CONFIG",
    "FSDP_PREFIX",
    "ShardParamInfo",
    "MODEL_GLOBALS",
    "detect",
    "describe",
]

NAME = "olmo_local"
METADATA = "metadata.yaml"
CONFIG = "config.yaml"
FSDP_PREFIX = "_fsdp_wrapped_module."


class ShardParamInfo(NamedTuple):
    """Stand-in for FSDP's ``_ShardParamInfo`` (torch >= 2.1); ``intra_param_end_idx`` inclusive."""

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


#: Model rank files also name FSDP's shard-info named tuple (module renamed in torch 2.2).
MODEL_GLOBALS: dict[str, Any] = {
    **OBJECT_GLOBALS,
    "torch.distributed.fsdp._flat_param._ShardParamInfo": ShardParamInfo,
    "torch.distributed.fsdp.flat_param._ShardParamInfo": ShardParamInfo,
}


def detect(storage: Store) -> Detection | None:
    """OLMo local: ``metadata.yaml`` next to a ``model/`` directory of ``rank*.pt`` files."""
    if file_location(storage) is not None:
        return None
    try:
        listing = storage.listdir()
        if METADATA not in listing or listing.get("model") != -1:
            return None
        ranks = sorted(n for n in storage.listdir("model") if RANK_FILE.match(n))
    except MissingFileError:
        return None
    if not ranks:
        return None
    evidence = [f"{METADATA}", f"model/{ranks[0]} … ({len(ranks)} rank files)"]
    if CONFIG not in listing:
        evidence.append(f"no {CONFIG} (OLMo writes it last): the save may be unfinished")
    return Detection(NAME, storage, evidence)


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of an OLMo local checkpoint directory; reads zip directories and pickles."""
    world_size = _world_size(storage)
    present = {int(m.group(1)) for n in storage.listdir("model") if (m := RANK_FILE.match(n))}
    if len(present) < world_size:  # never enumerate ranks the files cannot back
        missing = ", ".join(
            storage.describe(f"model/rank{r}.pt") for r in first_missing(present, world_size)
        )
        raise MissingFileError(
            f"{missing}: missing ({count_missing(present, world_size)} rank files in all; "
            f"{METADATA} says world_size {world_size})"
        )
    model_files = [f"model/rank{r}.pt" for r in range(world_size)]
    optim_files = [f"optim/rank{r}.pt" for r in range(world_size)]
    train_files = {r: f"train/rank{r}.pt" for r in range(world_size)}
    sizes = storage.sizes([*model_files, *optim_files, *train_files.values()])
    has_train = any(sizes[f] is not None for f in train_files.values())
    for file in [*model_files, *optim_files, *(train_files.values() if has_train else ())]:
        if sizes[file] is None:
            raise MissingFileError(
                f"{storage.describe(file)}: missing (metadata.yaml says world_size {world_size})"
            )
    models = torch_save_files.load_pickles(storage, model_files, sizes, allow=MODEL_GLOBALS)
    optims = torch_save_files.load_pickles(storage, optim_files, sizes)

    pieces: dict[int, dict[str, tuple[int, int]]] = {}  # rank → fqn → (flat start, numel)
    params = _model_entries([models[f] for f in model_files], pieces)
    entries = {e.key: e for e in params.values()}
    try:
        entries.update(_optim_entries([optims[f] for f in optim_files], params, pieces))
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise FormatError(
            f"{storage.describe('optim')}: unexpected optimizer state: {exc}"
        ) from exc
    builder = CatalogBuilder(NAME)
    builder.add_files([*model_files, *optim_files])
    builder.add_all(entries.values(), source=storage.describe())
    if has_train:  # every rank's copy; reads give rank 0's, which OLMo's unsharder keeps
        ranks = describe_ranks(storage, train_files, sizes, group=TRAIN_GROUP)
        builder.add_files(train_files.values())
        builder.add_all(ranks.entries.values(), source=storage.describe("train"))
    return builder.build(
        Facts(
            metadata_files=(METADATA,),
            config_file=CONFIG if storage.exists(CONFIG) else None,
            world_size=world_size,
            rank_files=tuple(train_files.values()) if has_train else (),
            unfinished=check_olmo_config(storage),
        )
    )


def _world_size(storage: Store) -> int:
    source = storage.describe(METADATA)
    try:
        metadata = yaml.safe_load(storage.read_file(METADATA))
    except yaml.YAMLError as exc:
        raise FormatError(f"{source}: not YAML: {exc}") from exc
    world_size = metadata.get("world_size") if isinstance(metadata, dict) else None
    if type(world_size) is not int or world_size < 1:
        raise FormatError(f"{source}: no positive integer world_size (found {world_size!r})")
    return world_size


# --------------------------------------------------------------------------------------------
# Model: flat-parameter shards.


def _model_entries(
    models: list[torch_save_files.Pickled],
    pieces: dict[int, dict[str, tuple[int, int]]],
) -> dict[str, Entry]:
    """Parameter entries keyed by FQN, each with one flat chunk per rank holding a piece of it;
    ``pieces`` gets each rank's ``(flat start, numel)`` per FQN, for the optimizer state."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, DType] = {}
    chunks: dict[str, list[Chunk]] = {}
    for rank, pickled in enumerate(models):
        pieces[rank] = {}
        try:
            found = list(_flat_pieces(pickled))
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise FormatError(
                f"{pickled.source}: unexpected flat-parameter metadata: {exc}"
            ) from exc
        for fqn, shape, flat, start, offset, numel in found:
            if shapes.setdefault(fqn, shape) != shape or dtypes.setdefault(fqn, flat.dtype) != (
                flat.dtype
            ):
                raise FormatError(
                    f"{pickled.source}: {fqn!r} is {flat.dtype.name}{list(shape)} here, "
                    f"{dtypes[fqn].name}{list(shapes[fqn])} in another rank file"
                )
            chunks.setdefault(fqn, [])
            if numel == 0:
                continue
            if start + numel > math.prod(shape):
                raise CorruptRecordError(
                    f"{pickled.source}: {fqn!r} piece [{start}, {start + numel}) lies outside "
                    f"its {math.prod(shape)} elements"
                )
            record = _sub_record(pickled, flat, offset, numel, fqn)
            chunks[fqn].append(Chunk((start,), (numel,), record, rank, flat=True))
            pieces[rank][fqn] = (start, numel)
    entries = {}
    for fqn, stored in chunks.items():
        key = f"model.{fqn}"
        _check_tiling(key, shapes[fqn], stored, models[0].source)
        entries[fqn] = Entry(key, ("model", fqn), "tensor", tuple(stored), dtypes[fqn], shapes[fqn])
    return entries


def _flat_pieces(pickled: torch_save_files.Pickled):
    """``(fqn, shape, flat shard ref, start in the parameter, offset in the shard, numel)`` for
    every original parameter of every handle of a model rank file (numel 0: not on this rank)."""
    source = pickled.source
    modules = pickled.value.get("modules") if isinstance(pickled.value, Mapping) else None
    if not isinstance(modules, list):
        raise FormatError(f"{source}: not an OLMo local model file (no 'modules' list)")
    for module in modules:
        prefix = str(module.get("name", "")).replace(FSDP_PREFIX, "")
        for handle in module.get("handles", []):
            flat = handle.get("flat_param.data")
            fqns, shapes = handle.get("flat_param._fqns"), handle.get("flat_param._shapes")
            if not isinstance(flat, TensorRef) or len(flat.shape) != 1 or fqns is None:
                raise FormatError(f"{source}: module {prefix!r} has no 1-D flat_param.data")
            if flat.stride != (1,):
                raise CorruptRecordError(f"{source}: flat_param of {prefix!r} is not contiguous")
            for fqn, shape, (start, offset, numel) in zip(
                fqns, shapes, _shard_ranges(handle, len(fqns), source), strict=True
            ):
                full = f"{prefix}.{fqn}" if prefix else str(fqn)
                if offset + numel > flat.shape[0]:
                    raise CorruptRecordError(
                        f"{source}: {full!r} piece at {offset} (+{numel}) lies past the end of "
                        f"its {flat.shape[0]}-element flat shard"
                    )
                yield full, tuple(int(n) for n in shape), flat, start, offset, numel


def _shard_ranges(handle: Mapping, count: int, source: str) -> list[tuple[int, int, int]]:
    """Each parameter's ``(start in the parameter, offset in the flat shard, numel)`` here:
    from ``_shard_param_infos`` (torch >= 2.1, inclusive end index) or, before,
    ``_shard_indices`` + ``_shard_param_offsets`` (inclusive pairs, no padding between)."""
    infos = handle.get("flat_param._shard_param_infos")
    if infos is not None:
        ranges = []
        for info in infos:
            if not isinstance(info, ShardParamInfo):
                raise FormatError(f"{source}: unexpected _shard_param_infos item {info!r}")
            if not info.in_shard:
                ranges.append((0, 0, 0))
                continue
            numel = info.intra_param_end_idx - info.intra_param_start_idx + 1
            if numel != info.numel_in_shard:
                raise CorruptRecordError(f"{source}: inconsistent shard info {info!r}")
            ranges.append((info.intra_param_start_idx, info.offset_in_shard, numel))
        return ranges
    indices = handle.get("flat_param._shard_indices")
    offsets = handle.get("flat_param._shard_param_offsets")
    if indices is None or offsets is None:
        raise FormatError(
            f"{source}: handle has neither _shard_param_infos nor _shard_param_offsets"
        )
    ranges = [(0, 0, 0)] * count
    position = 0
    for i, (first, last) in enumerate(offsets, start=indices[0]):
        ranges[i] = (first, position, last - first + 1)
        position += last - first + 1
    return ranges


def _sub_record(
    pickled: torch_save_files.Pickled, flat: TensorRef, offset: int, numel: int, fqn: str
) -> Record:
    """The RAW record of ``numel`` elements at ``offset`` of a 1-D shard in a torch.save file."""
    base = torch_save_files.tensor_record(fqn, flat, pickled.index, pickled.source)
    itemsize = flat.dtype.itemsize
    return Record(pickled.file, base.offset + offset * itemsize, numel * itemsize, Encoding.RAW)


def _check_tiling(key: str, shape: tuple[int, ...], chunks: list[Chunk], source: str) -> None:
    """The flat pieces of a tensor must cover all of it exactly once."""
    ranks = sorted({c.rank for c in chunks})
    check_chunks(key, shape, chunks, source=source, pieces=f"the pieces in rank files {ranks}")


# --------------------------------------------------------------------------------------------
# Optimizer: rank-local state keyed by int id.


def _optim_entries(
    optims: list[torch_save_files.Pickled],
    params: Mapping[str, Entry],
    pieces: Mapping[int, Mapping[str, tuple[int, int]]],
) -> dict[str, Entry]:
    """``optim.state.<id>.<name>`` assembled over ranks (in param-group order), then rank 0's
    other leaves (``optim.param_groups.<i>.<field>``)."""
    groups0 = _param_groups(optims[0])
    names = _id_to_fqn(groups0, optims[0].source)
    found: dict[Any, dict[str, list]] = {pid: {} for pid in names}  # id → name → [(ref, chunk)]
    objects: dict[str, Entry] = {}
    for rank, pickled in enumerate(optims):
        source = pickled.source
        if rank and _param_groups(pickled) != groups0:
            raise FormatError(f"{source}: param_groups differ from {optims[0].source}")
        for pid, values in pickled.value.get("state", {}).items():
            if pid not in names:
                raise FormatError(f"{source}: state of parameter id {pid!r}, which no group lists")
            for name, value in values.items():
                key = f"optim.state.{pid}.{name}"
                if isinstance(value, TensorRef):
                    chunk = _state_chunk(pickled, rank, key, value, names[pid], params, pieces)
                    found[pid].setdefault(str(name), []).append((value, chunk))
                elif key not in objects:  # a non-tensor state value: rank 0's (first) copy
                    found[pid].setdefault(str(name), [])
                    record = Record(
                        pickled.file,
                        pickled.offset,
                        pickled.length,
                        Encoding.PICKLE_LEAF,
                        name=json.dumps(["state", pid, name]),
                    )
                    path = ("optim", "state", str(pid), str(name))
                    objects[key] = Entry(key, path, "object", (Chunk((), (), record),))
    entries = _state_entries(found, objects, params, names, optims[0].source)
    _add_param_groups(optims, entries)
    return entries


def _state_entries(
    found: Mapping[Any, Mapping[str, list]],
    objects: Mapping[str, Entry],
    params: Mapping[str, Entry],
    names: Mapping[Any, str],
    source: str,
) -> dict[str, Entry]:
    """One entry per ``optim.state.<id>.<name>``: tensors from every rank's pieces (tiling
    checked), non-tensor values as found."""
    entries: dict[str, Entry] = {}
    for pid, states in found.items():
        for name, stored in states.items():
            key = f"optim.state.{pid}.{name}"
            if key in objects:
                entries[key] = objects[key]
                continue
            chunks = [chunk for _, chunk in stored]
            flat = {chunk.flat for chunk in chunks}
            if len(flat) != 1:
                raise FormatError(f"{source}: {key!r} is 0-d on some ranks only")
            shape = params[names[pid]].shape if chunks[0].flat else ()
            if chunks[0].flat:
                _check_tiling(key, shape, chunks, source)
            path = ("optim", "state", str(pid), name)
            entries[key] = Entry(key, path, "tensor", tuple(chunks), stored[0][0].dtype, shape)
    return entries


def _add_param_groups(optims: list[torch_save_files.Pickled], entries: dict[str, Entry]) -> None:
    """The optimizer's other leaves (param groups), every rank's (equal) copy a chunk."""
    for rank, pickled in enumerate(optims):
        for entry in torch_save_files.pickle_entries(pickled, "optim", exclude=("state",)):
            chunk = Chunk((), (), entry.chunks[0].record, rank)
            if entry.kind != "object":
                entries.setdefault(entry.key, entry)
            elif entry.key not in entries:
                entries[entry.key] = Entry(entry.key, entry.path, "object", (chunk,))
            else:
                first = entries[entry.key]
                entries[entry.key] = Entry(first.key, first.path, "object", (*first.chunks, chunk))


def _state_chunk(
    pickled: torch_save_files.Pickled,
    rank: int,
    key: str,
    ref: TensorRef,
    fqn: str,
    params: Mapping[str, Entry],
    pieces: Mapping[int, Mapping[str, tuple[int, int]]],
) -> Chunk:
    """A 0-d value (``step``) as a replica, or a 1-D piece at its parameter's flat range."""
    record = torch_save_files.tensor_record(key, ref, pickled.index, pickled.source)
    if ref.shape == ():
        return Chunk((), (), record, rank)
    if fqn not in params:
        raise FormatError(f"{pickled.source}: {key!r} belongs to {fqn!r}, not in the model files")
    start, numel = pieces[rank].get(fqn, (0, 0))
    if len(ref.shape) != 1 or ref.shape[0] != numel:
        raise CorruptRecordError(
            f"{pickled.source}: {key!r} has shape {list(ref.shape)}; the model's piece of "
            f"{fqn!r} on rank {rank} has {numel} elements"
        )
    return Chunk((start,), (numel,), record, rank, flat=True)


def _param_groups(pickled: torch_save_files.Pickled) -> list:
    groups = pickled.value.get("param_groups") if isinstance(pickled.value, Mapping) else None
    if not isinstance(groups, list):
        raise FormatError(f"{pickled.source}: not an optimizer state dict (no param_groups)")
    return groups


def _id_to_fqn(groups: list, source: str) -> dict[int, str]:
    """Parameter id → FQN from OLMo's ``param_names`` (FSDP prefixes dropped, as OLMo does)."""
    names = {}
    for group in groups:
        if not isinstance(group, Mapping) or "param_names" not in group:
            raise FormatError(
                f"{source}: param group without param_names; cannot map optimizer ids to names"
            )
        for pid, name in zip(group["params"], group["param_names"], strict=True):
            names[pid] = str(name).replace(FSDP_PREFIX, "")
    return names
