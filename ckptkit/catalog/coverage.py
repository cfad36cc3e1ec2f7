"""Whether a tensor's chunks tile it exactly: every element in exactly one chunk, none outside.

Every number here comes from an untrusted checkpoint, so nothing is allocated or looped over by a
tensor size or by how many cuts the chunks make. The check compares box *corners* instead:

Let f = (sum of the chunks' indicator functions) - (the tensor's). The chunks tile the tensor iff
f == 0 everywhere. Along dimension 0, f(x, ...) - f(x-1, ...) is the cross-sections of the chunks
that start at x minus those that end at x (the tensor counting as a chunk of weight -1), so f == 0
iff at every such x those signed cross-sections cancel: a question of the same kind one dimension
down, asked recursively, with identical cross-sections cancelled first in a dict (so a block
grid's interior cuts cost one dict pass). In the last dimension it is whether the +1/-1 steps at
each coordinate sum to zero. The first x (in order) whose cross-sections do not cancel, and
recursively the first point inside, is the first element in row-major order whose count is not
1, and the uncancelled sum there is that count minus 1: > 0 an overlap, < 0 a hole.

Cost: a box takes part in at most 2**k cross-sections over the k dimensions the chunks cut (k = 1
for row or column shards; a block grid's boxes cancel at interior cuts, about 2n in all), plus
sorting the coordinates: O(n log n) time and O(n k) memory for realistic layouts. Adversarial
ones (many cut dimensions, nothing cancelling) stop at :data:`~ckptkit.tunables.WORK_LIMIT` with a
:class:`LimitExceededError`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import compress
from operator import add, attrgetter, itemgetter, le
from typing import NoReturn

from .. import tunables
from ..errors import CoverageError, LimitExceededError
from .model import Chunk, Entry

__all__ = [
    "MAX_CUT_DIMS",
    "Box",
    "Fault",
    "check_coverage",
    "check_chunks",
    "rows_in_order",
    "first_fault",
]

#: Dimensions the chunks of one tensor may cut (the check recurses once per cut dimension).
MAX_CUT_DIMS = 64

#: A box over the dimensions that chunks cut: (lo0, hi0, lo1, hi1, …).
Box = tuple[int, ...]
#: The first element (row-major) that is not held exactly once, and how many chunks hold it.
Fault = tuple[list[int], int]

_OFFSETS = attrgetter("offsets")
_SIZES = attrgetter("sizes")
_FLAT = attrgetter("flat")


def check_coverage(entry: Entry, chunks: Sequence[Chunk]) -> None:
    """Raise :class:`CoverageError` unless ``chunks`` (distinct boxes, or flat ranges) tile the
    tensor: every element in exactly one chunk, none outside it. Chunks without elements are
    ignored. :class:`LimitExceededError` when the layout is too irregular to decide in
    :data:`~ckptkit.tunables.WORK_LIMIT` steps."""
    check_chunks(entry.key, entry.shape or (), chunks)


def check_chunks(
    key: str,
    shape: tuple[int, ...],
    chunks: Sequence[Chunk],
    *,
    source: str | None = None,
    pieces: str = "chunks",
) -> None:
    """:func:`check_coverage` for a tensor not yet in an entry (adapters check while they
    describe): ``key`` for messages, ``shape``, and the distinct chunks. Messages start with
    ``source`` (the file that says so) and call the chunks ``pieces`` ("the shards' boxes")."""
    try:
        _check(key, shape, chunks, pieces)
    except (CoverageError, LimitExceededError) as exc:
        if source is None:
            raise
        raise type(exc)(f"{source}: {exc}") from None


def _check(key: str, shape: tuple[int, ...], chunks: Sequence[Chunk], pieces: str) -> None:
    if rows_in_order(shape, chunks):
        return
    numel = math.prod(shape)
    flat, sizes, starts, ends = _held_boxes(key, shape, numel, chunks)
    extent = (numel,) if flat else shape
    if len(sizes) == 1 and sizes[0] == extent:  # one box, inside the tensor, so at offset 0
        return
    held = sum(map(math.prod, sizes))  # Python ints: exact at any size
    try:
        fault = _first_fault(extent, starts, ends, len(sizes), tunables.WORK_LIMIT)
    except LimitExceededError as exc:
        if held == numel:
            raise LimitExceededError(f"{key!r}: {exc}") from None
        what = "overlap" if held > numel else "leave a hole"
        raise CoverageError(
            f"{key!r}: {pieces} {what}: they hold {held} elements, the tensor has {numel}"
        ) from None
    if fault is None:
        return
    where, count = fault
    what = "overlap" if count > 1 else "leave a hole"
    place = f"flat element {where[0]}" if flat else f"element {where}"
    volume = f" (they hold {held} elements, the tensor has {numel})" if held != numel else ""
    raise CoverageError(f"{key!r}: {pieces} {what} at {place}{volume}")


def rows_in_order(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> bool:
    """True for the commonest tiling, decided in one cheap pass: boxes of whole rows (every
    number an int, every box holding elements), each starting where the one before ends,
    the last ending at the tensor's end. False means only "ask the general check"."""
    if not shape or not chunks:
        return False
    rest = shape[1:]
    zeros = (0,) * len(rest)
    ints = {int}
    at = 0
    for chunk in chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if (
            chunk.flat
            or type(offsets) is not tuple
            or type(sizes) is not tuple
            or len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or offsets[0] != at
            or sizes[1:] != rest
            or offsets[1:] != zeros
            or {*map(type, offsets), *map(type, sizes)} != ints
            or sizes[0] <= 0
        ):
            return False
        at += sizes[0]
    return at == shape[0]


