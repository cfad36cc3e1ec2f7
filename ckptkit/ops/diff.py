"""Per-key differences between two checkpoints of any formats, streamed tensor by tensor.

Keys are matched after dropping wrapper segments (``_fsdp_wrapped_module.`` …) and applying a
``key_map``; an object on one side is split where the other keeps entries below its key, and a
one-file checkpoint's stem lined up with the other side's groups (:mod:`ckptkit.ops.diff_keys`),
so a correct conversion compares ``equal``. Tensors stream from both sides in lockstep, in
blocks of at most :data:`~ckptkit.tunables.BLOCK_ELEMENTS` elements whatever the two sides'
chunking. Each block's raw bytes are compared first, so bit-identical tensors cost a byte
comparison and no float math.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes, tunables
from ..catalog.keys import KeyMap
from ..catalog.model import Entry
from ..dtypes import DType
from ..errors import UsageError
from ..reading import Reader
from ..reading.tensor_blocks import ByteStream, aligned_blocks, as_float, bytes_equal
from . import distributed, work
from .diff_keys import Leaf, Match, aligned_key_map, match_keys
from .object_equality import holds_tensor, same_value
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "STATUSES", "SAME", "diff", "Pair"]

COLUMNS = [
    "key",
    "status",
    "dtype",
    "shape",
    "numel",
    "max_abs",
    "mean_abs",
    "rel_l2",
    "cosine",
    "frac_outside",
    "note",
    "key_b",
]
#: The ``status`` values, from "nothing to see" to structural changes.
STATUSES = (
    "equal",  # same dtype and shape, bit-identical bytes (objects: equal values)
    "close",  # within tolerance of the tensor's own scale (see diff()); also across a change of
    # floating dtype (float32 → bfloat16), which the note then names
    "different",  # same dtype and shape, beyond tolerance (integers and bools: any change)
    "only_a",
    "only_b",
    "dtype_changed",  # numeric columns still filled when the shapes agree
    "shape_changed",
    "object_changed",  # non-tensor values differ (or a tensor on one side, an object on the other)
)
#: Statuses meaning "the same within tolerance" (the CLI exits 0 when every row has one).
SAME = ("equal", "close")


def diff(
    a: str | Source,
    b: str | Source,
    *,
    keys: Sequence[str] | str | None = None,
    key_map: KeyMap = None,
    rtol: float = 1e-5,
    atol: float = 0.0,
    storage_options: dict | None = None,
    progress: bool = False,
    workers: int = 1,
) -> pd.DataFrame:
    """One row per key of ``a`` and ``b``: its status and, for numeric tensors, how far apart.

    A floating tensor is ``close`` only when its differences are small *for its own scale*:
    max |a−b| ≤ atol + rtol·max(|a|, |b|) **and** ‖a−b‖ ≤ atol·√n + rtol·max(‖a‖, ‖b‖). So a
    tensor of values near 1e-10 (Adam's ``exp_avg_sq``) that tripled is ``different``, whatever
    its absolute size, and many small elements cannot hide behind one large one; integer and
    bool tensors have no tolerance. A floating tensor whose dtype changed (float32 → bfloat16)
    is compared by value, exactly: ``close`` within that tolerance (``rtol=1e-2`` covers a
    bfloat16 cast), else ``dtype_changed``; the note names the change. ``max_abs`` = max |a−b|,
    ``mean_abs``, ``rel_l2`` = ‖a−b‖/‖a‖, ``cosine``, and ``frac_outside`` = the element-wise
    view, the fraction of elements with |a−b| > atol + rtol·|b| (``torch.isclose``; NaN matches
    NaN).

    Keys are matched after ``key_map`` (a dict of prefix → prefix, or a callable) is applied to
    both sides' keys, wrapper segments such as ``_fsdp_wrapped_module.`` dropped; ``keys`` globs
    select among the mapped keys. Without a ``key_map``, a checkpoint that is one file (keys
    named under its stem: ``torch_ref.model.…``) is lined up with the other side's groups when
    that pairs every one of its keys (``key_map={}`` matches keys as they are). An object on one
    side and entries below its key on the other (``optim.param_groups`` and
    ``optim.param_groups.0.lr`` …) are compared by value at the same paths, one row per path.
    ``key`` is a's key (b's for ``only_b``), ``key_b`` b's. ``frame.attrs["notes"]`` says what
    was lined up and gives hints (a glob that matched nothing on one side, a ``key_map`` to
    try); ``frame.attrs["key_map"]`` is the key map used, when a dict.

    Memory stays at about two blocks plus what the readers hold for the current tensor
    (≤ 2 × the largest tensor + 64 MB) per worker: tensors are compared on ``workers`` threads,
    and spread over the ranks of an initialised torch.distributed process group (every rank
    returns the whole table).

    Args:
        a: the first checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        b: the second checkpoint, in the same forms.
        keys: globs selecting entries by (mapped) dotted key; None compares every key.
        key_map: a dict of prefix → prefix or a callable, applied to both sides' keys; None
            lines up a one-file checkpoint's stem with the other's groups, ``{}`` does not.
        rtol: relative tolerance for ``close`` (default 1e-5; must be >= 0).
        atol: absolute tolerance for ``close`` (default 0.0; must be >= 0).
        storage_options: fsspec options for ``a`` and ``b`` (when URLs).
        progress: show a progress bar (default False).
        workers: threads comparing tensors at once.

    Returns:
        A DataFrame of :data:`COLUMNS`, one row per key; ``attrs`` as described above.

    Example:
        >>> frame = ckptkit.diff("ckpt/step_1000", "release/model.safetensors", rtol=1e-2)
        >>> frame["status"].value_counts()
    """
    import pandas as pd

    if not (rtol >= 0 and atol >= 0):
        raise UsageError(f"rtol and atol must be >= 0, got rtol={rtol!r} atol={atol!r}")
    ckpt_a = open_source(a, storage_options)
    ckpt_b = open_source(b, storage_options)
    notes: list[str] = []
    if key_map is None:
        key_map = aligned_key_map(ckpt_a, ckpt_b, notes)
    values = (_Values(ckpt_a), _Values(ckpt_b))
    loads = (values[0].load, values[1].load)
    matches = match_keys(ckpt_a, ckpt_b, key_map, keys, loads, notes)
    tolerance = _Tolerance(rtol, atol)
    rows = _compare_pairs(
        ckpt_a, ckpt_b, matches, values, tolerance, progress, work.check_workers(workers)
    )
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["numel"] = frame["numel"].astype("Int64")
    frame.attrs.update(
        a=_location(ckpt_a),
        b=_location(ckpt_b),
        rtol=rtol,
        atol=atol,
        key_map=dict(key_map) if isinstance(key_map, Mapping) else None,
        notes=notes,
    )
    return frame


#: An entry of a and an entry of b compared at one key (None: the key is on one side only).
Pair = tuple[Entry | None, Entry | None]


def _compare_pairs(
    ckpt_a: Source,
    ckpt_b: Source,
    matches: list[Match],
    values: tuple[_Values, _Values],
    tolerance: _Tolerance,
    progress: bool,
    workers: int,
) -> list[dict[str, Any]]:
    """One row per match: objects and leaves of objects compared by value (each side's objects
    read in one batch), tensors streamed as work items (each thread with its own readers)."""
    values_a, values_b = values
    values_a.load([m.a for m in matches if _needs_value(m.a, m.b)])
    values_b.load([m.b for m in matches if _needs_value(m.b, m.a)])
    total = sum(max(m.a.nbytes, m.b.nbytes) for m in matches if _both_tensors(m.a, m.b))
    rows = []
    tensor_pairs = []
    for i, match in enumerate(matches):
        row = _row(match)
        ea, eb = match.a, match.b
        if ea is None:
            row["status"] = "only_b"
        elif eb is None:
            row["status"] = "only_a"
        elif isinstance(ea, Leaf) or isinstance(eb, Leaf):
            found = _compare_values(
                _value_of(ea, values_a, ckpt_a.reader),
                _value_of(eb, values_b, ckpt_b.reader),
                tolerance,
            )
            found["note"] = "; ".join(filter(None, (found.get("note"), row["note"])))
            row.update(found)
        elif ea.kind != eb.kind:
            row["status"] = "object_changed"
            row["note"] = f"{ea.kind} in a, {eb.kind} in b"
        elif ea.kind == "object":
            row["status"], row["note"] = _object_verdict(values_a.get(ea), values_b.get(eb))
        else:
            tensor_pairs.append(work.WorkItem(i, max(ea.nbytes, eb.nbytes), (ea, eb)))
        rows.append(row)
    readers = work.PerThread(lambda: (ckpt_a.reader.fresh(), ckpt_b.reader.fresh()))
    with (
        distributed.joined() as ranks,
        distributed.JobProgress(total, progress, "diff", ranks) as bar,
    ):

        def compare(item: work.WorkItem[Pair], stop: work.Stop) -> dict[str, Any]:
            stop.check()
            reader_a, reader_b = readers.get() if workers > 1 else (ckpt_a.reader, ckpt_b.reader)
            ea, eb = item.task
            return _compare_tensor_entries(reader_a, ea, reader_b, eb, tolerance, bar)

        compared = work.run_everywhere(
            tensor_pairs, compare, workers=workers, ranks=ranks, what="diff"
        )
    for index, found in compared.items():
        rows[index].update(found)
    return rows


def _location(ckpt: Source) -> str:
    """Where a checkpoint is: its directory, or the one file that was named."""
    files = ckpt.detection.files
    return ckpt.storage.describe(files[0]) if files and len(files) == 1 else ckpt.url


def _both_tensors(ea: Entry | Leaf | None, eb: Entry | Leaf | None) -> bool:
    """Whether both sides are tensor entries (streamed as work items)."""
    return isinstance(ea, Entry) and isinstance(eb, Entry) and ea.kind == eb.kind == "tensor"


def _needs_value(item: Entry | Leaf | None, other: Entry | Leaf | None) -> bool:
    """Whether ``item`` is an object entry whose decoded value the comparison uses."""
    if not isinstance(item, Entry) or item.kind != "object" or other is None:
        return False
    return isinstance(other, Leaf) or other.kind == "object"


def _row(match: Match) -> dict[str, Any]:
    item = match.a if match.a is not None else match.b
    tensor = _tensor_facts(item)
    inside = [
        f"inside {label}'s object {side.entry.key}"
        for label, side in (("a", match.a), ("b", match.b))
        if isinstance(side, Leaf)
    ]
    return {
        "key": item.key,
        "status": None,
        "dtype": tensor[0] if tensor else None,
        "shape": tensor[1] if tensor else None,
        "numel": math.prod(tensor[1]) if tensor else None,
        "max_abs": math.nan,
        "mean_abs": math.nan,
        "rel_l2": math.nan,
        "cosine": math.nan,
        "frac_outside": math.nan,
        "note": "; ".join(inside),
        "key_b": match.b.key if match.b is not None else None,
    }


def _tensor_facts(item: Entry | Leaf) -> tuple[str, tuple[int, ...]] | None:
    """``(dtype name, shape)`` of a tensor entry or of a tensor inside an object, else None."""
    if isinstance(item, Entry):
        return (item.dtype.name, item.shape) if item.kind == "tensor" else None
    if _is_torch_tensor(item.value):
        return str(item.value.dtype).removeprefix("torch."), tuple(item.value.shape)
    return None


# -- tensors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tolerance:
    rtol: float
    atol: float


def _compare_tensor_entries(
    reader_a: Reader, ea: Entry, reader_b: Reader, eb: Entry, tol: _Tolerance, bar
) -> dict[str, Any]:
    change = _structural_change(ea.dtype, ea.shape, eb.dtype, eb.shape)
    if change is not None:
        bar.update(max(ea.nbytes, eb.nbytes))
        return change

    def blocks() -> Iterator[tuple[int, memoryview, memoryview]]:
        for n, ba, bb in aligned_blocks(reader_a, ea, reader_b, eb):
            bar.update(max(len(ba), len(bb)))
            yield n, ba, bb

    stats = _compare_blocks(blocks(), ea.dtype, eb.dtype, ea.numel, tol)
    if not stats.identical and stats.prefix:
        _add_prefix_norms(reader_a, ea, stats)
    return _verdict(stats, ea.dtype, eb.dtype, tol)


def _structural_change(
    da: DType, shape_a: tuple[int, ...], db: DType, shape_b: tuple[int, ...]
) -> dict[str, Any] | None:
    """The row of two tensors that cannot be compared element by element, else None."""
    if shape_a != shape_b:
        return {"status": "shape_changed", "note": f"shape {shape_a} → {shape_b}"}
    if da != db and not (_numeric(da) and _numeric(db)):
        return {"status": "dtype_changed", "note": f"dtype {da.name} → {db.name}"}
    return None


def _verdict(stats: _Stats, da: DType, db: DType, tol: _Tolerance) -> dict[str, Any]:
    """The row's status and numbers; a change of floating dtype within tolerance is ``close``."""
    out = stats.result(tol)
    if da != db:
        within = da.is_floating and db.is_floating and out["status"] in SAME
        out.update(
            status="close" if within else "dtype_changed", note=f"dtype {da.name} → {db.name}"
        )
    return out


