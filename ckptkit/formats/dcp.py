"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``__R_K.distcp`` files.

Described from the metadata alone (see :mod:`.parts.dcp_metadata`); never reads a data file.
"""

from __future__ import annotations

from ..catalog.model import Catalog, CatalogBuilder, Facts
from ..errors import MissingFileError
from ..storage import Store
from .detection import Detection
from .parts.dcp_metadata import DATA_FILE, METADATA, RANK_METADATA, read_dcp

__all__ = ["NAME", "SUBDIRS", "detect", "describe"]

NAME = "dcp"
#: Where OLMo ("torch_new") and OLMo-core put the DCP directory inside a step directory.
SUBDIRS = ("model_and_optim",)


def detect(storage: Store) -> Detection | None:
    """DCP when ``.metadata`` (or rank-local ``__R.metadata``) is here or in ``model_and_optim/``."""
    if storage.exists(METADATA):
        return Detection(NAME, storage, [f"found {METADATA}"])
    for sub in SUBDIRS:
        if storage.exists(f"{sub}/{METADATA}"):
            return Detection(NAME, storage.child(sub), [f"found {sub}/{METADATA}"])
    try:
        names = storage.listdir()
    except MissingFileError:
        return None
    rank_files = sorted(n for n in names if RANK_METADATA.match(n))
    if rank_files:
        return Detection(NAME, storage, [f"found rank-local {', '.join(rank_files[:4])}"])
    data_files = sorted(n for n in names if DATA_FILE.match(n))
    if data_files:  # describe() then says that .metadata is missing
        return Detection(NAME, storage, [f"found {data_files[0]} but no {METADATA}"])
    return None


def describe(storage: Store) -> Catalog:
    """The catalog of a DCP directory, from its metadata file(s) alone."""
    entries, files, facts = read_dcp(storage)
    builder = CatalogBuilder(NAME)
    builder.add_files(files)
    builder.add_all(entries, source=storage.describe())
    return builder.build(Facts(**facts))
