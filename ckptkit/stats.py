"""Per-tensor statistics and content fingerprints of a checkpoint, in one streaming pass.

Every tensor streams once through the reader (blocks of :data:`~ckptkit.tensor_blocks.BLOCK_ELEMENTS`
elements, whatever the format and sharding). While the calling thread reads, one helper thread
feeds the bytes to a SHA-256 and another accumulates the statistics in float64 (bfloat16 and
fp8 decoded exactly) sub-block by sub-block, so memory stays at what the reader holds for the
current tensor plus a few MB.

The **fingerprint** of a tensor hashes its dtype, shape and canonical bytes (row-major,
little-endian, as :meth:`Reader.iter_bytes` streams them), so it is the same for a DCP at any
world size, its safetensors or torch.save unshard, or a ZeRO checkpoint: the same values give
the same fingerprint, one changed bit (even NaN payloads, or -0.0 vs 0.0) a different one. The
fingerprint of a **checkpoint** (:func:`fingerprint`) hashes the sorted (key, tensor
fingerprint) pairs of its tensors: keys participate (a renamed parameter is a different
checkpoint), wrapper segments such as ``_fsdp_wrapped_module.`` are dropped first (as
:func:`ckptkit.diff.map_key` does), and non-tensor objects (trainer state, hyper-parameters)
do not, because each format pickles them differently.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from . import tensor_blocks
from .catalog import Entry
from .diff import map_key
from .dtypes import DType
from .errors import KeyNotFoundError
from .progress import ByteProgress
from .reading import Reader
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

#: Columns of :func:`stats`, in order.
COLUMNS = [
    "key",
    "group",
    "dtype",
    "shape",
    "numel",
    "min",
    "max",
    "mean",
    "std",
    "l2",
    "abs_max",
    "frac_zero",
    "frac_nan",
    "frac_inf",
    "fingerprint",
]
#: The statistics columns (what :func:`ckptkit.run` keeps per step).
STAT_COLUMNS = COLUMNS[5:14]
#: Elements converted to float64 at once: 512 KiB, so the passes over them stay in L2 cache.
SUB_BLOCK = 1 << 16
#: Blocks handed to the hashing thread and not yet hashed, at most (each ≤ 8 MiB).
MAX_PENDING = 3
#: Hashed before every tensor's dtype, shape and bytes, and every checkpoint's pairs: a
#: different definition must change this, so old and new fingerprints never compare equal.
TENSOR_DOMAIN = b"ckptkit.tensor.v1"
CHECKPOINT_DOMAIN = b"ckptkit.checkpoint.v1"


def stats(
    src: str | Source,
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    *,
    fingerprints: bool = True,
    storage_options: dict | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """One row per tensor of ``src`` (``keys`` globs / ``groups`` select): numel, min, max,
    mean, std, l2 norm, abs_max, the fractions of elements that are zero / NaN / ±Inf, and the
    tensor's content ``fingerprint`` (None with ``fingerprints=False``, which saves the hashing).

    One streaming pass reads each byte once, in memory bounded by what the reader holds for
    one tensor (≤ the largest tensor + 64 MB). Sums run in float64 (pairwise within blocks,
    Chan's merge across them). ``min``, ``max``, ``mean``, ``std`` (torch's default,
    correction 1), ``l2`` and ``abs_max`` are over the **finite** elements, so one NaN does not
    hide the rest (``frac_nan`` / ``frac_inf`` count the others); NaN where no finite element
    exists (``std``: fewer than two). Integers above 2**53 are rounded to float64; complex
    tensors get the statistics of their magnitudes. ``frame.attrs["fingerprint"]`` is the
    checkpoint fingerprint of the selection (see :func:`fingerprint`).
    """
    import pandas as pd

    source = open_source(src, storage_options)
    entries = select_tensors(source, keys, groups)
    rows = tensor_rows(source, entries, fingerprints=fingerprints, progress=progress)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["numel"] = frame["numel"].astype("int64")
    frame.attrs.update(url=source.url, format=source.format)
    if fingerprints:
        frame.attrs["fingerprint"] = combine(zip(frame["key"], frame["fingerprint"], strict=True))
    return frame


def fingerprint(
    src: str | Source,
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    *,
    storage_options: dict | None = None,
    progress: bool = False,
) -> str:
    """The content fingerprint of ``src``'s tensors (``keys`` / ``groups`` select), a SHA-256
    hex digest that is equal for equal content whatever the format, sharding and world size:
    "is this the same model?" answered from one string. Reads every tensor once (hashing only,
    no statistics); :func:`stats` gives the per-tensor fingerprints it combines."""
    source = open_source(src, storage_options)
    entries = select_tensors(source, keys, groups)
    rows = tensor_rows(source, entries, moments=False, progress=progress)
    return combine((row["key"], row["fingerprint"]) for row in rows)


def combine(pairs: Any) -> str:
    """The checkpoint fingerprint of (key, tensor fingerprint) pairs: keys with wrapper
    segments dropped, sorted, hashed with their fingerprints."""
    named = sorted((map_key(key), value) for key, value in pairs)
    digest = hashlib.sha256(CHECKPOINT_DOMAIN + b"\0")
    for key, value in named:
        digest.update(f"{len(key)}:{key}={value}\n".encode())
    return digest.hexdigest()


def select_tensors(
    source: Source, keys: Sequence[str] | str | None, groups: Sequence[str] | str | None
) -> list[Entry]:
    """The selected tensor entries; a selection matching nothing is an error (a mistyped glob
    must not look like an empty checkpoint)."""
    entries = [e for e in source.catalog.select(keys, groups) if e.kind == "tensor"]
    if not entries and (keys is not None or groups is not None):
        raise KeyNotFoundError(f"{source.url}: no tensor matches keys={keys!r} groups={groups!r}")
    return entries


def tensor_rows(
    source: Source,
    entries: Sequence[Entry],
    *,
    moments: bool = True,
    fingerprints: bool = True,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """A :data:`COLUMNS` row per tensor entry, each tensor streamed once (statistics NaN when
    ``moments`` is False, fingerprints None when ``fingerprints`` is)."""
    rows = []
    total = sum(e.nbytes for e in entries)
    with _Workers(moments, fingerprints) as workers, ByteProgress(total, progress, "stats") as bar:
        for entry in entries:
            rows.append(_tensor_row(source.reader, entry, workers, bar))
    return rows


class _Workers:
    """One thread hashing and one accumulating statistics while the calling thread reads the
    next block (hashlib, numpy and file reads release the GIL). Each is a single thread, so a
    tensor's blocks are taken in order; small tensors are handled inline (a hand-off costs
    more than they do)."""

    #: Tensors smaller than this (bytes) are processed in the calling thread.
    INLINE = 1 << 18

    def __init__(self, moments: bool, fingerprints: bool) -> None:
        self.moments, self.fingerprints = moments, fingerprints
        self.scratch = _Scratch() if moments else None
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix="ckptkit-stats") for _ in range(2)]
        self.pending: deque[Future] = deque()

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, index: int, inline: bool, fn, *args: Any) -> None:
        """``fn(*args)`` on worker ``index`` (0: hashing, 1: statistics), or here if ``inline``
        (for every block of a tensor, never some: the worker takes them in order)."""
        if inline:
            fn(*args)
            return
        self.pending.append(self.pools[index].submit(fn, *args))
        while len(self.pending) > MAX_PENDING * len(self.pools):
            self.pending.popleft().result()

    def drain(self) -> None:
        """Wait for every block handed off (and raise what a worker raised)."""
        while self.pending:
            self.pending.popleft().result()


def _tensor_row(reader: Reader, entry: Entry, workers: _Workers, bar) -> dict[str, Any]:
    """Stream one tensor: its bytes to the hashing thread, its values to the statistics one."""
    acc = _Moments(workers.scratch) if workers.moments else None
    digest = _tensor_digest(entry) if workers.fingerprints else None
    inline = entry.nbytes < workers.INLINE
    try:
        for block in tensor_blocks.blocks(reader, entry):
            if digest is not None:
                workers.submit(0, inline, digest.update, block)
            if acc is not None:
                workers.submit(1, inline, acc.add_bytes, block, entry.dtype)
            bar.update(len(block))
            del block  # so the next read does not overlap a spent record
    finally:  # the tensor's bytes are done with before the next tensor is read
        workers.drain()
    return {
        "key": entry.key,
        "group": entry.group,
        "dtype": entry.dtype.name,
        "shape": entry.shape,
        "numel": entry.numel,
        **(acc.result(entry.numel) if acc is not None else dict.fromkeys(STAT_COLUMNS, math.nan)),
        "fingerprint": digest.hexdigest() if digest is not None else None,
    }


def _tensor_digest(entry: Entry):
    """A SHA-256 primed with the tensor's dtype and shape: equal bytes of another shape or
    dtype (a reshape, an int32 view of floats) do not share a fingerprint."""
    shape = ",".join(str(n) for n in entry.shape)
    return hashlib.sha256(TENSOR_DOMAIN + f"\0{entry.dtype.name}\0[{shape}]\0".encode())


class _Scratch:
    """Work arrays of one sub-block, allocated once per :func:`tensor_rows` call."""

    def __init__(self) -> None:
        self.values = np.empty(SUB_BLOCK, np.float64)
        self.mask = np.empty(SUB_BLOCK, np.bool_)


#: Element types whose min, max and zeros numpy finds fast and exactly in their own type.
_NATIVE = frozenset(
    np.dtype(t) for t in ("<f4", "<f8", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1")
)


class _Moments:
    """Running float64 statistics over the finite elements, merged sub-block by sub-block
    (Chan et al.'s pairwise update: exact two-pass moments inside each sub-block)."""

    def __init__(self, scratch: _Scratch) -> None:
        self.scratch = scratch
        self.count = 0  # finite elements seen
        self.mean = 0.0
        self.m2 = 0.0  # Σ (x − mean)²
        self.sumsq = 0.0
        self.low = math.inf
        self.high = -math.inf
        self.zeros = 0
        self.nans = 0
        self.infs = 0

    def add_bytes(self, raw: memoryview, dt: DType) -> None:
        """Add the elements of ``dt`` in ``raw`` (whole elements, little-endian)."""
        step = SUB_BLOCK * dt.itemsize
        for start in range(0, len(raw), step):
            piece = raw[start : start + step]
            native = np.frombuffer(piece, np.dtype(dt.numpy)) if dt.numpy else None
            if native is not None and native.dtype in _NATIVE:
                self._add_native(native)
            else:
                self._add(self._float64(piece, dt, native))

    def _float64(self, raw: memoryview, dt: DType, values: np.ndarray | None) -> np.ndarray:
        """The elements as a float64 array this accumulator may overwrite."""
        if values is None:  # bfloat16, fp8: decoded exactly
            return tensor_blocks.as_float(raw, dt)
        if values.dtype.kind == "c":  # magnitudes, computed in double precision
            return np.abs(values.astype(np.complex128))
        out = self.scratch.values[: values.size]
        np.copyto(out, values, casting="unsafe")
        return out

    def _add_native(self, values: np.ndarray) -> None:
        """float32/64 and integers: min, max and zeros in their own type (exact, and several
        times faster than in float64), the sums in float64."""
        n = values.size
        low, high = values.min(), values.max()
        if values.dtype.kind == "f" and not (math.isfinite(low) and math.isfinite(high)):
            self._add(self._float64(None, None, values))  # NaN/Inf inside: the general path
            return
        self.zeros += int(np.count_nonzero(np.equal(values, 0, out=self.scratch.mask[:n])))
        x = self.scratch.values[:n]
        np.copyto(x, values, casting="unsafe")
        self._merge(x, float(x.sum()), float(low), float(high))

    def _add(self, x: np.ndarray) -> None:
        n = x.size
        zero = np.equal(x, 0, out=self.scratch.mask[:n])
        self.zeros += int(np.count_nonzero(zero))
        total = float(x.sum())
        if not math.isfinite(total):  # NaN or ±Inf inside (or a float64 overflow)
            finite = np.isfinite(x)
            nans = int(np.count_nonzero(np.isnan(x)))
            self.nans += nans
            self.infs += n - nans - int(np.count_nonzero(finite))
            x = x[finite]
            if not x.size:
                return
            total = float(x.sum())
        self._merge(x, total, float(x.min()), float(x.max()))

    def _merge(self, x: np.ndarray, total: float, low: float, high: float) -> None:
        """Fold finite float64 values ``x`` (overwritten), their sum, min and max in."""
        n = x.size
        self.low = min(self.low, low)
        self.high = max(self.high, high)
        mean = total / n
        x -= mean
        np.multiply(x, x, out=x)  # not np.dot: BLAS threads crawl on a busy machine
        m2 = float(x.sum())
        merged = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / merged
        self.mean += delta * n / merged
        self.sumsq += m2 + n * mean * mean
        self.count = merged

    def result(self, numel: int) -> dict[str, float]:
        """The :data:`STAT_COLUMNS` values."""
        seen = self.count > 0
        return {
            "min": self.low if seen else math.nan,
            "max": self.high if seen else math.nan,
            "mean": self.mean if seen else math.nan,
            "std": math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else math.nan,
            "l2": math.sqrt(self.sumsq),
            "abs_max": max(-self.low, self.high) if seen else math.nan,
            "frac_zero": self.zeros / numel if numel else 0.0,
            "frac_nan": self.nans / numel if numel else 0.0,
            "frac_inf": self.infs / numel if numel else 0.0,
        }