def first_fault(
    shape: tuple[int, ...],
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    limit: int | None = None,
) -> Fault | None:
    """The first element of ``shape`` in row-major order that ``boxes`` (``(offsets, sizes)``,
    non-empty and inside ``shape``) do not hold exactly once, with how many hold it; None when
    they tile it. Exact; :class:`LimitExceededError` past ``limit`` steps (default
    :data:`~ckptkit.tunables.WORK_LIMIT`)."""
    if limit is None:
        limit = tunables.WORK_LIMIT
    starts = _columns([offsets for offsets, _ in boxes], len(shape))
    sizes = _columns([sizes for _, sizes in boxes], len(shape))
    ends = [list(map(add, o, n)) for o, n in zip(starts, sizes, strict=True)]
    return _first_fault(shape, starts, ends, len(boxes), limit)


def _first_fault(
    shape: tuple[int, ...],
    starts: list[list[int]],
    ends: list[list[int]],
    count: int,
    limit: int,
) -> Fault | None:
    """:func:`first_fault` of ``count`` boxes given column-wise: ``starts[d][i]`` and
    ``ends[d][i]`` bound box ``i`` in dimension ``d``."""
    if not count:
        return ([0] * len(shape), 0) if math.prod(shape) else None
    # dimensions where every box spans the whole extent drop out (f factors over them)
    cut = [d for d, extent in enumerate(shape) if max(starts[d]) or min(ends[d]) != extent]
    if len(cut) > MAX_CUT_DIMS:
        raise LimitExceededError(
            f"the chunks cut {len(cut)} dimensions (at most {MAX_CUT_DIMS} are checked)"
        )
    if len(cut) == 1:  # row or column shards
        (d,) = cut
        first, last = starts[d], ends[d]
        if first[0] == 0 and last[-1] == shape[d] and first[1:] == last[:-1]:
            return None  # in order, each starting where the one before ends
        # in any order: the steps up and down must pair off
        up, down = Counter(first), Counter(last)
        up[shape[d]] += 1
        down[0] += 1
        if dict.__eq__(up, down):  # compared in C (no zero counts on either side)
            return None
    columns = [column for d in cut for column in (starts[d], ends[d])]
    weights: Counter[Box] = Counter(zip(*columns, strict=True)) if cut else Counter({(): count})
    weights[tuple(v for d in cut for v in (0, shape[d]))] -= 1  # the tensor, weight -1
    items = {box: weight for box, weight in weights.items() if weight}
    if not items:
        return None
    if not cut:  # every box is the whole tensor
        return [0] * len(shape), 1 + items[()]
    try:
        found = _first_nonzero(items, [limit if len(cut) > 1 else len(items)])  # 1-D: linear
    except _OverBudget:
        raise LimitExceededError(
            f"the chunk layout is too irregular to check for overlaps and holes within {limit:,} "
            "steps (ckptkit.tunables.WORK_LIMIT)"
        ) from None
    if found is None:
        return None
    point, value = found
    element = [0] * len(shape)
    for d, x in zip(cut, point, strict=True):
        element[d] = x
    return element, 1 + value


def _first_nonzero(items: dict[Box, int], budget: list[int]) -> tuple[list[int], int] | None:
    """The row-major first point where the sum of ``weight * indicator(box)`` over ``items``
    is not 0, with that sum; None when it is 0 everywhere. ``budget[0]`` counts down the work."""
    budget[0] -= len(items)
    if budget[0] < 0:
        raise _OverBudget
    if len(next(iter(items))) == 2:  # the last dimension: +weight at lo, -weight at hi
        steps: dict[int, int] = {}
        for (lo, hi), weight in items.items():
            steps[lo] = steps.get(lo, 0) + weight
            steps[hi] = steps.get(hi, 0) - weight
        first = min((x for x, step in steps.items() if step), default=None)
        return None if first is None else ([first], steps[first])
    # x → the cross-sections of the boxes starting (+weight) and ending (-weight) at x
    sections: dict[int, dict[Box, int]] = {}
    for box, weight in items.items():
        rest = box[2:]
        starting = sections.get(box[0])
        if starting is None:
            sections[box[0]] = {rest: weight}
        else:
            starting[rest] = starting.get(rest, 0) + weight
        ending = sections.get(box[1])
        if ending is None:
            sections[box[1]] = {rest: -weight}
        else:
            ending[rest] = ending.get(rest, 0) - weight
    for x in sorted(sections):
        left = {rest: weight for rest, weight in sections.pop(x).items() if weight}
        if left:
            found = _first_nonzero(left, budget)
            if found is not None:
                return [x, *found[0]], found[1]
    return None


