"""Megatron's run tracker, ``latest_checkpointed_iteration.txt``: which iteration folder it
names. Both Megatron layouts (``torch_dist`` and the legacy ``torch``) keep it; alone it decides
no format (verl writes one too). A tracker that names no checkpoint (not a number, a missing or
empty folder) beside iteration folders is an error, as it is to Megatron's loader: never
another iteration opened in its stead."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from ...errors import CheckpointError, FormatError, MissingFileError
from ...storage import Store
from ..detection import Detection, natural_order

__all__ = [
    "ITERATION_DIR",
    "MAX_ITERATION_DIRS",
    "TRACKER",
    "detect_run",
    "tracked_iteration",
    "tracker_error",
]

TRACKER = "latest_checkpointed_iteration.txt"
#: The folders of a Megatron run directory, one per saved iteration.
ITERATION_DIR = re.compile(r"^(?:iter_\d{7}|release)$")
#: Iteration folders looked into (the newest) when the tracker names none.
MAX_ITERATION_DIRS = 16

#: A layout's verdict on one folder and its listing.
DetectHere = Callable[[Store, Mapping[str, int]], Detection | None]


def tracked_iteration(storage: Store) -> str | None:
    """The ``iter_NNNNNNN`` (or ``release``) folder the run's tracker names; None when it names
    none (unreadable, not a number)."""
    try:
        text = storage.read_file(TRACKER, max_bytes=64).decode("ascii").strip()
    except (CheckpointError, ValueError, UnicodeDecodeError):
        return None
    if text == "release":
        return text
    return f"iter_{int(text):07d}" if text.isdigit() else None


def detect_run(
    storage: Store, listing: Mapping[str, int], name: str, detect_here: DetectHere, *, bare=False
) -> Detection | None:
    """A run directory of the layout ``name``: ``detect_here``'s verdict on the iteration the
    tracker names, its evidence led by the tracker. When the tracker names no checkpoint
    (not a number, a missing or empty folder), a detection of the run directory itself, whose
    describe() raises :func:`tracker_error`, if iteration folders there hold this layout (or,
    with ``bare``, are there at all); else None."""
    if TRACKER not in listing:
        return None
    sub = tracked_iteration(storage)
    if sub is not None and listing.get(sub, 0) < 0:
        child = storage.child(sub)
        try:
            inner = child.listdir()
        except (MissingFileError, NotADirectoryError):
            inner = {}
        found = detect_here(child, inner) if inner else None
        if found is not None:
            found.evidence[:0] = [f"found {TRACKER} naming {sub}/"]
            return found
        if inner:
            return None  # another layout's iteration folder, or not Megatron's at all
    held = _iterations_holding(storage, listing, detect_here)
    if not held and not (bare and _iterations(listing)):
        return None
    what = f"{sub}/" if sub is not None else "no iteration"
    there = f"; iteration folders: {_text(held)}" if held else ""
    return Detection(
        name, storage, [f"found {TRACKER} naming {what}, which holds no checkpoint{there}"]
    )


def tracker_error(
    storage: Store, listing: Mapping[str, int], detect_here: DetectHere
) -> CheckpointError:
    """The error for a run directory whose tracker names no checkpoint of this layout: what the
    tracker says, and the iteration folders there that hold one (the newest to open)."""
    held = _iterations_holding(storage, listing, detect_here)
    there = (
        f"; iteration folders here: {_text(held)} (open one: ckptkit inspect "
        f"{storage.describe(held[-1])})"
        if held
        else ""
    )
    sub = tracked_iteration(storage)
    if sub is None:
        try:
            raw: object = storage.read_file(TRACKER, max_bytes=64)[:64]
        except CheckpointError as exc:
            raw = f"unreadable ({type(exc).__name__})"
        return FormatError(
            f"{storage.describe(TRACKER)}: holds {raw!r}, not an iteration number or "
            f"'release'{there}"
        )
    if listing.get(sub, 0) >= 0:
        return MissingFileError(f"{storage.describe(sub)}: missing ({TRACKER} names it){there}")
    return FormatError(
        f"{storage.describe(sub)}: holds no Megatron checkpoint ({TRACKER} names it){there}"
    )


def _iterations(listing: Mapping[str, int]) -> list[str]:
    return sorted(
        (n for n, size in listing.items() if size < 0 and ITERATION_DIR.match(n)),
        key=natural_order,
    )


def _iterations_holding(
    storage: Store, listing: Mapping[str, int], detect_here: DetectHere
) -> list[str]:
    """The iteration folders that ``detect_here`` recognises, oldest first (the newest
    :data:`MAX_ITERATION_DIRS` looked into)."""
    held = []
    for sub in _iterations(listing)[-MAX_ITERATION_DIRS:]:
        child = storage.child(sub)
        try:
            if detect_here(child, child.listdir()) is not None:
                held.append(sub)
        except (MissingFileError, NotADirectoryError):
            continue
    return held


def _text(names: list[str]) -> str:
    return ", ".join(names[-8:]) if len(names) <= 8 else f"… {', '.join(names[-8:])}"
