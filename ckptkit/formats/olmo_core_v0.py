"""OLMo-core 0.x checkpoints (``save_model_and_optim_state``; OLMo's ``olmo_core`` checkpointer).

Layout: ``model/`` and ``optim/``, each ``metadata.json`` + ``rank_{N}.safetensors``, beside
``train/rank{N}.pt`` and ``config.yaml``. ``metadata.json`` is ``{"tensors": {key: {shape,
is_sharded, dtype, shard_spec_per_file: {file: {flattened_offsets: [[start, end), …] |
local_shape + global_offset}}}}}``; each file stores its part of a tensor 1-D, the ranges
concatenated in order, so each range is a flat chunk whose RAW record lies in that file's
safetensors data (0-d tensors are stored with shape ``[1]``).

The optimizer is saved flattened: ``state.<fqn>.__<name>`` tensors, ``num_param_groups`` and
``param_group<i>`` (a pickle of the group dict in a uint8 tensor, with ``_param_names``).
Keys follow OLMo-core's own ``unshard_optim_state`` (what OLMo's unsharder writes):
``optim.state.<param id>.<name>`` and ``optim.param_groups.<i>.<field>`` (``_param_names``
dropped); model keys are ``model.<fqn>``; ``train.…`` is ``train/rank0.pt``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .. import dtypes
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
    pickle_leaf,
)
from ..decoding.records import SafetensorsHeader, safetensors_file_headers
from ..decoding.unpickler import OBJECT_GLOBALS, safe_loads
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..storage import Store
from .detection import Detection, file_location
from .parts.rank_sets import TRAIN_GROUP, describe_ranks, rank_files
from .parts.torch_save_files import leaves
from .parts.unfinished import check_olmo_config

__all__ = ["NAME", "METADATA", "STATE_PREFIX", "STATE_SEPARATOR", "detect", "describe"]

NAME = "olmo_core_v0"
METADATA = "metadata.json"
STATE_PREFIX = "state."
STATE_SEPARATOR = ".__"
#: Flattened-optimizer bookkeeping that OLMo-core's unsharder consumes, not part of the state.
_BOOKKEEPING = ("num_param_groups", "state_keys")


def detect(storage: Store) -> Detection | None:
    """OLMo-core 0.x: ``model/metadata.json`` next to ``model/rank_*.safetensors``."""
    if file_location(storage) is not None:
        return None
    try:
        listing = storage.listdir()
        if listing.get("model") != -1:
            return None
        model = storage.listdir("model")
    except MissingFileError:
        return None
    ranks = sorted(n for n in model if n.startswith("rank_") and n.endswith(".safetensors"))
    if METADATA not in model or not ranks:
        return None
    evidence = [f"model/{METADATA}", f"model/{ranks[0]} … ({len(ranks)} rank files)"]
    if listing.get("optim") == -1:
        evidence.append("optim/")
    return Detection(NAME, storage, evidence)


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of an OLMo-core 0.x checkpoint directory; reads JSON and headers only (plus
    the pickled param groups, to map optimizer state to parameter ids)."""
    listing = storage.listdir()
    parts = ["model"] + (["optim"] if listing.get("optim") == -1 else [])
    metadata = {part: _metadata(storage, f"{part}/{METADATA}") for part in parts}
    data_files = sorted(
        {f"{part}/{file}" for part, tensors in metadata.items() for file in _files(tensors)}
    )
    headers = _headers(storage, data_files)
    facts: dict[str, Any] = {"metadata_files": tuple(f"{part}/{METADATA}" for part in parts)}
    builder = CatalogBuilder(NAME)
    builder.add_files(data_files)
    source = storage.describe()
    builder.add_all(_entries(storage, "model", metadata["model"], headers).values(), source=source)
    if "optim" in metadata:
        builder.add_all(_optim_entries(storage, metadata["optim"], headers, facts).values())
    if listing.get("train") == -1:  # every rank's copy; reads give rank 0's, as OLMo keeps
        train_files = rank_files(storage, storage.listdir("train"), prefix="train/")
        ranks = describe_ranks(storage, train_files, group=TRAIN_GROUP)
        ranks.raise_for_missing(storage)
        builder.add_files(train_files.values())
        builder.add_all(ranks.entries.values(), source=storage.describe("train"))
        facts["rank_files"] = tuple(train_files.values())
    return builder.build(Facts(unfinished=check_olmo_config(storage), **facts))


