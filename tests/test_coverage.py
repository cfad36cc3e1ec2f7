"""The chunk-coverage check (ckptkit.coverage): exact against a brute-force grid on random small
layouts, bounded in time and memory on hostile ones, and fine with realistic large layouts."""

from __future__ import annotations

import os
import re
from itertools import product

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit import tunables
from ckptkit.catalog.coverage import check_coverage, first_fault
from ckptkit.catalog.model import Chunk, Entry
from ckptkit.errors import CoverageError, LimitExceededError
from ckptkit.reading import check_coverage as reading_check_coverage

from isolated import run_script

Box = tuple[tuple[int, ...], tuple[int, ...]]

EXAMPLES = int(os.environ.get("CKPTKIT_FUZZ_EXAMPLES", "400"))
RANDOM_LAYOUTS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize="CKPTKIT_FUZZ_EXAMPLES" not in os.environ,
)


def grid_oracle(shape: tuple[int, ...], boxes: list[Box]) -> tuple[list[int], int] | None:
    """Brute force: count every element's chunks on a dense grid; the first element (row-major)
    not held exactly once, with its count."""
    counts = np.zeros(shape, dtype=np.int64)
    for offsets, sizes in boxes:
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] += 1
    bad = np.argwhere(counts != 1)  # in C (row-major) order
    if not len(bad):
        return None
    first = tuple(int(i) for i in bad[0])
    return list(first), int(counts[first])


def entry_of(shape: tuple[int, ...], boxes: list[Box], *, flat: bool = False) -> Entry:
    """A tensor entry named 'w' stored in ``boxes``."""
    chunks = tuple(Chunk(tuple(o), tuple(n), None, flat=flat) for o, n in boxes)
    return Entry("w", ("model", "w"), "tensor", chunks, None, shape)


