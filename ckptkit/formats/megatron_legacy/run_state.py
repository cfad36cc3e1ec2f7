"""Everything but the model in a legacy Megatron checkpoint's rank files: ``args``,
``iteration``, ``checkpoint_version``, the scheduler, RNG and optimizer state.

* ``optimizer.<rank folder>.…``: each rank's optimizer state as saved, per rank (Adam's
  ``state`` / ``param_groups`` keyed by parameter *index* on that rank, fp32 master copies in
  ``fp32_from_fp16_params``): its tensors are that rank's shards and its indices follow
  Megatron's parameter groups, which the checkpoint does not name, so they are not merged;
* ``rng_state.…`` and ``common.<key>.…`` (``args``, ``iteration``, ``opt_param_scheduler``…):
  one entry per leaf whose chunks are every rank's copy, rank 0's first (reads give rank 0's,
  ``read(key, rank=N)`` rank N's), when every rank file holds the same leaves (tensors of the
  same dtype and shape); a key whose leaves differ between ranks is kept per rank instead,
  ``rng_state.<rank folder>.…`` / ``common.<key>.<rank folder>.…``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...catalog.model import Chunk, Entry
from .layout import RankFile

__all__ = ["OPTIMIZER_GROUP", "run_state_entries"]

OPTIMIZER_GROUP = "optimizer"
_RNG = "rng_state"
_COMMON = "common"


def _prefix(top: str) -> tuple[str, ...]:
    if top in (OPTIMIZER_GROUP, _RNG):
        return (top,)
    return (_COMMON, top)


def run_state_entries(
    ranks: Sequence[RankFile], tops: dict[str, dict[str, list[Entry]]]
) -> list[Entry]:
    """The entries of every top-level key but ``model`` (``tops[label][key]``: that rank
    file's leaves of ``key``, paths ``(_, key, *inner)``), in the order rank 0 saved them."""
    order: dict[str, None] = {}
    for rank in ranks:
        order.update(dict.fromkeys(tops[rank.label]))
    out: list[Entry] = []
    for top in order:
        holders = [r for r in ranks if top in tops[r.label]]
        prefix = _prefix(top)
        signatures = {_signature(tops[r.label][top]) for r in holders}
        if top != OPTIMIZER_GROUP and len(holders) == len(ranks) and len(signatures) == 1:
            out += _copies(prefix, [(r, tops[r.label][top]) for r in holders])
        else:
            for rank in holders:
                out += [
                    _moved(e, (*prefix, rank.label, *e.path[2:]), rank)
                    for e in tops[rank.label][top]
                ]
    return out


def _signature(entries: list[Entry]) -> tuple:
    return tuple((e.path[2:], e.kind, e.dtype, e.shape) for e in entries)


def _copies(prefix: tuple[str, ...], held: list[tuple[RankFile, list[Entry]]]) -> list[Entry]:
    """One entry per leaf, its chunks every rank's copy (rank order)."""
    out = []
    for position, entry in enumerate(held[0][1]):
        chunks = tuple(
            Chunk(e.chunks[0].offsets, e.chunks[0].sizes, e.chunks[0].record, rank.rank)
            for rank, e in ((rank, entries[position]) for rank, entries in held)
        )
        out.append(_placed(entry, (*prefix, *entry.path[2:]), chunks))
    return out


def _moved(entry: Entry, path: tuple, rank: RankFile) -> Entry:
    chunks = tuple(Chunk(c.offsets, c.sizes, c.record, rank.rank, c.flat) for c in entry.chunks)
    return _placed(entry, path, chunks)


def _placed(entry: Entry, path: tuple, chunks: tuple[Chunk, ...]) -> Entry:
    """``entry`` under ``path`` (its key spelled from it), holding ``chunks``."""
    return Entry(
        ".".join(map(str, path)),
        path,
        entry.kind,
        chunks,
        entry.dtype,
        entry.shape,
        tensor_class=entry.tensor_class,
    )