def _numeric(dt: DType) -> bool:
    return dt.name != "bool" and (dt.is_floating or dt.numpy is not None)


def _max_abs(x: np.ndarray) -> float:
    """max |x| ignoring NaN (0 for an empty block)."""
    return float(np.fmax.reduce(np.abs(x), initial=0.0)) if x.size else 0.0


def _sumsq(x: np.ndarray) -> float:
    """‖x‖², without BLAS (whose threads spin for ms per block on a busy machine)."""
    if x.dtype.kind == "c":
        x = np.abs(x)
    return float(np.einsum("i,i->", x, x))


class _Stats:
    """Running sums over blocks; the identical prefix's ‖a‖² is filled in at the end."""

    def __init__(self, numel: int, exact: bool) -> None:
        self.numel = numel
        self.exact = exact  # integer/bool: no tolerance
        self.identical = True
        self.prefix = 0  # elements of the leading bit-identical blocks (no float math done)
        self.sum_abs = 0.0
        self.max_abs = 0.0
        self.sumsq_a = 0.0
        self.sumsq_b = 0.0
        self.dot = 0.0
        self.sumsq_diff = 0.0
        self.outside = 0
        self.scale = 0.0  # max |a|, |b| over the tensor (NaN ignored): what "small" is measured by

    def same_block(self, x: np.ndarray) -> None:
        """A bit-identical block after a difference was seen: only ‖a‖², ‖b‖², ⟨a,b⟩ and the
        scale grow."""
        s = _sumsq(x)
        self.sumsq_a += s
        self.sumsq_b += s
        self.dot += s
        self.scale = max(self.scale, _max_abs(x))

    def block(self, x: np.ndarray, y: np.ndarray, raw_differs: np.ndarray | None, tol) -> None:
        d = np.subtract(x, y)
        d = np.abs(d, out=d) if d.dtype.kind == "f" else np.abs(d)
        nan = np.isnan(d)
        if nan.any():  # NaN vs NaN and inf vs the same inf match; NaN vs a number is inf apart
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            d[same] = 0.0
            d[nan & ~same] = math.inf
        del nan
        if raw_differs is not None:  # integers: exact
            self.outside += int(np.count_nonzero(raw_differs))
        else:
            bound = np.abs(y)
            bound *= tol.rtol
            bound += tol.atol
            self.outside += int(np.count_nonzero(d > bound))
            del bound
        self.sum_abs += float(d.sum())
        if d.size:
            self.max_abs = max(self.max_abs, float(d.max()))
            self.scale = max(self.scale, _max_abs(x), _max_abs(y))
        self.sumsq_a += _sumsq(x)
        self.sumsq_b += _sumsq(y)
        self.dot += (
            float(np.einsum("i,i->", x, np.conj(y)).real)
            if x.dtype.kind == "c"
            else (float(np.einsum("i,i->", x, y)))
        )
        self.sumsq_diff += _sumsq(d)

    def result(self, tol: _Tolerance) -> dict[str, Any]:
        if self.identical:
            return {
                "status": "equal",
                "max_abs": 0.0,
                "mean_abs": 0.0,
                "rel_l2": 0.0,
                "cosine": 1.0,
                "frac_outside": 0.0,
            }
        norm_a, norm_b = math.sqrt(self.sumsq_a), math.sqrt(self.sumsq_b)
        norm_diff = math.sqrt(self.sumsq_diff)
        rel_l2 = norm_diff / norm_a if norm_a else (0.0 if norm_diff == 0 else math.inf)
        if norm_a and norm_b:
            cosine = self.dot / (norm_a * norm_b)
        else:
            cosine = 1.0 if norm_a == norm_b == 0 else math.nan
        if self.exact:
            close = self.outside == 0
        else:
            close = self.max_abs <= tol.atol + tol.rtol * self.scale and norm_diff <= (
                tol.atol * math.sqrt(self.numel) + tol.rtol * max(norm_a, norm_b)
            )
        return {
            "status": "close" if close else "different",
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / self.numel if self.numel else 0.0,
            "rel_l2": rel_l2,
            "cosine": cosine,
            "frac_outside": self.outside / self.numel if self.numel else 0.0,
        }


