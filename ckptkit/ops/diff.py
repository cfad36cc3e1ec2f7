"""Per-key differences between two checkpoints of any formats, streamed tensor by tensor.

Keys are matched after dropping wrapper segments (``_fsdp_wrapped_module.`` …) and applying a
``key_map``; tensors stream from both sides in lockstep, in blocks of at most
:data:`~ckptkit.tunables.BLOCK_ELEMENTS` elements whatever the two sides' chunking. Each block's raw bytes are
compared first, so bit-identical tensors cost a byte comparison and no float math.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes, tunables
from ..catalog.keys import KeyMap, map_key
from ..catalog.model import Entry
from ..decoding.unpickler import Opaque, TensorRef
from ..dtypes import DType
from ..errors import KeyNotFoundError, UsageError
from ..reading import Reader
from ..reading.tensor_blocks import ByteStream, aligned_blocks, as_float, bytes_equal
from . import distributed, work
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "STATUSES", "SAME", "diff", "Pair", "same_value"]

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
    "equal",  # same dtype and shape, bit-identical bytes
    "close",  # same dtype and shape, within tolerance of the tensor's own scale (see diff())
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
    bool tensors have no tolerance. ``max_abs`` = max |a−b|, ``mean_abs``, ``rel_l2`` =
    ‖a−b‖/‖a‖, ``cosine``, and ``frac_outside`` = the element-wise view, the fraction of
    elements with |a−b| > atol + rtol·|b| (``torch.isclose``; NaN matches NaN). Keys are matched after ``key_map`` (a dict of
    prefix → prefix, or a callable) is applied to both sides' keys, wrapper segments such as
    ``_fsdp_wrapped_module.`` dropped; ``keys`` globs select among the mapped keys. ``key`` is
    a's key (b's for ``only_b``), ``key_b`` b's. Memory stays at about two blocks plus what the
    readers hold for the current tensor (≤ 2 × the largest tensor + 64 MB) per worker:
    tensors are compared on ``workers`` threads, and spread over the ranks of an initialised
    torch.distributed process group (every rank returns the whole table).
    """
    import pandas as pd

    if not (rtol >= 0 and atol >= 0):
        raise UsageError(f"rtol and atol must be >= 0, got rtol={rtol!r} atol={atol!r}")
    ckpt_a = open_source(a, storage_options)
    ckpt_b = open_source(b, storage_options)
    pairs = _pairs(ckpt_a, ckpt_b, key_map, keys)
    tolerance = _Tolerance(rtol, atol)
    rows = _compare_pairs(ckpt_a, ckpt_b, pairs, tolerance, progress, work.check_workers(workers))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["numel"] = frame["numel"].astype("Int64")
    frame.attrs.update(a=_location(ckpt_a), b=_location(ckpt_b), rtol=rtol, atol=atol)
    return frame


Pair = tuple[Entry | None, Entry | None]


def _pairs(
    ckpt_a: Source, ckpt_b: Source, key_map: KeyMap, keys: Sequence[str] | str | None
) -> list[Pair]:
    """``(a's entry, b's entry)`` per mapped key: a's keys in order, then those only in b."""
    side_a = _mapped(ckpt_a, key_map, keys)
    side_b = _mapped(ckpt_b, key_map, keys)
    if keys is not None and not side_a and not side_b:  # a mistyped glob must not "pass"
        raise KeyNotFoundError(
            f"{ckpt_a.url}, {ckpt_b.url}: no key matches {keys!r} ({ckpt_a.catalog.hint(keys)})"
        )
    pairs: list[Pair] = [(entry, side_b.get(name)) for name, entry in side_a.items()]
    pairs += [(None, entry) for name, entry in side_b.items() if name not in side_a]
    return pairs


