"""Per-tensor statistics and content fingerprints of a checkpoint, in one streaming pass.

Every tensor streams once through the reader (blocks of :data:`~ckptkit.tunables.BLOCK_ELEMENTS`
elements, whatever the format and sharding). Each block's bytes go to a SHA-256 and its values
to float64 statistics (bfloat16 and fp8 decoded exactly) accumulated sub-block by sub-block. Two
"lanes" (threads) stream two tensors at once when the reader's buffers for both fit the memory
goal (the largest tensor + 64 MiB), each lane handing the hashing to a helper thread: reading,
CRC-32 checks, hashing and statistics release the GIL, so on two cores they all overlap.
Otherwise one lane streams the tensors in turn, reading the next batch of records while its
helper hashes the last (memory: what the reader holds for one tensor plus a few MB).

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

import functools
import hashlib
import math
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import tunables
from ..catalog.keys import map_key
from ..catalog.model import Chunk, Encoding, Entry, distinct_chunks
from ..dtypes import DType
from ..errors import KeyNotFoundError
from ..progress import ByteProgress
from ..reading import Reader, tensor_blocks
from .source import Source, open_source, select_entries

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLUMNS",
    "STAT_COLUMNS",
    "SUB_BLOCK",
    "TENSOR_DOMAIN",
    "CHECKPOINT_DOMAIN",
    "stats",
    "fingerprint",
    "combine",
    "select_tensors",
    "tensor_rows",
    "LANE_SLACK",
    "DOT_ROW",
]

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
#: Elements converted to float64 at once: 1 MiB, so the passes over them stay in L2 cache.
SUB_BLOCK = 1 << 17
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

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        keys: globs selecting tensors by dotted key; None takes every tensor.
        groups: top-level groups to take (``"model"``, ``"optim"``…).
        fingerprints: compute each tensor's content fingerprint (default True).
        storage_options: fsspec options for ``src`` (when a URL).
        progress: show a progress bar (default False).

    Returns:
        A DataFrame with the :data:`COLUMNS`, one row per selected tensor; ``attrs`` hold
        ``url``, ``format`` and (with ``fingerprints``) the checkpoint ``fingerprint``.

    Example:
        >>> frame = ckptkit.stats("ckpt/step_1000", groups="model")
        >>> frame[frame["frac_nan"] > 0]
        >>> frame.nlargest(5, "abs_max")[["key", "abs_max", "std"]]
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
    no statistics); :func:`stats` gives the per-tensor fingerprints it combines.

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        keys: globs selecting tensors by dotted key; None takes every tensor.
        groups: top-level groups to take (``"model"``, ``"optim"``…).
        storage_options: fsspec options for ``src`` (when a URL).
        progress: show a progress bar (default False).

    Returns:
        The checkpoint fingerprint: a 64-character SHA-256 hex digest.

    Example:
        >>> a = ckptkit.fingerprint("ckpt/step_1000", groups="model")
        >>> a == ckptkit.fingerprint("release/model.safetensors")
        True
    """
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
    """The selected tensor entries; a group or glob matching nothing is an error naming it with
    a suggestion (:func:`select_entries`: a mistyped glob must not look like an empty
    checkpoint), and so is a selection holding no tensor."""
    selected = select_entries(source, keys, groups, what="tensor")
    entries = [e for e in selected if e.kind == "tensor"]
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
    ``moments`` is False, fingerprints None when ``fingerprints`` is). Two tensors stream at
    once when what the reader holds for the two largest fits :func:`_two_lanes_fit`."""
    total = sum(e.nbytes for e in entries)
    with ByteProgress(total, progress, "stats") as bar:
        if len(entries) > 1 and _two_lanes_fit(entries):
            return _two_lanes(source.reader, entries, moments, fingerprints, bar)
        with _Lane(moments, fingerprints, bar) as lane:
            return [lane.row(source.reader, entry, lag=_held_bytes(entry)) for entry in entries]


def _two_lanes(
    reader: Reader, entries: Sequence[Entry], moments: bool, fingerprints: bool, bar: Any
) -> list[dict[str, Any]]:
    """The rows of ``entries``, two threads each taking the next tensor: every stage (read,
    CRC-32, SHA-256, statistics) of one tensor then runs beside another tensor's, so both
    cores work even where one stage (the reader's CRC, the hashing) is sequential."""
    rows: list[dict[str, Any]] = [{}] * len(entries)
    todo = iter(range(len(entries)))
    lock, stop = threading.Lock(), threading.Event()
    safe_bar = _LockedProgress(bar)

    def work(lane: _Lane) -> None:
        # a reader of its own: a reader keeps caches that are not safe across threads
        own = Reader(reader.storage, reader.object_globals, verify_crc=reader.verify_crc)
        while not stop.is_set():
            with lock:
                index = next(todo, None)
            if index is None:
                return
            try:  # lag 0: a lane's helper is done with a block before the next is read
                rows[index] = lane.row(own, entries[index], lag=0)
            except BaseException:
                stop.set()  # the other lane stops after its current tensor
                raise

    with (
        _Lane(moments, fingerprints, safe_bar) as first,
        _Lane(moments, fingerprints, safe_bar) as second,
        ThreadPoolExecutor(2, thread_name_prefix="ckptkit-lane") as pool,
    ):
        futures = [pool.submit(work, first), pool.submit(work, second)]
        try:
            for future in futures:
                future.result()
        finally:
            stop.set()
    return rows


class _LockedProgress:
    """A progress bar two lanes update."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.lock = bar, threading.Lock()

    def update(self, n: int) -> None:
        with self.lock:
            self.bar.update(n)


#: Two tensors stream at once only if what the reader holds for both stays within the largest
#: tensor plus this (the goal: peak memory <= largest tensor + 64 MiB, the rest for buffers).
LANE_SLACK = 32 << 20


def _two_lanes_fit(entries: Sequence[Entry]) -> bool:
    """True when the reader's buffers for the two tensors holding the most at once fit in the
    largest tensor + :data:`LANE_SLACK` (a DCP's row shards do; two large safetensors do not)."""
    held = sorted((_held_bytes(e) for e in entries), reverse=True)
    return held[0] + held[1] <= max(e.nbytes for e in entries) + LANE_SLACK


def _held_bytes(entry: Entry) -> int:
    """About what the reader holds at once while it streams ``entry``: its largest batch of
    records as :meth:`Reader.iter_bytes` groups them (by :data:`~ckptkit.tunables.BATCH_BYTES`),
    a decompressed copy per transformed record, and the whole tensor when its chunks are not
    whole rows (it is assembled first). An estimate that only sizes the lanes' memory."""
    if entry.dtype is None:
        return 0
    itemsize = entry.dtype.itemsize
    chunks = [c for c in distinct_chunks(entry.chunks) if c.record is not None]
    held = batch = batch_length = 0
    for chunk in sorted(chunks, key=lambda c: c.offsets[:1]):
        record, elements = chunk.record, chunk.numel * itemsize
        if batch_length and batch_length + record.length > tunables.BATCH_BYTES:
            batch = batch_length = 0
        batch_length += record.length
        batch += elements if record.encoding is Encoding.SAFETENSORS else record.length
        batch += elements if record.transform else 0
        held = max(held, batch)
    if not _whole_rows(entry, chunks):
        held += entry.nbytes
    return held


def _whole_rows(entry: Entry, chunks: list[Chunk]) -> bool:
    """True when ``chunks`` are flat ranges or whole rows: they stream without assembly."""
    if all(c.flat for c in chunks):
        return True
    shape = entry.shape or ()
    return not any(c.flat or c.sizes[1:] != shape[1:] or any(c.offsets[1:]) for c in chunks)


class _Lane:
    """Streams tensors one at a time. A helper thread takes the heavier half of each block
    (SHA-256 when fingerprinting, else the statistics) while this thread does the other half
    and reads; hashlib, numpy and file reads release the GIL, so they overlap. Small tensors
    are handled inline (a hand-off costs more than they do)."""

    #: Tensors smaller than this (bytes) are processed in the calling thread.
    INLINE = 1 << 18

    def __init__(self, moments: bool, fingerprints: bool, bar: Any) -> None:
        self.moments, self.fingerprints, self.bar = moments, fingerprints, bar
        self.scratch = _Scratch() if moments else None
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-stats")
        self.pending: deque[tuple[Future, int]] = deque()
        self.pending_bytes = 0

    def __enter__(self) -> _Lane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.helper.shutdown(wait=True, cancel_futures=True)

    def row(self, reader: Reader, entry: Entry, lag: int) -> dict[str, Any]:
        """Stream one tensor. ``lag``: the bytes of handed-off blocks that may be unfinished
        when the next block is taken. 0 keeps the lane to one batch of records (the reader's
        buffers are free before it reads on); a batch's size lets the next batch be read while
        the helper hashes this one (within the tensor's own bytes). Every block is done with
        before the row returns."""
        acc = _Moments(self.scratch) if self.moments else None
        digest = _tensor_digest(entry) if self.fingerprints else None
        tasks = []
        if digest is not None:
            tasks.append(digest.update)
        if acc is not None:
            tasks.append(functools.partial(acc.add_bytes, dt=entry.dtype))
        # the first task (the heavier) goes to the helper, unless the tensor is small
        handed, *here = tasks if tasks and entry.nbytes >= self.INLINE else [None, *tasks]
        try:
            for block in tensor_blocks.blocks(reader, entry):
                if handed is not None:
                    self.pending.append((self.helper.submit(handed, block), len(block)))
                    self.pending_bytes += len(block)
                for task in here:
                    task(block)
                self.bar.update(len(block))
                del block  # so the next read does not overlap a spent record
                self._wait(lag)
        finally:  # the tensor's bytes are done with before the next tensor is read
            self._wait(0)
        return {
            "key": entry.key,
            "group": entry.group,
            "dtype": entry.dtype.name,
            "shape": entry.shape,
            "numel": entry.numel,
            **(
                acc.result(entry.numel)
                if acc is not None
                else dict.fromkeys(STAT_COLUMNS, math.nan)
            ),
            "fingerprint": digest.hexdigest() if digest is not None else None,
        }

    def _wait(self, lag: int) -> None:
        """Wait until at most ``lag`` bytes of handed-off blocks are unfinished (and raise what
        the helper raised)."""
        while self.pending and (self.pending_bytes > lag or self.pending[0][0].done()):
            future, size = self.pending.popleft()
            self.pending_bytes -= size
            future.result()


def _tensor_digest(entry: Entry):
    """A SHA-256 primed with the tensor's dtype and shape: equal bytes of another shape or
    dtype (a reshape, an int32 view of floats) do not share a fingerprint."""
    shape = ",".join(str(n) for n in entry.shape)
    return hashlib.sha256(TENSOR_DOMAIN + f"\0{entry.dtype.name}\0[{shape}]\0".encode())


class _Scratch:
    """Work arrays of one sub-block, allocated once per lane."""

    def __init__(self) -> None:
        self.values = np.empty(SUB_BLOCK, np.float64)
        self.mask = np.empty(SUB_BLOCK, np.bool_)


#: Element types whose min, max and zeros numpy finds fast and exactly in their own type.
_NATIVE = frozenset(
    np.dtype(t) for t in ("<f4", "<f8", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1")
)
#: Sums of squares are BLAS dot products of rows this long: OpenBLAS keeps a dot product of at
#: most 10000 elements on the calling thread (longer ones wake its threads, which crawl on a
#: busy machine), and one ``vecdot`` call does every row of a sub-block.
DOT_ROW = 8192


def _sum_squares(x: np.ndarray) -> float:
    """Σ x² of a contiguous float64 vector (each row's dot product accurate to its length ×
    float64 epsilon, rows summed pairwise)."""
    rows = x.size // DOT_ROW
    head = x[: rows * DOT_ROW].reshape(rows, DOT_ROW)
    tail = x[rows * DOT_ROW :]
    return float(np.add.reduce(np.vecdot(head, head))) + float(np.dot(tail, tail))


class _Moments:
    """Running float64 statistics over the finite elements, merged sub-block by sub-block
    (Chan et al.'s pairwise update). Inside a sub-block Σ(x − mean)² is Σx² − n·mean² when
    that cancels at most 16 bits (relative error ~1e-11: values spread around their mean),
    else an exact second pass (a large offset with a tiny spread)."""

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
        native = np.frombuffer(raw, np.dtype(dt.numpy)) if dt.numpy else None
        if native is not None and native.dtype in _NATIVE and self._add_native(native):
            return
        step = SUB_BLOCK * dt.itemsize
        for start in range(0, len(raw), step):
            piece = raw[start : start + step]
            values = native[start // dt.itemsize :][:SUB_BLOCK] if native is not None else None
            self._add(self._float64(piece, dt, values))

    def _float64(self, raw: memoryview, dt: DType, values: np.ndarray | None) -> np.ndarray:
        """The elements as a float64 array this accumulator may overwrite."""
        if values is None:  # bfloat16, fp8: decoded exactly
            return tensor_blocks.as_float(raw, dt)
        if values.dtype.kind == "c":  # magnitudes, computed in double precision
            return np.abs(values.astype(np.complex128))
        out = self.scratch.values[: values.size]
        np.copyto(out, values, casting="unsafe")
        return out

    def _add_native(self, values: np.ndarray) -> bool:
        """float32/64 and integers: min and max over the whole block in their own type (exact,
        and several times faster than in float64), zeros and sums sub-block by sub-block in
        float64. False (nothing added) when NaN or ±Inf is inside: the general path."""
        if not values.size:
            return True
        low, high = values.min(), values.max()
        if values.dtype.kind == "f" and not (math.isfinite(low) and math.isfinite(high)):
            return False
        self.low = min(self.low, float(low))
        self.high = max(self.high, float(high))
        x_all, mask_all = self.scratch.values, self.scratch.mask
        for start in range(0, values.size, SUB_BLOCK):
            piece = values[start : start + SUB_BLOCK]
            n = piece.size
            x = x_all[:n]
            np.copyto(x, piece, casting="unsafe")
            self.zeros += int(np.count_nonzero(np.equal(x, 0, out=mask_all[:n])))
            self._merge(x, float(np.add.reduce(x)))
        return True

    def _add(self, x: np.ndarray) -> None:
        n = x.size
        if not n:
            return
        zero = np.equal(x, 0, out=self.scratch.mask[:n]) if n <= SUB_BLOCK else np.equal(x, 0)
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
        self.low = min(self.low, float(x.min()))
        self.high = max(self.high, float(x.max()))
        self._merge(x, total)

    def _merge(self, x: np.ndarray, total: float) -> None:
        """Fold finite float64 values ``x`` (overwritten) with sum ``total`` in."""
        n = x.size
        mean = total / n
        squares = _sum_squares(x)
        m2 = squares - total * mean
        if m2 < squares * 2**-16:  # cancellation took more than 16 bits: two passes
            x -= mean
            m2 = _sum_squares(x)
        merged = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / merged
        self.mean += delta * n / merged
        self.sumsq += squares
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
