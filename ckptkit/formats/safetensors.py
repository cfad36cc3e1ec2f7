"""safetensors files: one ``x.safetensors``, HF shards with their ``*.index.json``, or a directory.

Only headers are read (8 bytes, then the JSON header of each file, batched across files). A
tensor's key keeps its dotted name whole under the file's group (its stem, shard suffix
dropped): the path is ``(group, name)``, so ``nest`` gives the flat dicts
``safetensors.torch.load_file`` returns (``{"model": {"embed.weight": …}}``) and keys line up
with a DCP checkpoint of the same run whether the file or its directory is opened. In a directory, torch.save files of groups the
safetensors do not hold (``train.pt``, ckptkit's ``model.objects.pt`` side files) are described
too; ``model.pt`` next to ``model.safetensors`` is left out. Files whose tensor names are ALL
OLMo's base64-pickled key paths (``unshard.py --safe-tensors``) are described by the decoded paths;
their pickled non-tensor values are read to list their leaves as object entries.
"""

from __future__ import annotations

import base64
import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

from ..catalog.model import (
    Catalog,
    CatalogBuilder,
    Chunk,
    Encoding,
    Entry,
    Facts,
    Record,
    pickle_leaf,
)
from ..decoding.records import safetensors_file_headers
from ..decoding.unpickler import OBJECT_GLOBALS, safe_loads
from ..errors import CheckpointError, CorruptRecordError, FormatError, MissingFileError
from ..storage import Store
from .detection import Detection, file_location
from .parts import torch_save_files as torch_save

__all__ = ["NAME", "SUFFIX", "INDEX_SUFFIX", "SHARDED_DIR", "detect", "describe", "olmo_keys"]

NAME = "safetensors"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
#: HF's torch.save name for what it calls ``model`` in safetensors (``pytorch_model.bin``).
_SAME_GROUP = {"pytorch_model": "model"}
#: Where torch's ``HuggingFaceStorageWriter`` puts each rank's shards when it also writes the
#: consolidated files beside them.
SHARDED_DIR = "sharded"
_SHARDED_REASON = (
    "per-rank shards of torch's HuggingFaceStorageWriter: the consolidated *.safetensors here "
    "are read instead, and their values may differ from the shards'; open sharded/ to read those"
)