def _compare_pairs(
    ckpt_a: Source,
    ckpt_b: Source,
    pairs: list[Pair],
    tolerance: _Tolerance,
    progress: bool,
    workers: int,
) -> list[dict[str, Any]]:
    """One row per pair: objects compared by value in one batch, tensors streamed as work
    items (each thread with its own pair of readers)."""
    objects = _compare_objects(
        ckpt_a,
        ckpt_b,
        [(ea, eb) for ea, eb in pairs if _both(ea, eb) and ea.kind == eb.kind == "object"],
    )
    total = sum(
        max(ea.nbytes, eb.nbytes)
        for ea, eb in pairs
        if _both(ea, eb) and ea.kind == eb.kind == "tensor"
    )
    rows = []
    tensor_pairs = []
    for i, (ea, eb) in enumerate(pairs):
        row = _row(ea, eb)
        if ea is None:
            row["status"] = "only_b"
        elif eb is None:
            row["status"] = "only_a"
        elif ea.kind != eb.kind:
            row["status"] = "object_changed"
            row["note"] = f"{ea.kind} in a, {eb.kind} in b"
        elif ea.kind == "object":
            row["status"], row["note"] = objects[ea.key]
        else:
            tensor_pairs.append(work.WorkItem(i, max(ea.nbytes, eb.nbytes), (ea, eb)))
        rows.append(row)
    readers = work.PerThread(lambda: (ckpt_a.reader.fresh(), ckpt_b.reader.fresh()))
    ranks = distributed.current()
    with distributed.JobProgress(total, progress, "diff", ranks) as bar:

        def compare(item: work.WorkItem[Pair], stop: work.Stop) -> dict[str, Any]:
            stop.check()
            reader_a, reader_b = readers.get() if workers > 1 else (ckpt_a.reader, ckpt_b.reader)
            ea, eb = item.task
            return _compare_tensor_entries(reader_a, ea, reader_b, eb, tolerance, bar)

        compared = work.run_everywhere(
            tensor_pairs, compare, workers=workers, ranks=ranks, what="diff"
        )
    for index, values in compared.items():
        rows[index].update(values)
    return rows


def _location(ckpt: Source) -> str:
    """Where a checkpoint is: its directory, or the one file that was named."""
    files = ckpt.detection.files
    return ckpt.storage.describe(files[0]) if files and len(files) == 1 else ckpt.url


# -- keys ---------------------------------------------------------------------------------


def _mapped(ckpt: Source, key_map: KeyMap, keys: Sequence[str] | str | None) -> dict:
    """Mapped key → entry of the selected entries of ``ckpt``; two keys mapping to one refused."""
    patterns = [keys] if isinstance(keys, str) else keys
    skipped = set(ckpt.catalog.facts.alternate_groups) if patterns is None else set()
    out: dict[str, Entry] = {}
    for entry in ckpt.catalog.entries.values():
        if entry.group in skipped:  # views of bytes other keys hold: compared there
            continue
        name = map_key(entry.key, key_map)
        if patterns is not None and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if name in out:
            raise UsageError(
                f"{ckpt.url}: keys {out[name].key!r} and {entry.key!r} both map to {name!r}"
            )
        out[name] = entry
    return out


def _both(ea: Entry | None, eb: Entry | None) -> bool:
    return ea is not None and eb is not None


def _row(ea: Entry | None, eb: Entry | None) -> dict[str, Any]:
    entry = ea if ea is not None else eb
    tensor = entry.kind == "tensor"
    return {
        "key": entry.key,
        "status": None,
        "dtype": entry.dtype.name if tensor else None,
        "shape": entry.shape if tensor else None,
        "numel": entry.numel if tensor else None,
        "max_abs": math.nan,
        "mean_abs": math.nan,
        "rel_l2": math.nan,
        "cosine": math.nan,
        "frac_outside": math.nan,
        "note": "",
        "key_b": eb.key if eb is not None else None,
    }


# -- tensors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tolerance:
    rtol: float
    atol: float


