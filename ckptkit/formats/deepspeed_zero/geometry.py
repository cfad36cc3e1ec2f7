"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks' flat partitions.

Pure arithmetic on numbers read from an untrusted checkpoint, no I/O. Every loop runs once per
parameter and per rank a parameter touches (at most ``world_size + 1`` in stages 1/2, at most
``world_size`` × the flat groups it spans in stage 3), never per element.

* Stages 1/2 (and ``BF16_Optimizer``): a param group's trainable parameters are concatenated in
  ``param_shapes`` order (each followed by its ``param_alignment_paddings``, when saved), padded
  at the end to a multiple of ``2 × world_size`` and cut into ``world_size`` equal slices; rank
  ``r`` holds elements ``[r·P, (r+1)·P)`` of the group in its flat tensor for that group.
* Stage 3: each parameter is padded to a multiple of the world size; rank ``r`` holds its
  elements ``[r·Pp, (r+1)·Pp)`` (``Pp = ceil(numel / world_size)``); a rank's flat groups,
  concatenated, are its slices of every parameter in ``param_shapes`` order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import CorruptRecordError


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, start + numel)`` of a parameter (flattened, row-major), held by
    ``rank`` at element ``offset`` of its flat tensor number ``group``."""

    rank: int
    group: int
    offset: int
    start: int
    numel: int


@dataclass(frozen=True)
class Layout:
    """Every parameter's pieces (in element order) and, per rank and flat group, how many
    elements the rank's flat tensor must hold (``needed``) and may hold (``capacity``)."""

    pieces: dict[str, list[Piece]]
    needed: list[list[int]]
    capacity: list[list[int]]


def partitioned_layout(
    groups: Sequence[Sequence[tuple[str, int]]],
    world_size: int,
    paddings: Sequence[Sequence[int]] | None = None,
) -> Layout:
    """Stages 1/2: ``groups`` lists each param group's ``(name, numel)`` in flat order;
    ``paddings`` the alignment padding saved after each parameter (None: none)."""
    pieces: dict[str, list[Piece]] = {}
    needed: list[list[int]] = [[] for _ in range(world_size)]
    capacity: list[list[int]] = [[] for _ in range(world_size)]
    align = 2 * world_size
    if paddings is not None and (
        not isinstance(paddings, list | tuple)
        or len(paddings) != len(groups)
        or not all(isinstance(pads, list | tuple) for pads in paddings)
    ):
        raise CorruptRecordError(
            f"param_alignment_paddings is not one list per param group ({len(groups)})"
        )
    for g, params in enumerate(groups):
        after = paddings[g] if paddings is not None else [0] * len(params)
        if len(after) != len(params):
            raise CorruptRecordError(
                f"param group {g} lists {len(params)} parameters but {len(after)} alignment "
                "paddings"
            )
        spans = []
        offset = 0
        for (name, numel), pad in zip(params, after, strict=True):
            if type(pad) is not int or pad < 0:
                raise CorruptRecordError(f"param group {g}: alignment padding {pad!r} of {name!r}")
            spans.append((name, offset, numel))
            offset += numel + pad
        total = offset
        size = -(-total // align) * align // world_size  # P: each rank's slice
        for rank in range(world_size):
            needed[rank].append(min(max(total - rank * size, 0), size))
            capacity[rank].append(size)
        for name, first, numel in spans:
            if name in pieces:
                raise CorruptRecordError(f"parameter {name!r} is listed twice in param_shapes")
            pieces[name] = list(_cut(name, first, numel, size, g))
    return Layout(pieces, needed, capacity)


def _cut(name: str, first: int, numel: int, size: int, group: int):
    """The pieces of a parameter at ``[first, first + numel)`` of a group sliced every
    ``size`` elements."""
    if not numel:
        return
    for rank in range(first // size, (first + numel - 1) // size + 1):
        lo, hi = max(first, rank * size), min(first + numel, (rank + 1) * size)
        yield Piece(rank, group, lo - rank * size, lo - first, hi - lo)


def stage3_slices(numel: int, world_size: int) -> list[tuple[int, int, int]]:
    """``(rank, start, numel)`` of each rank's non-empty slice of a stage-3 parameter (its
    padding past ``numel`` dropped)."""
    size = -(-numel // world_size)
    out = []
    for rank in range(world_size):
        lo, hi = rank * size, min((rank + 1) * size, numel)
        if hi > lo:
            out.append((rank, lo, hi - lo))
    return out


def stage3_layout(
    params: Sequence[tuple[str, int]], world_size: int, group_sizes: Sequence[int]
) -> Layout:
    """Stage 3: ``params`` lists every trainable ``(name, numel)`` in ``param_shapes`` order;
    ``group_sizes`` the elements of each rank's flat groups (the same on every rank)."""
    bounds = [0, *itertools.accumulate(group_sizes)]
    pieces: dict[str, list[Piece]] = {}
    offset = 0  # of the parameter's slice in a rank's concatenated flat groups
    for name, numel in params:
        if name in pieces:
            raise CorruptRecordError(f"parameter {name!r} is listed twice in param_shapes")
        size = -(-numel // world_size)
        if offset + size > bounds[-1]:
            raise CorruptRecordError(
                f"param_shapes needs {offset + size} elements per rank up to {name!r}; the "
                f"flat groups hold {bounds[-1]}"
            )
        found = []
        for rank, start, count in stage3_slices(numel, world_size):
            found += _spread(rank, offset, start, count, bounds)
        pieces[name] = found
        offset += size
    if offset != bounds[-1]:
        raise CorruptRecordError(
            f"param_shapes accounts for {offset} elements per rank; the flat groups hold "
            f"{bounds[-1]}"
        )
    sizes = list(group_sizes)
    return Layout(pieces, [sizes] * world_size, [sizes] * world_size)


def _spread(rank: int, at: int, start: int, count: int, bounds: list[int]) -> list[Piece]:
    """A rank's slice at ``at`` of its concatenated flat groups (``bounds``: where each group
    starts), cut where groups end."""
    out = []
    group = bisect.bisect_right(bounds, at) - 1
    while count:
        take = min(count, bounds[group + 1] - at)
        if take:
            out.append(Piece(rank, group, at - bounds[group], start, take))
        at, start, count, group = at + take, start + take, count - take, group + 1
    return out


__all__ = ["Layout", "Piece", "partitioned_layout", "stage3_layout", "stage3_slices"]