def _metadata(storage: Store, name: str) -> dict[str, Any]:
    source = storage.describe(name)
    try:
        tensors = json.loads(storage.read_file(name))["tensors"]
    except MissingFileError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{source}: not OLMo-core metadata (no 'tensors'): {exc}") from exc
    if not isinstance(tensors, dict):
        raise FormatError(f"{source}: 'tensors' must map keys to tensor metadata")
    for key, spec in tensors.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
            raise FormatError(f"{source}: {key!r} has no shape")
        if "flattened_offsets_per_file" in spec:  # the oldest layout: {file: [start, end] | […]}
            spec["shard_spec_per_file"] = {
                file: {"flattened_offsets": [offsets] if isinstance(offsets[0], int) else offsets}
                for file, offsets in dict(spec.pop("flattened_offsets_per_file")).items()
                if isinstance(offsets, list) and offsets
            }
        if not isinstance(spec.get("shard_spec_per_file"), dict):
            raise FormatError(f"{source}: {key!r} has no shard_spec_per_file")
    return tensors


def _files(tensors: Mapping[str, Any]) -> set[str]:
    return {file for spec in tensors.values() for file in spec["shard_spec_per_file"]}


def _headers(storage: Store, files: list[str]) -> dict[str, tuple[SafetensorsHeader, int]]:
    """Each safetensors file's header and size."""
    sizes = storage.sizes(files)
    for file in files:
        if sizes[file] is None:
            raise MissingFileError(f"{storage.describe(file)}: listed in metadata.json, missing")
    headers = safetensors_file_headers(storage, files)
    return {file: (headers[file], sizes[file]) for file in files}


def _entries(
    storage: Store,
    part: str,
    tensors: Mapping[str, Any],
    headers: Mapping[str, tuple[SafetensorsHeader, int]],
) -> dict[str, Entry]:
    """An entry per metadata key (path ``(part, key)``), flat chunks from every file's ranges."""
    entries = {}
    for key, spec in tensors.items():
        source = storage.describe(f"{part}/{METADATA}")
        try:
            dt = dtypes.from_safetensors(spec["dtype"])
            shape = tuple(int(n) for n in spec["shape"])
        except (KeyError, TypeError, ValueError, FormatError) as exc:
            raise FormatError(f"{source}: {key!r} has a bad dtype or shape: {exc}") from exc
        chunks: list[Chunk] = []
        for file, shard in spec["shard_spec_per_file"].items():
            path = f"{part}/{file}"
            try:
                chunks.extend(_file_chunks(storage, path, key, dt, shape, shard, headers[path]))
            except (AttributeError, TypeError, ValueError, IndexError) as exc:
                raise FormatError(
                    f"{source}: {key!r} has a bad shard spec for {file}: {exc}"
                ) from exc
        _check_cover(source, key, shape, chunks)
        entries[key] = Entry(f"{part}.{key}", (part, key), "tensor", tuple(chunks), dt, shape)
    return entries


def _file_chunks(
    storage: Store,
    file: str,
    key: str,
    dt: dtypes.DType,
    shape: tuple[int, ...],
    shard: Mapping[str, Any],
    header: tuple[SafetensorsHeader, int],
) -> list[Chunk]:
    """The chunks one file holds of ``key``: its flattened ranges, in order, one after another
    in the file's 1-D tensor (or one box for a ``local_shape`` + ``global_offset`` shard)."""
    source = storage.describe(file)
    rank = _rank_of(file)
    ranges = shard.get("flattened_offsets")
    if ranges is not None:
        boxes = [((int(a),), (int(b) - int(a),), True) for a, b in ranges]
    elif shard.get("local_shape") is not None and shard.get("global_offset") is not None:
        boxes = [(tuple(shard["global_offset"]), tuple(shard["local_shape"]), False)]
    else:
        raise FormatError(f"{source}: {key!r} shard has neither flattened_offsets nor a box")
    total = sum(math.prod(sizes) for _, sizes, _ in boxes)
    if total == 0:
        return []
    parsed, size = header
    found = parsed.tensors.get(key)
    if found is None:
        raise FormatError(f"{source}: metadata.json places {key!r} here; the file lacks it")
    stored_dt, stored_shape, begin, end = found
    if stored_dt != dt or math.prod(stored_shape) != total or end - begin != total * dt.itemsize:
        raise CorruptRecordError(
            f"{source}: {key!r} is {stored_dt.name}{list(stored_shape)} in the file; "
            f"metadata.json says {total} {dt.name} elements here"
        )
    if parsed.data_start + end > size:
        raise CorruptRecordError(f"{source}: {key!r} bytes lie past the end of the file")
    chunks = []
    at = parsed.data_start + begin
    for offsets, sizes, flat in boxes:
        n = math.prod(sizes) * dt.itemsize
        if n:
            if flat and len(shape) == 0 and offsets == (0,):
                chunks.append(Chunk((), (), Record(file, at, n, Encoding.RAW), rank))
            else:
                chunks.append(Chunk(offsets, sizes, Record(file, at, n, Encoding.RAW), rank, flat))
        at += n
    return chunks


