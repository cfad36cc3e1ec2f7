"""On-disk formats. Each adapter only *describes* a checkpoint (``detect`` + ``describe``);
reading, tables and conversions work on the :class:`~ckptkit.catalog.Catalog` it returns."""

from __future__ import annotations

from types import ModuleType

from ..catalog import Catalog
from ..errors import FormatError, MissingFileError
from ..storage import Storage
from . import dcp
from .detection import Detection

#: Adapters in detection order: the first whose ``detect`` answers wins.
ADAPTERS: dict[str, ModuleType] = {dcp.NAME: dcp}


def detect(storage: Storage, format: str | None = None) -> Detection:
    """Which format is at ``storage`` (or force ``format``); a clear error when none fits."""
    if format is not None:
        if format not in ADAPTERS:
            raise FormatError(f"unknown format {format!r}; known: {', '.join(ADAPTERS)}")
        found = ADAPTERS[format].detect(storage)
        return found or Detection(format, storage, ["forced by format="])
    for adapter in ADAPTERS.values():
        found = adapter.detect(storage)
        if found is not None:
            return found
    try:
        listing = sorted(storage.listdir())
    except MissingFileError:
        raise MissingFileError(f"{storage.describe()}: no such file or directory") from None
    seen = ", ".join(listing[:12]) + (" …" if len(listing) > 12 else "") if listing else "nothing"
    raise FormatError(
        f"{storage.describe()}: not a checkpoint ckptkit recognises; looked for .metadata, "
        f"__<rank>.metadata, model_and_optim/.metadata; found {seen}"
    )


def describe(detection: Detection) -> Catalog:
    """The catalog of a detected checkpoint."""
    return ADAPTERS[detection.format].describe(detection.storage)


__all__ = ["ADAPTERS", "Detection", "detect", "describe"]
