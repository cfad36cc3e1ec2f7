"""Megatron's run tracker, ``latest_checkpointed_iteration.txt``: which iteration folder it
names. Both Megatron layouts (``torch_dist`` and the legacy ``torch``) keep it; alone it decides
no format (verl writes one too)."""

from __future__ import annotations

from ...errors import CheckpointError
from ...storage import Store

__all__ = ["TRACKER", "tracked_iteration"]

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