def _compare_tensor_entries(
    reader_a: Reader, ea: Entry, reader_b: Reader, eb: Entry, tol: _Tolerance, bar
) -> dict[str, Any]:
    if ea.shape != eb.shape:
        bar.update(max(ea.nbytes, eb.nbytes))
        return {"status": "shape_changed", "note": f"shape {ea.shape} → {eb.shape}"}
    numeric = _numeric(ea.dtype) and _numeric(eb.dtype)
    if ea.dtype != eb.dtype and not numeric:
        bar.update(max(ea.nbytes, eb.nbytes))
        return {"status": "dtype_changed", "note": f"dtype {ea.dtype.name} → {eb.dtype.name}"}
    stats = _compare_streams(reader_a, ea, reader_b, eb, tol, bar)
    out = stats.result(tol)
    if ea.dtype != eb.dtype:
        out.update(status="dtype_changed", note=f"dtype {ea.dtype.name} → {eb.dtype.name}")
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


def _compare_streams(ra: Reader, ea: Entry, rb: Reader, eb: Entry, tol: _Tolerance, bar) -> _Stats:
    same_dtype = ea.dtype == eb.dtype
    stats = _Stats(ea.numel, exact=same_dtype and not ea.dtype.is_floating)
    for n, ba, bb in aligned_blocks(ra, ea, rb, eb):
        bar.update(max(len(ba), len(bb)))
        if same_dtype and bytes_equal(ba, bb):
            if stats.identical:
                stats.prefix += n
            else:
                stats.same_block(as_float(ba, ea.dtype))
            del ba, bb
            continue
        stats.identical = False
        raw_differs = None
        if stats.exact:
            np_dtype = dtypes.to_numpy(ea.dtype)
            raw_differs = np.frombuffer(ba, np_dtype) != np.frombuffer(bb, np_dtype)
        stats.block(as_float(ba, ea.dtype), as_float(bb, eb.dtype), raw_differs, tol)
        del ba, bb, raw_differs  # so the next read does not overlap a spent record
    if not stats.identical and stats.prefix:
        _add_prefix_norms(ra, ea, stats)
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


def _compare_objects(
    ckpt_a: Source, ckpt_b: Source, pairs: list[tuple[Entry, Entry]]
) -> dict[str, tuple[str, str]]:
    """a's key → (status, note) for each pair of object entries, compared by value."""
    if not pairs:
        return {}
    values_a = _read_objects(ckpt_a, [ea for ea, _ in pairs])
    values_b = _read_objects(ckpt_b, [eb for _, eb in pairs])
    out = {}
    for (ea, _), va, vb in zip(pairs, values_a, values_b, strict=True):
        if same_value(va, vb):
            out[ea.key] = ("equal", "")
        else:
            from ..catalog.tables import preview

            out[ea.key] = ("object_changed", f"{preview(va)} → {preview(vb)}")
    return out


def _read_objects(ckpt: Source, entries: list[Entry]) -> list[Any]:
    """Decoded values; torch is imported only for objects that hold tensors."""
    values = ckpt.reader.read_objects(entries, tensors="ref")
    for i, value in enumerate(values):
        if _holds_tensor(value):
            values[i] = ckpt.reader.read_objects([entries[i]], tensors="torch")[0]
    return values


def _holds_tensor(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorRef):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, Opaque):
            stack.extend([*item.args, item.state, *item.items])
    return False


def same_value(x: Any, y: Any) -> bool:
    """Equality of decoded objects: types must match (any two mappings compare by items), NaN
    equals NaN, tensors and arrays by dtype, shape and bytes, placeholders by global name,
    arguments and state."""
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(same_value(x[k], y[k]) for k in x)
    if type(x) is not type(y):
        return False
    if isinstance(x, Opaque):
        return (
            x.global_name == y.global_name
            and same_value(x.args, y.args)
            and same_value(x.state, y.state)
            and same_value(x.items, y.items)
        )
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_value(i, j) for i, j in zip(x, y, strict=True))
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        import torch  # already imported: x is a tensor

        return (
            x.dtype == y.dtype
            and x.shape == y.shape
            and x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            == y.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
    try:
        return bool(x == y)
    except (TypeError, ValueError):
        return x is y


# -- progress -----------------------------------------------------------------------------
