"""What a format adapter reports when it recognises a location."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..storage import Store

__all__ = ["Detection", "file_location", "natural_order"]


@dataclass
class Detection:
    """``format`` found at ``storage`` (possibly a sub-directory of what the user named).

    ``files`` is set when the user named files rather than a directory (``model.pt``,
    ``model.safetensors.index.json``): ``storage`` is then their parent directory and the adapter
    describes just these files. None means: describe the whole directory.
    """

    format: str
    storage: Store
    evidence: list[str] = field(default_factory=list)
    files: list[str] | None = None
    #: lines for the reader on how the checkpoint was found (the only checkpoint in the folder
    #: the user named), also in ``evidence``; :func:`ckptkit.formats.describe` puts them in
    #: the catalog's ``facts.notes``, which ``inspect`` shows first
    notes: list[str] = field(default_factory=list)


def file_location(storage: Store) -> tuple[Store, str] | None:
    """``(parent directory, file name)`` when ``storage`` names an existing file, else None."""
    if storage.isdir() or not storage.exists(""):
        return None
    return storage.parent()


def natural_order(name: str) -> list[int | str]:
    """Sort key for folder names that puts ``step9`` before ``step10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
