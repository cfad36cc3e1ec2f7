"""Locations that are not a checkpoint but point to one: a file *of* a checkpoint (a DCP data
file or its ``.metadata``), or a run folder holding one checkpoint per step. Detection asks
here before calling a location damaged or unknown, so the message names what to open."""

from __future__ import annotations

import posixpath

from ..errors import CheckpointError
from ..storage import Store
from .detection import file_location, natural_order
from .parts.dcp_metadata import DATA_FILE, METADATA, RANK_METADATA

#: Sub-directories looked at when a folder might hold one checkpoint per step.
MAX_STEP_DIRS = 64


def inside_checkpoint(storage: Store) -> str | None:
    """For a file of a DCP checkpoint (data file, ``.metadata``, ``__R.metadata``) whose
    directory holds the metadata: a message saying to open that directory; else None."""
    if not _dcp_file_name(posixpath.basename(storage.url.rstrip("/"))):
        return None  # decided by the name alone: no look-ups for every other location
    located = file_location(storage)
    if located is None:
        return None
    parent, name = located
    has_metadata = parent.exists(METADATA) or any(
        RANK_METADATA.match(other) for other in parent.listdir()
    )
    if not has_metadata:
        return None
    what = "a data file" if DATA_FILE.match(name) else "the metadata"
    return (
        f"{storage.describe()} is {what} of the DCP checkpoint {parent.describe()}; "
        f"open the directory: ckptkit inspect {parent.describe()}"
    )


def _dcp_file_name(name: str) -> bool:
    return name == METADATA or bool(RANK_METADATA.match(name) or DATA_FILE.match(name))


def checkpoints_below(
    storage: Store, listing: dict[str, int], detect, *, nested: bool = False
) -> list[str]:
    """The sub-directories of a run folder that ``detect`` (a Store → Detection | None
    function) recognises as checkpoints, in natural order; at most :data:`MAX_STEP_DIRS`
    are looked at. With ``nested``, a sub-directory that is none is looked into once more
    (verl's ``global_step_10/actor``), within the same budget of look-ups, and its
    checkpoints are named by their path (``global_step_10/actor``)."""
    subdirs = sorted((name for name, size in listing.items() if size < 0), key=natural_order)
    found: list[str] = []
    budget = MAX_STEP_DIRS
    for name in subdirs[:MAX_STEP_DIRS]:
        budget -= 1
        if _recognised(storage, name, detect):
            found.append(name)
        elif nested and budget > 0:
            try:
                child = storage.child(name)
                inner = child.listdir()
            except (CheckpointError, OSError):
                continue
            below = sorted((n for n, size in inner.items() if size < 0), key=natural_order)
            for sub in below[:budget]:
                budget -= 1
                if _recognised(child, sub, detect):
                    found.append(f"{name}/{sub}")
    return found


def _recognised(storage: Store, name: str, detect) -> bool:
    """Whether ``detect`` recognises the sub-directory ``name``; a recognised but damaged
    checkpoint (its detection raises) still counts: it is worth pointing to."""
    try:
        return detect(storage.child(name)) is not None
    except (CheckpointError, OSError):
        return True


__all__ = ["MAX_STEP_DIRS", "checkpoints_below", "inside_checkpoint"]
