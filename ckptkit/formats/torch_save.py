"""Unsharded torch.save files: one ``model.pt``, or a directory of ``<group>.pt`` files (zips, or
the pre-1.6 non-zip format). Each file's keys sit under its group, the file's stem without its
checkpoint suffix (see :mod:`.parts.torch_save_files`)."""

from __future__ import annotations

from ..catalog.model import Catalog, CatalogBuilder
from ..errors import FormatError, MissingFileError
from ..storage import Store
from .detection import Detection, file_location
from .parts.torch_save_files import describe_files, directory_files, group_of, probe

__all__ = ["NAME", "detect", "describe"]

NAME = "torch_save"
#: How detection names each kind of file.
_KINDS = {"zip": "a torch.save zip", "legacy": "a pre-1.6 (non-zip) torch.save file"}


def detect(storage: Store) -> Detection | None:
    """torch.save when the location is a torch.save file (zip or pre-1.6), or a directory
    holding such files under a checkpoint suffix (``*.pt``, ``*.pth``, ``*.ckpt``…)."""
    located = file_location(storage)
    if located is not None:
        parent, name = located
        kind = probe(parent, {name: parent.size(name)})[name]
        if kind is None:
            return None
        return Detection(NAME, parent, [f"{name} is {_KINDS[kind]}"], files=[name])
    try:
        files = directory_files(storage)
    except MissingFileError:
        return None
    if not files:
        return None
    shown = ", ".join(list(files)[:4]) + (" …" if len(files) > 4 else "")
    return Detection(NAME, storage, [f"torch.save files: {shown}"])


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of the named torch.save ``files`` or of a whole directory: each file's keys
    sit under its group (its stem: ``model.pt``'s ``embed.weight`` is ``model.embed.weight``),
    whichever of the two was opened. Reads zip directories, storage headers and pickles only."""
    sizes = None
    if files is None:
        sizes = directory_files(storage)
        if not sizes:
            raise FormatError(
                f"{storage.describe()}: no torch.save files "
                "(*.pt, *.pth, *.bin, *.ckpt, *.pth.tar, *.tar, *.jit)"
            )
    groups = {name: group_of(name) for name in (files if files is not None else sizes)}
    builder = CatalogBuilder(NAME)
    builder.add_files(groups)
    builder.add_all(describe_files(storage, groups, sizes).values(), source=storage.describe())
    return builder.build()
