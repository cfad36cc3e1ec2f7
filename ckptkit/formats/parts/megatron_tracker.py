"""Megatron's run tracker, ``latest_checkpointed_iteration.txt``: which iteration folder it
names. Both Megatron layouts (``torch_dist`` and the legacy ``torch``) keep it; alone it decides
no format (verl writes one too)."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import CheckpointError, MissingFileError
from ...storage import Store
from ..detection import Detection

__all__ = ["TRACKER", "tracked_iteration", "detect_tracked"]

TRACKER = "latest_checkpointed_iteration.txt"


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


def detect_tracked(
    storage: Store, sub: str, detect_here: Callable[[Store, dict[str, int]], Detection | None]
) -> Detection | None:
    """``detect_here``'s verdict on the iteration folder ``sub`` the tracker names, its evidence
    led by the tracker; None when the folder cannot be listed or holds nothing it knows."""
    child = storage.child(sub)
    try:
        inner = detect_here(child, child.listdir())
    except (MissingFileError, NotADirectoryError):
        return None
    if inner is not None:
        inner.evidence[:0] = [f"found {TRACKER} naming {sub}/"]
    return inner
