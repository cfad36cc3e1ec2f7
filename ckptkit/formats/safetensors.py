"""safetensors files: one ``x.safetensors``, HF shards with their ``*.index.json``, or a directory.

Only headers are read (8 bytes, then the JSON header of each file, batched across files). A
tensor's key keeps its dotted name whole under the file's group (its stem, shard suffix
dropped): the path is ``(group, name)``, so ``nest`` gives the flat dicts
``safetensors.torch.load_file`` returns (``{"model": {"embed.weight": …}}``) and keys line up
with a DCP checkpoint of the same run whether the file or its directory is opened. In a directory, torch.save files of groups the
safetensors do not hold (``train.pt``, ckptkit's ``model.objects.pt`` side files) are described
too; ``model.pt`` next to ``model.safetensors`` is left out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ..catalog import Catalog, Chunk, Encoding, Entry, Record
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..records import parse_safetensors_header, safetensors_header_length
from ..storage import Storage
from . import torch_save
from .detection import Detection, file_location

NAME = "safetensors"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
#: HF's torch.save name for what it calls ``model`` in safetensors (``pytorch_model.bin``).
_SAME_GROUP = {"pytorch_model": "model"}


def detect(storage: Storage) -> Detection | None:
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


def describe(storage: Storage, files: list[str] | None = None) -> Catalog:
    """The catalog of the named safetensors ``files`` (an index names its shards) or of a
    whole directory (each file's tensors under its group). Reads headers only."""
    info: dict[str, Any] = {}
    if files is not None:
        indexes = {n: n[: -len(INDEX_SUFFIX)] for n in files if n.endswith(INDEX_SUFFIX)}
        plain = {n: torch_save.group_of(n) for n in files if not n.endswith(INDEX_SUFFIX)}
        groups, listed = _file_groups(storage, indexes, plain)
        entries = _describe_safetensors(storage, groups, listed, info)
        return Catalog(NAME, entries, list(groups), info)

    listing = storage.listdir()
    indexes = {n: n[: -len(INDEX_SUFFIX)] for n in sorted(listing) if n.endswith(INDEX_SUFFIX)}
    plain = {
        name: torch_save.group_of(name)
        for name, size in sorted(listing.items())
        if name.endswith(SUFFIX) and size >= 0
    }
    groups, listed = _file_groups(storage, indexes, plain)
    entries = _describe_safetensors(storage, groups, listed, info)
    pickled = _torch_save_files(storage, listing, set(groups.values()), info)
    for key, entry in torch_save.describe_files(storage, pickled, listing).items():
        if key in entries:
            raise FormatError(f"{storage.describe()}: {key!r} is in safetensors and torch.save")
        entries[key] = entry
    return Catalog(NAME, entries, [*groups, *pickled], info)


def _file_groups(
    storage: Storage, indexes: Mapping[str, str], plain: Mapping[str, str]
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
    storage: Storage, listing: Mapping[str, int], held: set[str], info: dict[str, Any]
) -> dict[str, str]:
    """torch.save zips to describe next to safetensors: ckptkit's ``<group>.objects.pt`` side
    files and groups no safetensors file holds; the others are noted in ``info["skipped"]``."""
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
        info["skipped"] = skipped
    return files


def _weight_map(storage: Storage, name: str) -> dict[str, str]:
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
    storage: Storage,
    groups: Mapping[str, str],
    listed: Mapping[str, str],
    info: dict[str, Any],
) -> dict[str, Entry]:
    """Entries of safetensors files, each tensor keyed ``<group>.<name>``; headers are read in
    two batched rounds. Every key an index
    ``listed`` must be found."""
    files = list(groups)
    sizes = storage.sizes(files)
    for file in files:
        if sizes[file] is None:
            raise MissingFileError(f"{storage.describe(file)}: no such file")
    prefixes = storage.read_ranges([(file, 0, 8) for file in files])
    lengths = [
        safetensors_header_length(prefix, storage.describe(file))
        for file, prefix in zip(files, prefixes, strict=True)
    ]
    raws = storage.read_ranges([(file, 8, 8 + n) for file, n in zip(files, lengths, strict=True)])
    entries: dict[str, Entry] = {}
    metadata = info.setdefault("metadata", {})
    for file, raw in zip(files, raws, strict=True):
        source = storage.describe(file)
        header = parse_safetensors_header(raw, source)
        metadata[file] = header.metadata
        group = groups[file]
        for name, (dt, shape, begin, end) in header.tensors.items():
            key = f"{group}.{name}"
            if key in entries:
                raise FormatError(f"{source}: tensor {key!r} is also in another file")
            if not 0 <= begin <= end or header.data_start + end > sizes[file]:
                raise CorruptRecordError(
                    f"{source}: {name!r} bytes [{begin}, {end}) lie outside the file"
                )
            if end - begin != math.prod(shape) * dt.itemsize:
                raise CorruptRecordError(
                    f"{source}: {name!r} has {end - begin} bytes, {dt.name}{list(shape)} needs "
                    f"{math.prod(shape) * dt.itemsize}"
                )
            record = (
                Record(file, header.data_start + begin, end - begin, Encoding.RAW)
                if end > begin
                else None
            )
            path = (group, name)
            chunk = Chunk((0,) * len(shape), shape, record)
            entries[key] = Entry(key, path, "tensor", (chunk,), dt, shape)
    missing = [key for key in listed if key not in entries]
    if missing:
        raise FormatError(
            f"{storage.describe(listed[missing[0]])}: lists {missing[0]!r}, which no shard holds"
        )
    return entries
