"""ckptkit: look at, compare and convert PyTorch checkpoints safely, in bounded memory, anywhere.

Inspection never imports torch and never runs pickle code from a checkpoint.
"""

from .checkpoint import Checkpoint, open
from .convert import UnshardResult, convert, unshard
from .errors import (
    CheckpointError,
    CorruptRecordError,
    FormatError,
    KeyNotFoundError,
    MissingFileError,
    UnsafePickleError,
)
from .formats import Detection
from .state_dict import LoadResult, from_checkpoint, load_state_dict

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptRecordError",
    "Detection",
    "FormatError",
    "KeyNotFoundError",
    "MissingFileError",
    "LoadResult",
    "UnsafePickleError",
    "UnshardResult",
    "convert",
    "from_checkpoint",
    "load_state_dict",
    "open",
    "unshard",
]
