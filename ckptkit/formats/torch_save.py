"""Unsharded torch.save files: one ``model.pt``, or a directory of ``<group>.pt`` files. Each
file's keys sit under its group, the file's stem (see :mod:`.parts.torch_save_files`)."""

from __future__ import annotations

from ..catalog import Catalog, CatalogBuilder
from ..errors import FormatError, MissingFileError
from ..storage import Storage
from .detection import Detection, file_location
from .parts.torch_save_files import describe_files, directory_files, group_of, probe, refuse_legacy

NAME = "torch_save"


def detect(storage: Storage) -> Detection | None:
    """torch.save when the location is a zip file, or a directory holding ``*.pt`` zips."""
    located = file_location(storage)
    if located is not None:
        parent, name = located
        kinds = probe(parent, {name: parent.size(name)})
        refuse_legacy(parent, kinds)
        if kinds[name] != "zip":
            return None
        return Detection(NAME, parent, [f"{name} is a torch.save zip"], files=[name])
    try:
        files = directory_files(storage)
    except MissingFileError:
        return None
    if not files:
        return None
    shown = ", ".join(list(files)[:4]) + (" …" if len(files) > 4 else "")
    return Detection(NAME, storage, [f"torch.save zips: {shown}"])


def describe(storage: Storage, files: list[str] | None = None) -> Catalog:
    """The catalog of the named torch.save ``files`` or of a whole directory: each file's keys
    sit under its group (its stem: ``model.pt``'s ``embed.weight`` is ``model.embed.weight``),
    whichever of the two was opened. Reads zip directories and pickles only."""
    sizes = None
    if files is None:
        sizes = directory_files(storage)
        if not sizes:
            raise FormatError(f"{storage.describe()}: no torch.save files (*.pt, *.pth, *.bin)")
    groups = {name: group_of(name) for name in (files if files is not None else sizes)}
    builder = CatalogBuilder(NAME)
    builder.add_files(groups)
    builder.add_all(describe_files(storage, groups, sizes).values(), source=storage.describe())
    return builder.build()