class _OverBudget(Exception):
    """The work limit ran out before :func:`_first_nonzero` could decide."""


def _held_boxes(
    key: str, shape: tuple[int, ...], numel: int, chunks: Sequence[Chunk]
) -> tuple[bool, list[tuple[int, ...]], list[list[int]], list[list[int]]]:
    """``(flat, sizes, starts, ends)`` of the chunks that hold elements (``starts[d][i]``,
    ``ends[d][i]``: box ``i`` in dimension ``d``) once every number is known to be a
    non-negative int, the boxes inside the tensor (flat ranges inside its ``numel``) and flat
    ranges not mixed with boxes; a :class:`CoverageError` otherwise. Column-wise in C builtins:
    this runs for every tensor, 500k chunks at scale."""
    offsets = list(map(_OFFSETS, chunks))
    sizes = list(map(_SIZES, chunks))
    kinds = {*map(type, offsets), *map(type, sizes)}
    if not all(issubclass(kind, tuple) for kind in kinds) or list(map(len, offsets)) != list(
        map(len, sizes)
    ):
        _raise_malformed(key, offsets, sizes)
    held = list(map(all, sizes))  # no size 0 (a 0-d chunk's () holds its one element)
    flat = any(compress(map(_FLAT, chunks), held))
    if not all(held):
        if not _naturals([v for box in (*offsets, *sizes) for v in box]):
            _raise_malformed(key, offsets, sizes)
        offsets, sizes = list(compress(offsets, held)), list(compress(sizes, held))
    if flat and not all(compress(map(_FLAT, chunks), held)):
        raise CoverageError(f"{key!r}: flat chunks are mixed with boxes")
    extent = (numel,) if flat else shape
    what = "flat range" if flat else "chunk"
    if {*map(len, offsets)} - {len(extent)}:
        offsets_, sizes_ = next(
            (o, n) for o, n in zip(offsets, sizes, strict=True) if len(o) != len(extent)
        )
        raise CoverageError(
            f"{key!r}: {what} at {list(offsets_)} of size {list(sizes_)} has {len(offsets_)} "
            f"dimensions, not {len(extent)}"
        )
    starts, widths = _columns(offsets, len(extent)), _columns(sizes, len(extent))
    if not all(map(_naturals, (*starts, *widths))):
        _raise_malformed(key, offsets, sizes)
    ends = [list(map(add, o, n)) for o, n in zip(starts, widths, strict=True)]
    if not all(map(le, (max(column, default=0) for column in ends), extent)):
        offsets_, sizes_ = next(
            (o, n)
            for o, n in zip(offsets, sizes, strict=True)
            if not all(map(le, map(add, o, n), extent))
        )
        raise CoverageError(
            f"{key!r}: {what} at {list(offsets_)} of size {list(sizes_)} lies outside the "
            f"tensor {list(shape)}" + (f" of {numel} elements" if flat else "")
        )
    return flat, sizes, starts, ends


def _columns(rows: list[tuple[int, ...]], ndim: int) -> list[list[int]]:
    """``rows`` (all of length ``ndim``) transposed; itemgetter rather than ``zip(*rows)``,
    which makes an iterator per row (slow, and work for the garbage collector)."""
    return [list(map(itemgetter(d), rows)) for d in range(ndim)]


def _raise_malformed(key: str, offsets: list[object], sizes: list[object]) -> NoReturn:
    """A :class:`CoverageError` naming the first chunk whose offsets and sizes are not tuples of
    non-negative ints of one length."""
    offsets_, sizes_ = next(
        (
            (o, n)
            for o, n in zip(offsets, sizes, strict=True)
            if not (isinstance(o, tuple) and isinstance(n, tuple))
            or len(o) != len(n)
            or not _naturals([*o, *n])
        ),
        ("?", "?"),
    )
    raise CoverageError(
        f"{key!r}: a chunk at {offsets_!r} of size {sizes_!r} is malformed "
        "(not tuples of non-negative ints of one length)"
    )


def _naturals(values: Sequence[object]) -> bool:
    """Every value a non-negative int (bools pass as 0 and 1): C builtins, no Python loop."""
    try:
        return not values or (type(sum(values)) is int and min(values) >= 0)
    except TypeError:
        return False
