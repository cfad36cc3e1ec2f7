"""Bounds for numbers read from a checkpoint, checked before anything is allocated or looped over.

A checkpoint's counts, ranks and world sizes are untrusted: ``rank0.pt`` beside
``rank99999999999.pt`` or ``world_size: 100000000`` must cost what the files on hand cost, not
what the number says. Pickle limits live in :mod:`ckptkit.pickle_limits`; the limits of file
reads (small files, record lengths against real file sizes) in :mod:`ckptkit.storage`.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["first_missing", "count_missing", "ranks_text"]


def first_missing(present: Collection[int], world_size: int, limit: int = 4) -> list[int]:
    """The first ``limit`` ranks below ``world_size`` that ``present`` lacks, found in at most
    ``len(present) + limit`` steps whatever ``world_size`` is."""
    missing: list[int] = []
    rank = 0
    while rank < world_size and len(missing) < limit:
        if rank not in present:
            missing.append(rank)
        rank += 1
    return missing


def count_missing(present: Collection[int], world_size: int) -> int:
    """How many ranks below ``world_size`` have no file, without enumerating them."""
    return max(0, world_size - sum(1 for rank in set(present) if 0 <= rank < world_size))


def ranks_text(ranks: Collection[int]) -> str:
    """``0..7`` for a contiguous run of more than two ranks, else the ranks listed (at most 8)."""
    ordered = sorted(set(ranks))
    if len(ordered) > 2 and ordered[-1] - ordered[0] + 1 == len(ordered):
        return f"{ordered[0]}..{ordered[-1]}"
    shown = ", ".join(map(str, ordered[:8]))
    return shown if len(ordered) <= 8 else f"{shown}, … ({len(ordered)} ranks)"