def grid_boxes(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The block grid that ``cuts`` (interior cut points per dimension) make of ``shape``."""
    axes = []
    for dim, points in zip(shape, cuts, strict=True):
        edges = [0, *sorted(set(points)), dim]
        axes.append([(a, b - a) for a, b in zip(edges, edges[1:], strict=False)])
    return [(tuple(a for a, _ in spans), tuple(n for _, n in spans)) for spans in product(*axes)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A small shape and boxes inside it: a block grid, a guillotine tiling (not a grid: bricks
    whose cuts differ from row to row) or random boxes, then maybe one box shrunk, grown, moved,
    dropped or duplicated; sometimes with an empty chunk besides."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    kind = draw(st.sampled_from(["grid", "guillotine", "random"]))
    if kind == "grid":
        cuts = [
            draw(st.lists(st.integers(1, max(1, d - 1)), min_size=1, max_size=3)) if d > 1 else []
            for d in shape
        ]
        boxes = grid_boxes(shape, cuts)
    elif kind == "guillotine":
        boxes, todo = [], [((0,) * ndim, shape)]
        while todo:
            offsets, sizes = todo.pop()
            splittable = [d for d, n in enumerate(sizes) if n > 1]
            if not splittable or len(boxes) + len(todo) > 12 or not draw(st.integers(0, 3)):
                boxes.append((offsets, sizes))
                continue
            d = draw(st.sampled_from(splittable))
            at = draw(st.integers(1, sizes[d] - 1))
            left = sizes[:d] + (at,) + sizes[d + 1 :]
            right = sizes[:d] + (sizes[d] - at,) + sizes[d + 1 :]
            todo += [(offsets, left), (offsets[:d] + (offsets[d] + at,) + offsets[d + 1 :], right)]
    else:
        boxes = []
        for _ in range(draw(st.integers(0, 6))):
            lo = [draw(st.integers(0, d - 1)) for d in shape]
            hi = [draw(st.integers(a + 1, d)) for a, d in zip(lo, shape, strict=True)]
            boxes.append((tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True))))
    mutation = draw(st.sampled_from(["none", "shrink", "grow", "move", "drop", "duplicate"]))
    if boxes and mutation != "none":
        i = draw(st.integers(0, len(boxes) - 1))
        lo, hi = list(boxes[i][0]), [o + n for o, n in zip(*boxes[i], strict=True)]
        d = draw(st.integers(0, ndim - 1))
        step = draw(st.sampled_from([-2, -1, 1, 2]))
        if mutation == "drop":
            del boxes[i]
        elif mutation == "duplicate":
            boxes.append(boxes[i])
        else:
            if mutation == "move":
                step = max(-lo[d], min(shape[d] - hi[d], step))
                lo[d], hi[d] = lo[d] + step, hi[d] + step
            elif mutation == "shrink":  # from the start (step < 0) or the end
                if step < 0:
                    lo[d] = min(lo[d] - step, hi[d] - 1)
                else:
                    hi[d] = max(hi[d] - step, lo[d] + 1)
            elif step < 0:  # grow towards the start
                lo[d] = max(0, lo[d] + step)
            else:
                hi[d] = min(shape[d], hi[d] + step)
            boxes[i] = (tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))
    if draw(st.integers(0, 4)) == 0:  # a chunk without elements, anywhere up to the edges
        lo = tuple(draw(st.integers(0, d)) for d in shape)
        d = draw(st.integers(0, ndim - 1))
        boxes.append((lo, tuple(0 if j == d else draw(st.integers(0, 2)) for j in range(ndim))))
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[i] for i in order]


@RANDOM_LAYOUTS
@given(layouts())
def test_first_fault_equals_the_grid_oracle(layout):
    shape, boxes = layout
    expected = grid_oracle(shape, boxes)
    assert first_fault(shape, [(o, n) for o, n in boxes if all(n)]) == expected
    entry = entry_of(shape, boxes)
    if expected is None:
        check_coverage(entry, list(entry.chunks))
    else:
        where, count = expected
        what = "overlap" if count > 1 else "leave a hole"
        with pytest.raises(
            CoverageError, match=re.escape(f"'w': chunks {what} at element {where}")
        ):
            check_coverage(entry, list(entry.chunks))


@RANDOM_LAYOUTS
@given(layouts())
def test_flat_ranges_equal_the_grid_oracle(layout):
    """The same layouts flattened to 1-D ranges of a tensor with as many elements."""
    shape, boxes = layout
    numel = int(np.prod(shape))
    ranges = [((np.ravel_multi_index(o, shape),), (int(np.prod(n)),)) for o, n in boxes if all(n)]
    ranges = [((int(o[0]),), n) for o, n in ranges if o[0] + n[0] <= numel]
    expected = grid_oracle((numel,), ranges)
    assert first_fault((numel,), ranges) == expected
    entry = entry_of(shape, ranges, flat=True)
    if expected is None:
        check_coverage(entry, list(entry.chunks))
    else:
        what = "overlap" if expected[1] > 1 else "leave a hole"
        # with no range at all nothing says the layout is flat
        place = f"flat element {expected[0][0]}" if ranges else f"element {[0] * len(shape)}"
        with pytest.raises(CoverageError, match=re.escape(f"chunks {what} at {place}")):
            check_coverage(entry, list(entry.chunks))


def test_reading_check_coverage_is_this_check():
    entry = entry_of((4, 4), [((0, 0), (2, 4)), ((1, 0), (3, 4))])
    with pytest.raises(CoverageError, match=re.escape("'w': chunks overlap at element [1, 0]")):
        reading_check_coverage(entry, list(entry.chunks))
    entry = entry_of((4, 4), [((0, 0), (2, 4)), ((3, 0), (1, 4))])
    with pytest.raises(
        CoverageError, match=re.escape("'w': chunks leave a hole at element [2, 0]")
    ):
        reading_check_coverage(entry, list(entry.chunks))


@pytest.mark.parametrize(
    ("shape", "boxes", "match"),
    [
        ((4, 4), [((0, 0), (4, 5))], r"chunk at \[0, 0\] of size \[4, 5\] lies outside"),
        ((4, 4), [((3, 0), (2, 4))], "lies outside the tensor"),
        ((4, 4), [((0,), (16,))], "has 1 dimensions, not 2"),
        ((4, 4), [((0, 0, 0), (4, 4, 1))], "has 3 dimensions, not 2"),
        ((4, 4), [((-1, 0), (5, 4))], "malformed"),
        ((4, 4), [((0, 0), (-4, -4))], "malformed"),  # numel 16, yet not a box
        ((4, 4), [((0, 0), (0, -4)), ((0, 0), (4, 4))], "malformed"),  # empty, still negative
        ((4, 4), [((0, 0), (4.0, 4))], "malformed"),
        ((4, 4), [((0, 0), (4, 4)), ((0, "1"), (4, 4))], "malformed"),
        ((4, 4), [((0, 0), (4, 4, 4))], "malformed"),
    ],
)
def test_malformed_or_outside_chunks(shape, boxes, match):
    entry = entry_of(shape, boxes)
    with pytest.raises(CoverageError, match=match) as info:
        check_coverage(entry, list(entry.chunks))
    assert "'w'" in str(info.value)


def test_flat_ranges():
    shuffled = [((8,), (8,)), ((0,), (8,)), ((16,), (8,))]
    entry = entry_of((2, 3, 4), shuffled, flat=True)
    check_coverage(entry, list(entry.chunks))
    for ranges, match in [
        ([((0,), (8,)), ((9,), (15,))], "leave a hole at flat element 8"),
        ([((0,), (10,)), ((8,), (16,))], "overlap at flat element 8"),
        ([((0,), (8,)), ((8,), (8,))], "leave a hole at flat element 16"),
        ([((0,), (24,)), ((20,), (8,))], "flat range at \\[20\\] of size \\[8\\] lies outside"),
        ([((0,), (12,)), ((12,), (12,)), ((0,), (0,))], None),  # an empty range is ignored
    ]:
        entry = entry_of((2, 3, 4), ranges, flat=True)
        if match is None:
            check_coverage(entry, list(entry.chunks))
            continue
        with pytest.raises(CoverageError, match=match):
            check_coverage(entry, list(entry.chunks))
    mixed = Entry(
        "w",
        ("w",),
        "tensor",
        (Chunk((0,), (12,), None, flat=True), Chunk((1, 0, 0), (1, 3, 4), None)),
        None,
        (2, 3, 4),
    )
    with pytest.raises(CoverageError, match="flat chunks are mixed with boxes"):
        check_coverage(mixed, list(mixed.chunks))


def test_empty_chunks_are_ignored():
    # uneven FSDP2 shards: ranks past the end hold [0, cols] boxes, at or even past the last row
    boxes = [((0, 0), (3, 5)), ((3, 0), (0, 5)), ((7, 0), (0, 5)), ((9, 9), (0, 0))]
    entry = entry_of((3, 5), boxes)
    check_coverage(entry, list(entry.chunks))
    empty = entry_of((0, 5), [((0, 0), (0, 5))])
    check_coverage(empty, list(empty.chunks))
    check_coverage(entry_of((0, 5), []), [])
    entry = entry_of((3, 5), [((0, 0), (0, 5))])
    with pytest.raises(CoverageError, match=re.escape("leave a hole at element [0, 0]")):
        check_coverage(entry, list(entry.chunks))


def test_zero_dimensional_tensors():
    scalar = entry_of((), [((), ())])
    check_coverage(scalar, list(scalar.chunks))
    with pytest.raises(CoverageError, match=re.escape("leave a hole at element []")):
        check_coverage(entry_of((), []), [])
    twice = [Chunk((), (), None), Chunk((), (), None)]
    with pytest.raises(CoverageError, match=re.escape("overlap at element []")):
        check_coverage(entry_of((), []), twice)
    flat = entry_of((), [((0,), (1,))], flat=True)  # OLMo-core's flat range of a scalar
    check_coverage(flat, list(flat.chunks))
    assert first_fault((), [((), ())]) is None


def test_uncut_dimensions_and_duplicates():
    shape = (6, 1, 4)
    rows = [((r, 0, 0), (1, 1, 4)) for r in range(6)]
    assert first_fault(shape, rows) is None
    assert first_fault(shape, [*rows, rows[3]]) == ([3, 0, 0], 2)
    whole = [((0, 0, 0), shape)]
    assert first_fault(shape, whole * 3) == ([0, 0, 0], 3)
    columns = [((0, 0, c), (6, 1, 1)) for c in range(4)]
    assert first_fault(shape, columns) is None
    assert first_fault(shape, columns[1:]) == ([0, 0, 0], 0)


def test_the_350_diagonal_cubes_fail_fast_in_bounded_memory():
    """The old grid wanted 350**3 int32 cells (7.7 GiB) for 350 1x1x1 chunks; under a 1 GiB
    address-space limit the check must still answer, and quickly."""
    script = """
import resource
from ckptkit.catalog import Chunk, Entry
from ckptkit.errors import CoverageError
from ckptkit.reading import check_coverage
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
n = 350
chunks = [Chunk((i, i, i), (1, 1, 1), None) for i in range(n)]
entry = Entry("diag", ("diag",), "tensor", tuple(chunks), None, (n, n, n))
try:
    check_coverage(entry, chunks)
except CoverageError as exc:
    print(exc)
# the same count of cubes but tiling a 350 x 1 x 1 column: valid
column = [Chunk((i, 0, 0), (1, 1, 1), None) for i in range(n)]
check_coverage(Entry("column", ("column",), "tensor", tuple(column), None, (n, 1, 1)), column)
print("column ok")
"""
    out = run_script(script, timeout=60)
    assert "'diag': chunks leave a hole at element [0, 0, 1]" in out
    assert "column ok" in out


def test_large_realistic_layouts_pass():
    # a 64 x 64 FSDP x TP block grid of one tensor
    shape = (64 * 8, 64 * 4)
    grid = grid_boxes(shape, [list(range(8, shape[0], 8)), list(range(4, shape[1], 4))])
    assert len(grid) == 4096
    entry = entry_of(shape, grid)
    check_coverage(entry, list(entry.chunks))
    # 100k row shards, listed in no particular order
    rows = [((r, 0), (1, 16)) for r in range(100_000)]
    rows = rows[1::2] + rows[::2]
    entry = entry_of((100_000, 16), rows)
    check_coverage(entry, list(entry.chunks))
    # column shards and a brick wall (each row of blocks cut at other columns): not grids
    assert first_fault((4, 1000), [((0, c), (4, 1)) for c in range(1000)]) is None
    bricks = [
        ((r, c), (1, min(10, 1000 - c))) for r in range(500) for c in range(-(r % 10), 1000, 10)
    ]
    bricks = [((r, max(c, 0)), (1, n + min(c, 0))) for (r, c), (_, n) in bricks]
    assert first_fault((500, 1000), bricks) is None
    moved = bricks[:-1] + [((499, 0), bricks[-1][1])]
    assert first_fault((500, 1000), moved) == grid_oracle((500, 1000), moved)


def test_too_irregular_layouts_hit_the_work_limit(monkeypatch):
    """Boxes whose cross-sections never cancel, valid by volume: past the limit, a
    LimitExceededError naming the key; with the volume wrong, still a CoverageError."""
    # 3-D 'staircase' of slabs, each cut differently, so no cross-section repeats
    shape = (8, 8, 8)
    boxes = []
    for x in range(8):
        for offsets, sizes in grid_boxes((8, 8), [[x % 7 + 1], [3 * x % 7 + 1]]):
            boxes.append(((x, *offsets), (1, *sizes)))
    assert first_fault(shape, boxes) is None
    with pytest.raises(LimitExceededError, match="too irregular"):
        first_fault(shape, boxes, limit=40)
    monkeypatch.setattr(tunables, "WORK_LIMIT", 40)
    entry = entry_of(shape, boxes)
    with pytest.raises(LimitExceededError, match="'w': the chunk layout is too irregular"):
        check_coverage(entry, list(entry.chunks))
    rows = entry_of((100, 3), [((r, 0), (1, 3)) for r in range(100) if r != 50])
    with pytest.raises(CoverageError, match=re.escape("leave a hole at element [50, 0]")):
        check_coverage(rows, list(rows.chunks))  # one cut dimension: linear, never limited
    short = entry_of(shape, boxes[:-1])
    with pytest.raises(CoverageError, match=f"leave a hole: they hold {512 - 7 * 7} elements"):
        check_coverage(short, list(short.chunks))
