"""A training run's folder of step checkpoints: find them, audit them over steps, compare two.

:func:`run` lists the sub-directories of a run folder that hold a checkpoint of any format
ckptkit reads (OLMo ``stepN``, OLMo-core, DeepSpeed ``global_stepN``, Megatron
``iter_NNNNNNN``, HF Trainer ``checkpoint-N``, plain DCP step folders) and orders them by the
step number in their names. :meth:`Run.stats` gives the per-tensor statistics of every step as
one long table, computed once per checkpoint: rows are cached in a local parquet file keyed by
each checkpoint's *identity* (its files' names, sizes and modification times or ETags), so
re-running a notebook after new steps land reads only the new steps' tensors.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import formats
from .checkpoint import Checkpoint
from .checkpoint import open as open_checkpoint
from .errors import (
    CheckpointError,
    FormatError,
    KeyNotFoundError,
    MissingFileError,
    UnsafePathError,
    UsageError,
)
from .extras import require
from .formats.pointers import MAX_STEP_DIRS, checkpoints_below
from .ops.diff import diff
from .ops.stats import COLUMNS, STAT_COLUMNS, select_tensors, tensor_rows
from .storage import Storage
from .storage.private_files import read_private_file, write_private_file

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "STEP_PATTERNS",
    "RUN_COLUMNS",
    "CACHE_ENV",
    "IDENTITY_DEPTH",
    "step_number",
    "StepCheckpoint",
    "run",
    "Run",
]

#: Step numbers in checkpoint directory names, tried in order; then the last number in the name.
STEP_PATTERNS = (
    re.compile(r"global_step(\d+)"),  # DeepSpeed
    re.compile(r"iter_(\d+)"),  # Megatron
    re.compile(r"checkpoint-(\d+)"),  # HF Trainer
    re.compile(r"step[_=-]?(\d+)", re.IGNORECASE),  # OLMo, OLMo-core, Lightning, plain DCP
    re.compile(r"(\d+)(?!.*\d)"),
)
#: Columns of :meth:`Run.stats`: the step and its checkpoint directory, then :data:`COLUMNS`.
RUN_COLUMNS = ["step", "checkpoint", *COLUMNS]
#: Where the statistics cache goes unless ``cache=`` names a file (else the user's cache dir).
CACHE_ENV = "CKPTKIT_CACHE"
#: Directory levels below a step directory whose files make its identity (OLMo-core nests
#: ``model_and_optim/``, OLMo ``train/``).
IDENTITY_DEPTH = 3
_CACHE_KEY = ["checkpoint", "identity", "selection"]


def step_number(name: str) -> int | None:
    """The step a checkpoint directory's name stands for (``global_step120`` → 120,
    ``iter_0000300`` → 300, ``step1000-unsharded`` → 1000); None without digits."""
    for pattern in STEP_PATTERNS:
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    return None


@dataclass(frozen=True)
class StepCheckpoint:
    """One checkpoint of a run: its step, its directory name in the run folder, its format."""

    step: int
    name: str
    format: str


def run(path_or_url: str | os.PathLike, *, storage_options: dict | None = None) -> Run:
    """The step checkpoints below ``path_or_url`` (a directory or fsspec URL), sorted by step
    (then name: OLMo's ``step1000`` before ``step1000-unsharded``). Only sub-directories whose
    names hold a number are looked at; each is recognised by format detection (a few small
    reads), so a folder being written or of another kind is left out; one that looks like a
    damaged checkpoint stays, with format ``"?"`` (:meth:`Run.stats` then reports it).

    Args:
        path_or_url: the run folder: a local path (str or ``os.PathLike``) or fsspec URL.
        storage_options: fsspec options for ``path_or_url`` (when a URL).

    Returns:
        A :class:`Run` listing its step checkpoints (:class:`StepCheckpoint`: step, directory
        name, format); a folder holding none raises :class:`~ckptkit.errors.FormatError`.

    Example:
        >>> steps = ckptkit.run("s3://bucket/olmo-run/")
        >>> steps.steps[:3]
        [1000, 2000, 3000]
        >>> frame = steps.stats(groups="model")
    """
    storage = Storage(str(path_or_url), storage_options)
    try:
        listing = storage.listdir()
    except MissingFileError:
        raise MissingFileError(f"{storage.describe()}: no such directory") from None
    candidates = [
        name
        for name, size in listing.items()
        if size < 0 and step_number(name) is not None and _safe_name(storage, name)
    ]
    detections: dict[str, str] = {}

    def detect(child: Storage):
        found = formats.first_detection(child)
        if found is not None:
            detections[child.url] = found.format
        return found

    names: list[str] = []
    for start in range(0, len(candidates), MAX_STEP_DIRS):
        part = {name: -1 for name in candidates[start : start + MAX_STEP_DIRS]}
        names += checkpoints_below(storage, part, detect)
    steps = [
        StepCheckpoint(step_number(name), name, detections.get(storage.child(name).url, "?"))
        for name in names
    ]
    if not steps:
        raise FormatError(
            f"{storage.describe()}: no step checkpoints below it (looked for sub-directories "
            "named like step100, global_step100, iter_0000100, checkpoint-100 that hold a "
            "checkpoint); for a single checkpoint use ckptkit.open / ckptkit.stats"
        )
    return Run(storage, sorted(steps, key=lambda s: (s.step, s.name)))


def _safe_name(storage: Storage, name: str) -> bool:
    """Whether a listed name may be used as a directory inside the run (names come from the
    store: one holding control characters or ``..`` is skipped, never followed)."""
    try:
        storage.child(name)
    except UnsafePathError:
        return False
    return True


class Run:
    """The checkpoints of one training run, by step (see :func:`run`)."""

    def __init__(self, storage: Storage, checkpoints: list[StepCheckpoint]) -> None:
        self.storage = storage
        self.checkpoints = checkpoints

    def __repr__(self) -> str:
        shown = ", ".join(str(s) for s in self.steps[:8]) + (" …" if len(self) > 8 else "")
        return f"Run({self.url!r}, {len(self)} checkpoints, steps {shown})"

    def __len__(self) -> int:
        return len(self.checkpoints)

    def __iter__(self) -> Iterator[StepCheckpoint]:
        return iter(self.checkpoints)

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def steps(self) -> list[int]:
        """The step numbers, ascending (a step saved twice appears twice)."""
        return [c.step for c in self.checkpoints]

    @property
    def table(self) -> pd.DataFrame:
        """One row per checkpoint: step, directory name, format, location."""
        import pandas as pd

        return pd.DataFrame(
            [(c.step, c.name, c.format, self.location(c.step)) for c in self.checkpoints],
            columns=["step", "checkpoint", "format", "url"],
        )

    def checkpoint(self, step: int | str) -> StepCheckpoint:
        """The checkpoint of ``step`` (a step number, the first one saved for it; or a
        directory name such as ``"step1000-unsharded"``)."""
        for c in self.checkpoints:
            if c.name == step or (not isinstance(step, str) and c.step == step):
                return c
        raise KeyNotFoundError(f"{self.url}: no checkpoint for step {step!r}; steps: {self.steps}")

    def location(self, step: int | str) -> str:
        """The path or URL of ``step``'s checkpoint."""
        return self.storage.describe(self.checkpoint(step).name)

    def open(self, step: int | str, **kwargs: Any) -> Checkpoint:
        """``ckptkit.open`` of ``step``'s checkpoint (keyword arguments go to it)."""
        kwargs.setdefault("storage_options", self.storage.storage_options)
        return open_checkpoint(self.location(step), **kwargs)

    def diff(self, step_a: int | str, step_b: int | str, **kwargs: Any) -> pd.DataFrame:
        """``ckptkit.diff`` between two steps' checkpoints (keyword arguments go to it);
        ``rel_l2`` is then the update ratio ‖Δw‖/‖w‖ of each tensor."""
        kwargs.setdefault("storage_options", self.storage.storage_options)
        return diff(self.location(step_a), self.location(step_b), **kwargs)

    def stats(
        self,
        keys: Sequence[str] | str | None = None,
        groups: Sequence[str] | str | None = None,
        *,
        steps: Sequence[int | str] | None = None,
        cache: bool | str | os.PathLike = True,
        progress: bool = False,
    ) -> pd.DataFrame:
        """:func:`ckptkit.stats` of every step (or of ``steps``) as one long table: a row per
        (step, tensor), columns :data:`RUN_COLUMNS`, sorted by step.

        Statistics are cached per checkpoint identity (its files' names, sizes, modification
        times / ETags) and selection in a parquet file: ``cache=True`` keeps it under
        ``$CKPTKIT_CACHE`` (default ``~/.cache/ckptkit``) named after the run's URL, a path
        names the file, False turns caching off. A checkpoint whose files changed is read
        again; a cache file that cannot be trusted (damaged, of the wrong column types, a link,
        another user's) is ignored with a warning and recomputed. A step that cannot be read is
        left out with a warning (and not cached), so a checkpoint still being written does not
        stop the audit; ``frame.attrs`` lists the steps ``read``, those taken from the
        ``cached`` file, and those ``failed``. A group or glob that matches nothing in any step
        raises :class:`~ckptkit.errors.KeyNotFoundError` with a suggestion.
        """
        import pandas as pd

        chosen = self.checkpoints if steps is None else [self.checkpoint(s) for s in steps]
        selection = _selection(keys, groups)
        cache_file = self._cache_file(cache)
        cached = _load_cache(cache_file)
        frames, read, reused, failed = [], [], [], {}
        unmatched: dict[str, KeyNotFoundError] = {}  # steps the selection found nothing in
        for c in chosen:
            identity = self._identity(c)
            rows = _cached_rows(cached, identity, selection)
            if rows is not None:
                reused.append(c.name)
            else:
                try:
                    rows = self._compute(c, keys, groups, progress)
                except KeyNotFoundError as exc:
                    unmatched[c.name] = exc
                    failed[c.name] = str(exc)
                    continue
                except CheckpointError as exc:
                    warnings.warn(f"{self.location(c.name)}: left out: {exc}", stacklevel=2)
                    failed[c.name] = str(exc)
                    continue
                read.append(c.name)
                if identity is not None:
                    cached = _store(
                        cached,
                        rows.assign(checkpoint=c.name, identity=identity, selection=selection),
                    )
            frames.append(rows.assign(step=c.step, checkpoint=c.name))
        if unmatched and not frames:  # a mistyped group or glob, not an empty run
            raise next(iter(unmatched.values()))
        for name, exc in unmatched.items():  # a group some steps lack
            warnings.warn(f"{self.location(name)}: left out: {exc}", stacklevel=2)
        if cache_file is not None and read:
            _save_cache(cached, cache_file)
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        frame = frame.reindex(columns=RUN_COLUMNS)
        frame.attrs.update(url=self.url, read=read, cached=reused, failed=failed)
        return frame

    def _compute(
        self,
        c: StepCheckpoint,
        keys: Sequence[str] | str | None,
        groups: Sequence[str] | str | None,
        progress: bool,
    ) -> pd.DataFrame:
        import pandas as pd

        source = self.open(c.name)
        entries = select_tensors(source, keys, groups)
        rows = tensor_rows(source, entries, progress=progress)
        return pd.DataFrame(rows, columns=COLUMNS)

    def _identity(self, c: StepCheckpoint) -> str | None:
        """A digest of the checkpoint's location, format and files (relative name, size,
        ETag / modification time), from listings alone; None when the store cannot list."""
        fs = self.storage.fs
        root = self.storage.path(c.name).rstrip("/")
        try:
            found = fs.find(root, maxdepth=IDENTITY_DEPTH, detail=True)
        except (OSError, NotImplementedError, ValueError):
            return None
        files = sorted(
            (path[len(root) :], int(info.get("size") or 0), _version(info))
            for path, info in found.items()
            if info.get("type") != "directory"
        )
        if not files:
            return None
        text = json.dumps([self.location(c.name), c.format, files], default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _cache_file(self, cache: bool | str | os.PathLike) -> Path | None:
        if cache is False or cache is None:
            return None
        if cache is True:
            base = os.environ.get(CACHE_ENV) or os.path.join(
                os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "ckptkit"
            )
            name = hashlib.sha256(self.url.rstrip("/").encode()).hexdigest()[:16]
            return Path(base) / f"run-stats-{name}.parquet"
        if isinstance(cache, str | os.PathLike):
            return Path(cache)
        raise UsageError(f"cache must be True, False or a file path, not {cache!r}")


def _version(info: dict[str, Any]) -> str:
    """What changes when a file is rewritten: its ETag / generation, else its mtime."""
    for field in ("ETag", "etag", "md5Hash", "generation", "version_id", "mtime", "LastModified"):
        value = info.get(field)
        if value is not None:
            return f"{field}={value}"
    return ""


def _selection(keys: Sequence[str] | str | None, groups: Sequence[str] | str | None) -> str:
    """The selection as a cache key: the same globs and groups in any order give one key."""

    def normal(value):
        return None if value is None else sorted([value] if isinstance(value, str) else value)

    return json.dumps({"keys": normal(keys), "groups": normal(groups)})


# -- the cache file ---------------------------------------------------------------------------


def _load_cache(path: Path | None) -> pd.DataFrame | None:
    """The cached rows, or None when there is no cache file or it cannot be trusted: a file
    that is damaged, lacks a column or holds a value of the wrong type (checked column by
    column), or is a link, not a regular file or another user's, is ignored with a warning
    and its rows are recomputed."""
    if path is None:
        return None
    require("pyarrow", "Run.stats()'s statistics cache (cache=False needs none)")
    import pandas as pd

    try:
        data = read_private_file(path)
        if data is None:
            return None
        frame = pd.read_parquet(io.BytesIO(data))
        problem = _cache_problem(frame)
    except Exception as exc:  # pyarrow raises its own types for a damaged file
        problem = str(exc)
    if problem is not None:
        warnings.warn(f"{path}: unreadable statistics cache, ignored ({problem})", stacklevel=3)
        return None
    frame["shape"] = [tuple(int(n) for n in shape) for shape in frame["shape"]]
    return frame


#: The cache's columns by the kind of value each holds (``shape``: a list of sizes).
_TEXT_COLUMNS = ("key", "group", "dtype", *_CACHE_KEY)
_OPTIONAL_TEXT_COLUMNS = ("fingerprint",)
_INTEGER_COLUMNS = ("numel",)
_NUMBER_COLUMNS = tuple(STAT_COLUMNS)


def _cache_problem(frame: pd.DataFrame) -> str | None:
    """What is wrong with a cache file's table (a missing column, a column of the wrong type),
    or None: rows are compared and returned as they are, so every value is checked first."""
    import pandas as pd

    missing = [name for name in [*COLUMNS, *_CACHE_KEY] if name not in frame.columns]
    if missing:
        return f"missing columns {missing}"
    for name in _TEXT_COLUMNS:
        if not all(isinstance(value, str) for value in frame[name]):
            return f"column {name!r} is not text"
    for name in _OPTIONAL_TEXT_COLUMNS:
        if not all(isinstance(value, str) or pd.isna(value) for value in frame[name]):
            return f"column {name!r} is not text"
    for name in _INTEGER_COLUMNS:
        if frame[name].dtype.kind not in "iu":
            return f"column {name!r} is {frame[name].dtype}, not integers"
    for name in _NUMBER_COLUMNS:
        if frame[name].dtype.kind not in "fiu":
            return f"column {name!r} is {frame[name].dtype}, not numbers"
    if not all(_is_shape(value) for value in frame["shape"]):
        return "column 'shape' does not hold lists of sizes"
    return None


def _is_shape(value: Any) -> bool:
    """Whether ``value`` (as parquet gives a list column back) is a tensor shape."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iu" and bool((value >= 0).all())
    return isinstance(value, list | tuple) and all(
        isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0 for n in value
    )


def _cached_rows(
    cached: pd.DataFrame | None, identity: str | None, selection: str
) -> pd.DataFrame | None:
    if cached is None or identity is None:
        return None
    hit = cached[(cached["identity"] == identity) & (cached["selection"] == selection)]
    if hit.empty:
        return None
    return hit[COLUMNS].reset_index(drop=True)


def _store(cached: pd.DataFrame | None, rows: pd.DataFrame) -> pd.DataFrame:
    """``cached`` with ``rows`` (of one checkpoint) added, replacing what it held for the same
    identity and selection, and dropping rows of that checkpoint's earlier identities (its
    files changed since: those rows can never match again)."""
    import pandas as pd

    if cached is None or cached.empty or rows.empty:
        return rows.reset_index(drop=True) if cached is None or cached.empty else cached
    first = rows.iloc[0]
    same = (cached["identity"] == first["identity"]) & (cached["selection"] == first["selection"])
    stale = (cached["checkpoint"] == first["checkpoint"]) & (
        cached["identity"] != first["identity"]
    )
    return pd.concat([cached[~(same | stale)], rows], ignore_index=True)


def _save_cache(cached: pd.DataFrame | None, path: Path) -> None:
    """Write the cache all at once (:func:`~ckptkit.storage.private_files.write_private_file`:
    a new file of a random name beside it, then renamed over it); a cache that cannot be
    written is a warning (the statistics are computed already)."""
    if cached is None:
        return
    out = cached.copy()
    out["shape"] = [list(shape) for shape in out["shape"]]
    buffer = io.BytesIO()
    out.to_parquet(buffer, index=False)
    try:
        write_private_file(path, buffer.getvalue())
    except OSError as exc:
        warnings.warn(f"{path}: statistics cache not saved ({exc})", stacklevel=3)
