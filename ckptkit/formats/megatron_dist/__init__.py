"""Megatron-core ``dist_checkpointing`` checkpoints, ``torch_dist`` backend, read without Megatron.

Layout: a DCP directory (``.metadata`` + ``__R_K.distcp``) plus ``metadata.json``
(``{"sharded_backend": "torch_dist", …}``), ``common.pt`` (torch.save of the args Namespace,
iteration, scheduler…) and, from 0.18, ``integrity.json`` (SHA-256 per file, checked by
``verify``). A training run directory (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``)
opens the iteration the tracker names. ``.metadata`` pickles Megatron's ``MCoreMetadata`` /
``MCoreSavePlan`` (<= 0.15) or torch's save-plan classes via ``getattr`` (0.16): they are decoded
by the stand-ins of :mod:`.parts.megatron_pickles`, allowed for this format only.

Keys. Stored DCP keys are Megatron's ShardedTensor keys; they are placed in groups:

* ``model.<key>``: model tensors; a stacked layer tensor (``decoder.layers.mlp.linear_fc1.weight``
  ``[L, …]``) appears as ``L`` per-layer entries ``model.decoder.layers.{i}.mlp.linear_fc1.weight``
  (what a TP=1 Megatron model's ``state_dict`` names them; TransformerEngine-style layer-norm
  names such as ``linear_qkv.layer_norm_weight`` are kept as stored), layer by layer;
* ``optimizer.<rest>``: optimizer state, stacked ones split per layer the same way; ``dp_reshardable``
  flat buckets as stored (their padding holds whatever memory the writer had: compare them
  with care); ``fully_sharded_model_space`` (<= 0.15) tensors, stored reshaped
  ``[X//x, Y//y, Z//z, x·y·z]``, in their true shape from ``mcore_data``
  (``nd_reformulated_orig_global_shape``) when that is a pure reshape of the stored bytes (their
  chunks then are flat ranges over the same records), else as stored; either way not split per
  layer;
* ``stacked.<stored key>``: every stacked tensor exactly as stored, ``[L, …]``. These are the same
  bytes as the per-layer entries (no copy: the per-layer records point into the stored ones), so
  the group is an alternate view (``Facts.alternate_groups``): listed and readable, but left out
  of unshard, convert, diff and stats unless asked for by name (``groups="stacked"``,
  ``keys="stacked.*"``);
* ``rng_state.<shard>`` and the other ShardedObjects (``key/shard_<offsets>_<shape>``, e.g.
  ``model.decoder.layers.self_attention.linear_proj._extra_state/shard_0_2``): objects, each the
  ``torch.save`` value Megatron wrote;
* ``common.<key>``: the leaves of ``common.pt`` (or of the ``common_state`` entry, >= 0.19).

Not supported (recognised, with a clear error): other sharded backends (``zarr``). The legacy
``--ckpt-format torch`` layout (``mp_rank_XX/model_optim_rng.pt``) is :mod:`..megatron_legacy`'s.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

from ...catalog.model import Catalog, CatalogBuilder, Chunk, Entry, Facts, pickle_leaf
from ...decoding.unpickler import OBJECT_GLOBALS, TensorRef, safe_loads
from ...errors import CheckpointError, FormatError, MissingFileError
from ...storage import Store
from ..detection import Detection
from ..parts.dcp_metadata import DATA_FILE, METADATA, read_dcp
from ..parts.megatron_tracker import TRACKER, detect_run, tracker_error
from ..parts.torch_save_files import leaves, load_pickles, pickle_entries, tensor_record
from .layers import archive_pickles, layer_chunks, layer_key, stacked_name
from .pickles import MEGATRON_GLOBALS, mcore_data

NAME = "megatron_dist"
CONFIG = "metadata.json"
COMMON = "common.pt"
INTEGRITY = "integrity.json"
#: Groups of stored keys by their first part; everything else is the model's.
_TOP = {"optimizer.": "optimizer", "rng_state/": "rng_state", "common_state/": "common"}
STACKED_GROUP = "stacked"
_REFORMULATED = "nd_reformulated_orig_global_shape"


def detect(storage: Store) -> Detection | None:
    """A ``torch_dist`` directory (``metadata.json`` naming its backend, beside ``.metadata``),
    or a run directory whose tracker names one.

    The tracker alone decides nothing (verl writes one too, beside ``global_step_N/``): a run
    directory is Megatron's when the iteration it names holds Megatron content, or when the
    tracker names no checkpoint but ``iter_NNNNNNN/`` folders are there (then describe() says
    what the tracker names and which iterations hold one)."""
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return None
    found = _detect_here(storage, listing)
    if found is not None:
        return found
    return detect_run(storage, listing, NAME, _detect_here, bare=True)


def _detect_here(storage: Store, listing: dict[str, int]) -> Detection | None:
    if CONFIG in listing:
        config = _config(storage)
        if config is None:
            return None  # some other metadata.json
        backend = config.get("sharded_backend")
        evidence = [f"found {CONFIG} (sharded_backend: {backend})"]
        if METADATA in listing:
            evidence.append(f"found {METADATA} (DCP)")
        evidence += [f"found {name}" for name in (COMMON, INTEGRITY) if name in listing]
        return Detection(NAME, storage, evidence)
    return None


def _config(storage: Store) -> dict[str, Any] | None:
    """``metadata.json`` when it is a Megatron one (a JSON object naming ``sharded_backend``)."""
    try:
        config = json.loads(storage.read_file(CONFIG, max_bytes=1 << 20))
    except (CheckpointError, ValueError, UnicodeDecodeError):  # unreadable, too big, not JSON
        return None
    if isinstance(config, dict) and isinstance(config.get("sharded_backend"), str):
        return config
    return None


def describe(storage: Store) -> Catalog:
    """The catalog of a ``torch_dist`` directory: its DCP metadata, ``common.pt`` and per-layer
    views of the stacked layer tensors (reading their records' zip directories)."""
    _check_supported(storage)
    mcore: dict[str, dict] = {}
    entries, files, facts = read_dcp(
        storage,
        extra_globals=MEGATRON_GLOBALS,
        on_metadata=lambda _, metadata: mcore.update(mcore_data(metadata)),
    )
    builder = CatalogBuilder(NAME)
    builder.add_files(files)
    source = storage.describe()
    builder.add_all(_placed_entries(storage, entries, mcore), source=source)
    listing = storage.listdir()
    if COMMON in listing:
        builder.add_files([COMMON])
        pickled = load_pickles(storage, [COMMON])[COMMON]
        builder.add_all(pickle_entries(pickled, "common"), source=storage.describe(COMMON))
    ranks = [int(m.group(1)) for f in files if (m := DATA_FILE.match(f))]
    extra = tuple(name for name in (CONFIG, INTEGRITY) if name in listing)
    facts["metadata_files"] = (*facts["metadata_files"], *extra)
    return builder.build(
        Facts(
            **facts,
            layout="Megatron-core torch_dist",
            world_size=max(ranks) + 1 if ranks else None,
            alternate_groups=(STACKED_GROUP,),
        )
    )


def _check_supported(storage: Store) -> None:
    """Refuse, naming the layout, what this adapter recognises but cannot read."""
    listing = storage.listdir()
    found = _detect_here(storage, listing)
    if found is None and TRACKER in listing:
        raise tracker_error(storage, listing, _detect_here)
    if found is None:
        raise FormatError(f"{storage.describe()}: not a Megatron-core dist_checkpointing directory")
    backend = (_config(storage) or {}).get("sharded_backend")
    if backend != "torch_dist":
        raise FormatError(
            f"{storage.describe(CONFIG)}: Megatron sharded_backend {backend!r} is recognised but "
            "not supported (only torch_dist)"
        )


def _group(key: str) -> tuple[str, str]:
    """``(group, key within it)`` of a stored key."""
    for prefix, group in _TOP.items():
        if key.startswith(prefix):
            return group, key[len(prefix) :]
    return "model", key


def _placed_entries(storage: Store, entries: list[Entry], mcore: dict[str, dict]) -> list[Entry]:
    """The stored entries under their groups, stacked tensors as per-layer entries (layer by
    layer, where the first stacked one of their group was) plus the stored originals."""
    stacked = [
        e
        for e in entries
        if e.kind == "tensor"
        and e.shape
        and stacked_name(_group(e.key)[1])
        and _REFORMULATED not in mcore.get(e.key, {})
        and not any(c.record is not None and c.record.transform for c in e.chunks)
    ]
    layers, failed = layer_chunks(storage, stacked)
    for key, why in failed.items():
        warnings.warn(
            f"{storage.describe()}: {key!r} has no per-layer views (read it as "
            f"{STACKED_GROUP}.{key}): {why}",
            stacklevel=2,
        )
    blocks: dict[str, list[tuple[int, int, Entry]]] = {}
    out: list[Entry | str] = []
    for position, entry in enumerate(entries):
        group, inner = _group(entry.key)
        if entry.key in failed:  # kept under ``stacked.`` only
            continue
        if entry.key not in layers:
            chunks, shape = entry.chunks, entry.shape
            true_shape = mcore.get(entry.key, {}).get(_REFORMULATED)
            if entry.kind == "tensor" and true_shape is not None:
                chunks, shape = _reshaped(entry, true_shape) or (chunks, shape)
            out.append(
                Entry(
                    f"{group}.{inner}",
                    (group, inner),
                    entry.kind,
                    chunks,
                    entry.dtype,
                    shape,
                )
            )
            continue
        if group not in blocks:
            blocks[group] = []
            out.append(group)  # where this group's per-layer block goes
        for layer, chunks in enumerate(layers[entry.key]):
            name = layer_key(inner, layer)
            view = Entry(
                f"{group}.{name}", (group, name), "tensor", chunks, entry.dtype, entry.shape[1:]
            )
            blocks[group].append((layer, position, view))
    placed = []
    for item in out:
        if isinstance(item, str):
            placed += [view for _, _, view in sorted(blocks[item], key=lambda b: b[:2])]
        elif item.kind == "object" and _plain(item):
            try:
                placed += _object_leaves(storage, item)
            except MissingFileError:  # kept whole: reading it names the missing file
                placed.append(item)
        else:
            placed.append(item)
    placed += [
        Entry(
            f"{STACKED_GROUP}.{e.key}", (STACKED_GROUP, e.key), "tensor", e.chunks, e.dtype, e.shape
        )
        for e in stacked
    ]
    return placed


def _plain(entry: Entry) -> bool:
    """An object whose one record is a plain torch.save archive (no zstd)."""
    return (
        len(entry.chunks) == 1
        and entry.chunks[0].record is not None
        and not (entry.chunks[0].record.transform)
    )


def _object_leaves(storage: Store, entry: Entry) -> list[Entry]:
    """A ShardedObject (``torch.save([obj])``) as the leaves of ``obj`` under its key: tensors
    inside it (RNG states) as RAW tensor entries, the rest read from its ``data.pkl``, as torch
    flattens a state dict. The one-element list Megatron wraps ``obj`` in is not a level."""
    record = entry.chunks[0].record
    ((index, data),) = archive_pickles(storage, [record])
    source = f"{storage.describe(record.file)} @{record.offset} ({entry.key})"
    value = safe_loads(data, allow=OBJECT_GLOBALS, source=source, unknown="opaque")
    wrapped = isinstance(value, list) and len(value) == 1
    data_pkl = index.member("data.pkl", source)
    out = []
    # the >= 0.19 ``common_state/shard_0_1`` entry holds what common.pt held: its leaves are
    # ``common.<key>``, not under the shard's name
    base = entry.path[:1] if entry.path[0] == "common" else entry.path
    for inner, leaf in leaves(value[0] if wrapped else value):
        path = (*base, *inner)
        key = ".".join(map(str, path))
        if isinstance(leaf, TensorRef):
            piece = tensor_record(key, leaf, index, source)
            chunk = Chunk((0,) * len(leaf.shape), leaf.shape, piece, entry.chunks[0].rank)
            out.append(Entry(key, path, "tensor", (chunk,), leaf.dtype, leaf.shape))
        else:
            at = pickle_leaf(
                record.file,
                data_pkl.offset,
                data_pkl.size,
                [0, *inner] if wrapped else list(inner),
                crc32=data_pkl.crc32,
            )
            out.append(Entry(key, path, "object", (Chunk((), (), at, entry.chunks[0].rank),)))
    return out


def _reshaped(entry: Entry, shape: Any) -> tuple[tuple[Chunk, ...], tuple[int, ...]] | None:
    """A ``fully_sharded_model_space`` tensor (stored ``[X//x, Y//y, …, x·y·…]``) in its true
    ``shape``, when that is a pure reshape of the stored bytes (the blocks split one axis at
    most: leading axes whole, trailing ones in the block) and every stored chunk is one
    contiguous range of them: the chunks become flat ranges over the same records. None when
    it is not (then the tensor stays as stored)."""
    stored = entry.shape
    if (
        not isinstance(shape, tuple | list)
        or not all(type(n) is int and n >= 0 for n in shape)
        or len(stored) != len(shape) + 1
        or math.prod(stored) != math.prod(shape)
    ):
        return None
    split = next(
        (i for i, (t, n) in enumerate(zip(stored, shape, strict=False)) if t != n), len(shape)
    )
    if any(stored[i] != 1 for i in range(split + 1, len(shape))) or (
        split < len(shape) and (stored[split] == 0 or shape[split] % stored[split])
    ):
        return None
    strides = [math.prod(stored[i + 1 :]) for i in range(len(stored))]
    chunks = []
    for chunk in entry.chunks:
        first = next((i for i, n in enumerate(chunk.sizes) if n != 1), len(stored))
        tail = range(first + 1, len(stored))
        if any(chunk.sizes[i] != stored[i] or chunk.offsets[i] for i in tail):
            return None  # not one contiguous range of the stored elements
        start = sum(o * s for o, s in zip(chunk.offsets, strides, strict=True))
        chunks.append(Chunk((start,), (chunk.numel,), chunk.record, chunk.rank, flat=True))
    return tuple(chunks), tuple(shape)


__all__ = [
    "COMMON",
    "CONFIG",
    "INTEGRITY",
    "NAME",
    "STACKED_GROUP",
    "TRACKER",
    "describe",
    "detect",
]