def _rank_of(file: str) -> int | None:
    name = file.rsplit("/", 1)[-1]
    number = name.removeprefix("rank_").removesuffix(".safetensors")
    return int(number) if number.isdigit() else None


def _check_cover(source: str, key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Flat ranges must tile the tensor exactly (a replicated tensor may repeat whole)."""
    numel = math.prod(shape)
    if not chunks and numel:
        raise FormatError(f"{source}: {key!r}: no file holds any of its {numel} elements")
    check_chunks(key, shape, distinct_chunks(chunks), source=source, pieces="the files' ranges")


# --------------------------------------------------------------------------------------------
# The flattened optimizer.


def _optim_entries(
    storage: Store,
    tensors: Mapping[str, Any],
    headers: Mapping[str, tuple[SafetensorsHeader, int]],
    facts: dict[str, Any],
) -> dict[str, Entry]:
    """``optim.state.<id>.<name>`` tensors and ``optim.param_groups.<i>.<field>`` objects."""
    source = storage.describe(f"optim/{METADATA}")
    groups = sorted(
        (k for k in tensors if k.startswith("param_group") and k[len("param_group") :].isdigit()),
        key=lambda k: int(k[len("param_group") :]),
    )
    stored = _entries(storage, "optim", {k: tensors[k] for k in groups}, headers)
    decoded = _decode_groups(storage, [stored[k] for k in groups])
    ids: dict[str, Any] = {}
    entries: dict[str, Entry] = {}
    for index, (name, group) in enumerate(zip(groups, decoded, strict=True)):
        if not isinstance(group, Mapping):
            raise FormatError(f"{source}: {name} does not hold a param group dict")
        names, params = group.get("_param_names"), group.get("params")
        if names is None or params is None or len(names) != len(params):
            raise FormatError(f"{source}: {name} has no _param_names matching its params")
        ids.update(zip(names, params, strict=True))
        chunk = stored[name].chunks[0]
        for inner, _ in leaves(group):
            if inner[0] == "_param_names":  # OLMo-core's own bookkeeping, dropped on unshard
                continue
            record = chunk.record
            leaf = pickle_leaf(
                record.file, record.offset, record.length, inner, encoding=Encoding.PICKLE_BYTES
            )
            path = ("optim", "param_groups", index, *inner)
            key = ".".join(map(str, path))
            entries[key] = Entry(key, path, "object", (Chunk((), (), leaf, chunk.rank),))
    state = {k: v for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
    others = {k: v for k, v in tensors.items() if k not in state and k not in groups}
    facts["bookkeeping_keys"] = tuple(sorted(k for k in others if k in _BOOKKEEPING))
    for key, entry in _entries(storage, "optim", state, headers).items():
        fqn, _, name = key[len(STATE_PREFIX) :].rpartition(STATE_SEPARATOR)
        if fqn not in ids:
            raise FormatError(f"{source}: {key!r} names parameter {fqn!r}, which no group lists")
        pid = ids[fqn]
        flat_key = f"optim.state.{pid}.{name}"
        path = ("optim", "state", str(pid), name)
        entries[flat_key] = Entry(flat_key, path, "tensor", entry.chunks, entry.dtype, entry.shape)
    extra = {k: v for k, v in others.items() if k not in _BOOKKEEPING}
    for entry in _entries(storage, "optim", extra, headers).values():
        entries[entry.key] = entry
    return _in_state_order(entries, ids)


def _decode_groups(storage: Store, stored: list[Entry]) -> list[Any]:
    """The pickled param groups (uint8 tensors, one record each), fetched in one batch."""
    for entry in stored:
        chunk = entry.chunks[0] if entry.chunks else None
        if entry.dtype.name != "uint8" or chunk is None or chunk.numel != entry.numel:
            raise FormatError(
                f"{storage.describe(f'optim/{METADATA}')}: {entry.key!r} is not a pickled param "
                "group (one uint8 range in one file)"
            )
    records = [entry.chunks[0].record for entry in stored]
    blobs = storage.read_ranges([(r.file, r.offset, r.offset + r.length) for r in records])
    return [
        safe_loads(blob, allow=OBJECT_GLOBALS, source=storage.describe(r.file), unknown="opaque")
        for r, blob in zip(records, blobs, strict=True)
    ]


def _in_state_order(entries: dict[str, Entry], ids: Mapping[str, Any]) -> dict[str, Entry]:
    """State entries in param-group order (then by name), then everything else."""
    order = {str(pid): i for i, pid in enumerate(ids.values())}
    state = sorted(
        (e for e in entries.values() if e.path[1] == "state"),
        key=lambda e: (order.get(e.path[2], len(order)), e.path[3]),
    )
    rest = [e for e in entries.values() if e.path[1] != "state"]
    return {e.key: e for e in [*state, *rest]}