def detect(storage: Store) -> Detection | None:
    """safetensors when the location is a ``.safetensors`` (or index) file, or a directory
    holding any."""
    located = file_location(storage)
    if located is not None:
        parent, name = located
        if name.endswith((SUFFIX, INDEX_SUFFIX)):
            return Detection(NAME, parent, [f"{name} is a safetensors file"], files=[name])
        return None
    try:
        names = storage.listdir()
    except MissingFileError:
        return None
    found = sorted(n for n in names if n.endswith((SUFFIX, INDEX_SUFFIX)))
    if not found:
        return None
    shown = ", ".join(found[:4]) + (" …" if len(found) > 4 else "")
    return Detection(NAME, storage, [f"found {shown}"])


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of the named safetensors ``files`` (an index names its shards) or of a
    whole directory (each file's tensors under its group). Reads headers only."""
    facts: dict[str, Any] = {}
    builder = CatalogBuilder(NAME)
    if files is not None:
        indexes = {n: n[: -len(INDEX_SUFFIX)] for n in files if n.endswith(INDEX_SUFFIX)}
        plain = {n: torch_save.group_of(n) for n in files if not n.endswith(INDEX_SUFFIX)}
        groups, listed = _file_groups(storage, indexes, plain)
        builder.add_files(groups)
        builder.add_all(_describe_safetensors(storage, groups, listed, facts).values())
        return builder.build(Facts(metadata_files=tuple(indexes), **facts))

    listing = storage.listdir()
    indexes = {n: n[: -len(INDEX_SUFFIX)] for n in sorted(listing) if n.endswith(INDEX_SUFFIX)}
    plain = {
        name: torch_save.group_of(name)
        for name, size in sorted(listing.items())
        if name.endswith(SUFFIX) and size >= 0
    }
    groups, listed = _file_groups(storage, indexes, plain)
    pickled = _torch_save_files(storage, listing, set(groups.values()), facts)
    if listing.get(SHARDED_DIR) == -1:  # from the listing made anyway: no listing of its own
        facts.setdefault("skipped_files", {})[f"{SHARDED_DIR}/"] = _SHARDED_REASON
    builder.add_files([*groups, *pickled])
    source = storage.describe()
    builder.add_all(_describe_safetensors(storage, groups, listed, facts).values(), source=source)
    builder.add_all(torch_save.describe_files(storage, pickled, listing).values(), source=source)
    return builder.build(Facts(metadata_files=tuple(indexes), **facts))


def _file_groups(
    storage: Store, indexes: Mapping[str, str], plain: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Safetensors file → group, an index's shards taking the index's group;
    and each key an index lists → the index, to check that its shard holds it."""
    groups: dict[str, str] = {}
    listed: dict[str, str] = {}
    for name, group in indexes.items():
        weight_map = _weight_map(storage, name)
        groups.update(dict.fromkeys(weight_map.values(), group))
        listed.update({f"{group}.{t}": name for t in weight_map})
    for name, group in plain.items():
        groups.setdefault(name, group)
    if not groups:
        raise FormatError(f"{storage.describe()}: no *.safetensors files")
    return groups, listed


def _torch_save_files(
    storage: Store, listing: Mapping[str, int], held: set[str], facts: dict[str, Any]
) -> dict[str, str]:
    """torch.save zips to describe next to safetensors: ckptkit's ``<group>.objects.pt`` side
    files and groups no safetensors file holds; the others go to ``facts["skipped_files"]``."""
    candidates = {
        name: size
        for name, size in sorted(listing.items())
        if name.endswith(torch_save.SUFFIXES) and size >= 0
    }
    files: dict[str, str] = {}
    skipped = {}
    for name, kind in torch_save.probe(storage, candidates).items():
        group = torch_save.group_of(name)
        if kind == "zip" and (
            name.endswith(".objects.pt") or _SAME_GROUP.get(group, group) not in held
        ):
            files[name] = group
        elif kind == "zip":
            skipped[name] = f"{group} is read from safetensors"
        elif kind == "legacy":
            skipped[name] = "legacy (pre-1.6) torch.save format"
    if skipped:
        facts["skipped_files"] = skipped
        shown = "; ".join(f"{name}: {why}" for name, why in list(skipped.items())[:4])
        warnings.warn(
            f"{storage.describe()} holds torch.save files beside safetensors; not read: {shown} "
            "(open such a file by its path to read it instead)",
            stacklevel=2,
        )
    return files


def _weight_map(storage: Store, name: str) -> dict[str, str]:
    """Tensor name → shard file, from an HF ``*.safetensors.index.json``."""
    source = storage.describe(name)
    try:
        weight_map = json.loads(storage.read_file(name))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{source}: not a safetensors index (no weight_map): {exc}") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise FormatError(f"{source}: weight_map must map tensor names to file names")
    return weight_map


def _describe_safetensors(
    storage: Store,
    groups: Mapping[str, str],
    listed: Mapping[str, str],
    facts: dict[str, Any],
) -> dict[str, Entry]:
    """Entries of safetensors files, each tensor keyed ``<group>.<name>``; headers are read in
    two batched rounds. Every key an index ``listed`` must be found."""
    files = list(groups)
    sizes = storage.sizes(files)
    for file in files:
        if sizes[file] is None:
            raise MissingFileError(f"{storage.describe(file)}: no such file")
    headers = safetensors_file_headers(storage, files)
    entries: dict[str, Entry] = {}
    held: set[str] = set()  # <group>.<name as stored>, for the index check
    pending: list[tuple[tuple, Record]] = []  # OLMo's pickled values, decoded below
    metadata = facts.setdefault("header_metadata", {})
    for file, header in headers.items():
        source = storage.describe(file)
        metadata[file] = header.metadata
        group = groups[file]
        olmo = olmo_keys(header.tensors, source)
        if olmo:
            facts["base64_key_files"] = (*facts.get("base64_key_files", ()), file)
        for name, (dt, shape, begin, end) in header.tensors.items():
            held.add(f"{group}.{name}")
            path, pickled = olmo[name] if olmo else ((name,), False)
            path = (group, *path)
            key = ".".join(map(str, path))
            if key in entries:
                raise FormatError(f"{source}: tensor {key!r} is also in another file")
            _check_range(source, name, dt, shape, begin, end, header.data_start, sizes[file])
            if pickled:  # OLMo: a uint8 tensor holding pickle.dumps of a non-tensor value
                record = Record(file, header.data_start + begin, end - begin, Encoding.PICKLE_BYTES)
                pending.append((path, record))
                continue
            record = (
                Record(file, header.data_start + begin, end - begin, Encoding.RAW)
                if end > begin
                else None
            )
            chunk = Chunk((0,) * len(shape), shape, record)
            entries[key] = Entry(key, path, "tensor", (chunk,), dt, shape)
    for key, entry in _pickled_entries(storage, pending).items():
        if key in entries:
            raise FormatError(f"{storage.describe(entry.chunks[0].record.file)}: {key!r} twice")
        entries[key] = entry
    missing = [key for key in listed if key not in held]
    if missing:
        raise FormatError(
            f"{storage.describe(listed[missing[0]])}: lists {missing[0]!r}, which no shard holds"
        )
    return entries


def _check_range(
    source: str, name: str, dt: Any, shape: tuple, begin: int, end: int, start: int, size: int
) -> None:
    """A header's byte range must lie in the file and hold exactly its dtype and shape."""
    if not 0 <= begin <= end or start + end > size:
        raise CorruptRecordError(f"{source}: {name!r} bytes [{begin}, {end}) lie outside the file")
    if end - begin != math.prod(shape) * dt.itemsize:
        raise CorruptRecordError(
            f"{source}: {name!r} has {end - begin} bytes, {dt.name}{list(shape)} needs "
            f"{math.prod(shape) * dt.itemsize}"
        )


def olmo_keys(tensors: Mapping[str, Any], source: str) -> dict[str, tuple[tuple, bool]] | None:
    """OLMo's ``unshard.py --safe-tensors`` names every tensor
    ``urlsafe_b64encode(pickle.dumps((key_path, value_is_pickled)))``: each name → its decoded
    ``(path, pickled)`` when ALL names decode so (tuples of str/int, no globals), else None."""
    decoded = {}
    for name in tensors:
        try:
            raw = base64.b64decode(name, altchars=b"-_", validate=True)
        except ValueError:
            return None
        if not raw.startswith(b"\x80"):
            return None
        try:
            value = safe_loads(raw, allow={}, source=f"{source}: tensor name {name!r}")
        except CheckpointError:
            return None
        if not (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], tuple)
            and value[0]
            and all(type(part) in (str, int) for part in value[0])
            and type(value[1]) is bool
        ):
            return None
        decoded[name] = (tuple(str(part) for part in value[0]), value[1])
    return decoded or None


def _pickled_entries(storage: Store, pending: list[tuple[tuple, Record]]) -> dict[str, Entry]:
    """An object entry per leaf of each pickled value (walked as torch flattens, so OLMo's
    ``param_groups`` gives ``optim.param_groups.0.lr`` as a torch.save ``optim.pt`` does)."""
    blobs = storage.read_ranges([(r.file, r.offset, r.offset + r.length) for _, r in pending])
    entries = {}
    for (path, record), blob in zip(pending, blobs, strict=True):
        source = f"{storage.describe(record.file)} @{record.offset}"
        value = safe_loads(blob, allow=OBJECT_GLOBALS, source=source, unknown="opaque")
        for inner, _ in torch_save.leaves(value):
            leaf = pickle_leaf(
                record.file, record.offset, record.length, inner, encoding=Encoding.PICKLE_BYTES
            )
            full = (*path, *inner)
            key = ".".join(map(str, full))
            entries[key] = Entry(key, full, "object", (Chunk((), (), leaf),))
    return entries