def _compare_blocks(
    blocks: Iterable[tuple[int, memoryview, memoryview]],
    da: DType,
    db: DType,
    numel: int,
    tol: _Tolerance,
) -> _Stats:
    """Running statistics over ``(n, a's bytes, b's bytes)`` blocks of two tensors' elements."""
    same_dtype = da == db
    stats = _Stats(numel, exact=same_dtype and not da.is_floating)
    for _n, ba, bb in blocks:
        if same_dtype and bytes_equal(ba, bb):
            if stats.identical:
                stats.prefix += _n
            else:
                stats.same_block(as_float(ba, da))
            del ba, bb
            continue
        stats.identical = False
        raw_differs = None
        if stats.exact:
            np_dtype = dtypes.to_numpy(da)
            raw_differs = np.frombuffer(ba, np_dtype) != np.frombuffer(bb, np_dtype)
        stats.block(as_float(ba, da), as_float(bb, db), raw_differs, tol)
        del ba, bb, raw_differs  # so the next read does not overlap a spent record
    return stats


def _add_prefix_norms(reader: Reader, entry: Entry, stats: _Stats) -> None:
    """Re-read the leading identical elements of a tensor that turned out to differ later."""
    stream = ByteStream(reader.iter_bytes(entry), entry.key)
    remaining = stats.prefix
    while remaining:
        n = min(tunables.BLOCK_ELEMENTS, remaining)
        stats.same_block(as_float(stream.take(n * entry.dtype.itemsize), entry.dtype))
        remaining -= n


