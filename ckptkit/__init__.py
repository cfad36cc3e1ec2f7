"""ckptkit: look at, compare and convert PyTorch checkpoints safely, in bounded memory, anywhere.

Inspection never imports torch and never runs pickle code from a checkpoint.
"""

from .checkpoint import Checkpoint, open
from .errors import (
    CheckpointError,
    CorruptRecordError,
    FormatError,
    KeyNotFoundError,
    MissingFileError,
    UnsafePickleError,
)
from .formats import Detection

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptRecordError",
    "Detection",
    "FormatError",
    "KeyNotFoundError",
    "MissingFileError",
    "UnsafePickleError",
    "open",
]
