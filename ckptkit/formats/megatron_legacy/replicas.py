"""Whether the copies of a replicated parameter (one per TP rank), and a tied copy of the word
embeddings, hold the same bytes: reads give TP rank 0's copy (what Megatron's converters keep),
so copies that differ are reported, never silently dropped.

Compared by the CRC-32 torch.save zips store for every storage (no byte is read); records
without one (pre-1.6 files, views of part of a storage) are read and compared, up to
:data:`~ckptkit.tunables.BATCH_BYTES` in all, the rest reported as not compared.
"""

from __future__ import annotations

import warnings

from ... import tunables
from ...storage import Store
from .merge import Copies

__all__ = ["differing_copies", "warn_differing_copies"]


def differing_copies(storage: Store, copies: list[Copies]) -> tuple[list[str], list[str]]:
    """``(differing, unchecked)``: each a list of ``'model.x (mp_rank_00 vs mp_rank_01)'``."""
    differing: list[str] = []
    unchecked: list[str] = []
    to_read: list[Copies] = []
    budget = tunables.BATCH_BYTES
    for item in copies:
        records = item.records
        if all(r is None for r in records):
            continue  # no elements
        if any(r is None for r in records):
            differing.append(_shown(item, 0, records.index(None)))
            continue
        if all(r.crc32 is not None for r in records):
            first = (records[0].crc32, records[0].length)
            odd = next((i for i, r in enumerate(records) if (r.crc32, r.length) != first), None)
            if odd is not None:
                differing.append(_shown(item, 0, odd))
            continue
        layouts = {(r.length, r.stride) for r in records}
        size = sum(r.length for r in records)
        if len(layouts) > 1 or size > budget:
            unchecked.append(_shown(item, 0, len(records) - 1))
            continue
        budget -= size
        to_read.append(item)
    if to_read:
        ranges = [(r.file, r.offset, r.offset + r.length) for item in to_read for r in item.records]
        blobs = iter(storage.read_ranges(ranges))
        for item in to_read:
            data = [next(blobs) for _ in item.records]
            odd = next((i for i, blob in enumerate(data) if blob != data[0]), None)
            if odd is not None:
                differing.append(_shown(item, 0, odd))
    return differing, unchecked


def _shown(item: Copies, a: int, b: int) -> str:
    return f"{item.key} ({item.labels[a]} vs {item.labels[b]})"


def warn_differing_copies(storage: Store, copies: list[Copies]) -> None:
    """A warning naming the copies that differ (or could not be compared), if any."""
    differing, unchecked = differing_copies(storage, copies)
    if differing:
        shown = ", ".join(differing[:4]) + (
            f" and {len(differing) - 4} more" if len(differing) > 4 else ""
        )
        many = len(differing) > 1
        warnings.warn(
            f"{storage.describe()}: {len(differing)} {'copies' if many else 'copy'} of "
            f"replicated or tied parameters {'differ' if many else 'differs'} between the ranks "
            f"holding {'them' if many else 'it'}: {shown}; reads and unshard give TP rank 0's "
            "copy (as Megatron's converters keep), read(key, rank=N) gives rank N's",
            stacklevel=3,
        )
    if unchecked:
        shown = ", ".join(unchecked[:4]) + (
            f" and {len(unchecked) - 4} more" if len(unchecked) > 4 else ""
        )
        warnings.warn(
            f"{storage.describe()}: copies of replicated parameters not compared across ranks "
            f"(no CRC-32 stored, too large or laid out differently): {shown}",
            stacklevel=3,
        )