# -- objects ------------------------------------------------------------------------------


class _Values:
    """Decoded values of one side's object entries, read in batches and kept for the diff."""

    def __init__(self, ckpt: Source) -> None:
        self.ckpt = ckpt
        self._known: dict[str, Any] = {}

    def load(self, entries: list[Entry]) -> list[Any]:
        """The values of ``entries``, those not read yet read in one batch."""
        missing = list({e.key: e for e in entries if e.key not in self._known}.values())
        if missing:
            self._known.update(
                zip((e.key for e in missing), _read_objects(self.ckpt, missing), strict=True)
            )
        return [self._known[e.key] for e in entries]

    def get(self, entry: Entry) -> Any:
        return self.load([entry])[0]


@dataclass(frozen=True)
class _TensorValue:
    """A tensor's row-major element bytes, for comparing a tensor inside an object."""

    dtype: DType
    shape: tuple[int, ...]
    data: bytes


def _value_of(item: Entry | Leaf, values: _Values, reader: Reader) -> Any:
    """What a side holds at a key, for comparing by value: a tensor as :class:`_TensorValue`."""
    if isinstance(item, Entry) and item.kind == "tensor":
        return _TensorValue(item.dtype, item.shape, b"".join(reader.iter_bytes(item)))
    value = item.value if isinstance(item, Leaf) else values.get(item)
    if _is_torch_tensor(value):
        dt = dtypes.BY_NAME.get(str(value.dtype).removeprefix("torch."))
        if dt is not None and value.layout is sys.modules["torch"].strided:
            flat = value.detach().contiguous().reshape(-1)
            data = flat.view(sys.modules["torch"].uint8).numpy().tobytes()
            return _TensorValue(dt, tuple(value.shape), data)
    return value


