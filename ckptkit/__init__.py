"""ckptkit: look at, compare and convert PyTorch checkpoints safely, in bounded memory, anywhere.

Inspection never imports torch and never runs pickle code from a checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .checkpoint import Checkpoint, detect, open
from .errors import (
    AccessDeniedError,
    CheckpointError,
    ChecksumError,
    CorruptRecordError,
    CoverageError,
    DestinationError,
    DistributedError,
    FormatError,
    KeyNotFoundError,
    LimitExceededError,
    LocationNotFoundError,
    MismatchError,
    MissingCredentialsError,
    MissingExtraError,
    MissingFileError,
    NotACheckpointError,
    OutputExistsError,
    OutputNameError,
    PickleLimitError,
    StorageError,
    TensorsLeftAsObjectsError,
    TruncatedFileError,
    UnreachableStoreError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedLayoutError,
    UsageError,
)
from .formats import Detection
from .ops.convert import UnshardResult, convert, unshard
from .ops.diff import diff
from .ops.lora import MergeResult, UnsupportedAdapterError, merge_lora
from .ops.sizes import compare_sizes
from .ops.state_dict import LoadResult, from_checkpoint, load_state_dict
from .ops.stats import fingerprint, stats
from .ops.verify import verify
from .runs import Run, run
from .views.reports import diff_text, inspect_text, sizes_text

if TYPE_CHECKING:
    from .views import browser


def browse(
    source: str | Checkpoint,
    *,
    compare_to: str | Checkpoint | None = None,
    storage_options: dict | None = None,
) -> browser.Browser:
    """An ipywidgets browser over ``source``'s tensors (see :mod:`ckptkit.views.browser`).

    Imported on first use, so ``import ckptkit`` needs no ipywidgets. (The module is not named
    ``browse``: importing it would rebind ``ckptkit.browse`` from this function to the module.)

    Args:
        source: the checkpoint: a path or fsspec URL, or an opened :class:`Checkpoint`.
        compare_to: another checkpoint (same forms) the selected tensor is diffed against;
            None (default) shows no diff.
        storage_options: fsspec options for ``source`` and ``compare_to`` (when URLs).

    Returns:
        A :class:`ckptkit.views.browser.Browser` widget (display it in a notebook cell).

    Example:
        >>> ckptkit.browse("ckpt/step_1000", compare_to="ckpt/step_2000")
    """
    from .extras import require

    for package in ("ipywidgets", "matplotlib"):
        require(package, "ckptkit.browse()")
    from .views.browser import browse as _browse

    return _browse(source, compare_to=compare_to, storage_options=storage_options)


#: The one place the version is written: the build backend reads it from here (pyproject.toml).
__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "Checkpoint",
    "CheckpointError",
    "ChecksumError",
    "CorruptRecordError",
    "CoverageError",
    "DestinationError",
    "DistributedError",
    "LimitExceededError",
    "MismatchError",
    "MissingCredentialsError",
    "MissingExtraError",
    "UnreachableStoreError",
    "OutputExistsError",
    "OutputNameError",
    "PickleLimitError",
    "TruncatedFileError",
    "Detection",
    "FormatError",
    "KeyNotFoundError",
    "MissingFileError",
    "NotACheckpointError",
    "LocationNotFoundError",
    "StorageError",
    "TensorsLeftAsObjectsError",
    "LoadResult",
    "UnsafePathError",
    "UnsafePickleError",
    "UnsupportedAdapterError",
    "UnsupportedLayoutError",
    "UsageError",
    "UnshardResult",
    "MergeResult",
    "Run",
    "browse",
    "compare_sizes",
    "convert",
    "detect",
    "diff",
    "diff_text",
    "from_checkpoint",
    "inspect_text",
    "fingerprint",
    "load_state_dict",
    "merge_lora",
    "open",
    "run",
    "sizes_text",
    "stats",
    "unshard",
    "verify",
]