def _compare_values(va: Any, vb: Any, tol: _Tolerance) -> dict[str, Any]:
    """The row of two values at one key where one side holds it inside an object."""
    tensors = isinstance(va, _TensorValue), isinstance(vb, _TensorValue)
    if all(tensors):
        change = _structural_change(va.dtype, va.shape, vb.dtype, vb.shape)
        if change is not None:
            return change
        numel = math.prod(va.shape)
        blocks = [(numel, memoryview(va.data), memoryview(vb.data))] if numel else []
        stats = _compare_blocks(blocks, va.dtype, vb.dtype, numel, tol)
        return _verdict(stats, va.dtype, vb.dtype, tol)
    if any(tensors):
        kinds = ["tensor" if t else "object" for t in tensors]
        return {"status": "object_changed", "note": f"{kinds[0]} in a, {kinds[1]} in b"}
    status, note = _object_verdict(va, vb)
    return {"status": status, "note": note}


def _object_verdict(va: Any, vb: Any) -> tuple[str, str]:
    """``(status, note)`` of two decoded objects."""
    if same_value(va, vb):
        return "equal", ""
    from ..catalog.tables import preview

    return "object_changed", f"{preview(va)} → {preview(vb)}"


def _is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (never imports torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _read_objects(ckpt: Source, entries: list[Entry]) -> list[Any]:
    """Decoded values; torch is imported only for objects that hold tensors."""
    values = ckpt.reader.read_objects(entries, tensors="ref")
    for i, value in enumerate(values):
        if holds_tensor(value):
            values[i] = ckpt.reader.read_objects([entries[i]], tensors="torch")[0]
    return values
