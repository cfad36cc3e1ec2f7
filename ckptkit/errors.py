"""The exceptions ckptkit raises: one hierarchy under :class:`CheckpointError`.

Every message names what it is about (a file, a key, a pickle global) so a user can act on it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "FormatError",
    "MissingFileError",
    "NotACheckpointError",
    "UnsupportedLayoutError",
    "LocationNotFoundError",
    "CorruptRecordError",
    "UnsafePickleError",
    "KeyNotFoundError",
    "AccessDeniedError",
    "StorageError",
    "TruncatedFileError",
    "ChecksumError",
    "MismatchError",
    "CoverageError",
    "TensorsLeftAsObjectsError",
    "LimitExceededError",
    "PickleLimitError",
    "UnsafePathError",
    "OutputNameError",
    "OutputExistsError",
    "DestinationError",
    "UsageError",
    "DistributedError",
    "MissingCredentialsError",
    "UnreachableStoreError",
    "MissingExtraError",
]


class CheckpointError(Exception):
    """Base class of every error ckptkit raises (a plain ``Exception``, unlike torch's)."""


class FormatError(CheckpointError):
    """The path is not a checkpoint ckptkit recognises, or its structure is inconsistent."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs does not exist (or cannot be reached)."""


class NotACheckpointError(FormatError):
    """Nothing ckptkit recognises is at the location: it does not exist, holds no checkpoint,
    or is a file *of* one or a folder of several (the message names what to open). A usage
    problem, told apart from a damaged checkpoint (``verify`` raises it instead of reporting)."""


class UnsupportedLayoutError(FormatError):
    """The checkpoint is one ckptkit recognises, in a layout it does not read (the message names
    it: e.g. DeepSpeed pipeline + tensor parallelism, MoE expert files, NVMe offload). Not
    damage: ``verify`` raises it instead of reporting a problem (CLI exit status 2)."""


class LocationNotFoundError(NotACheckpointError, MissingFileError):
    """The location itself does not exist (a mistyped path)."""


class CorruptRecordError(CheckpointError):
    """A byte record cannot be decoded: truncated, wrong framing, or disagreeing with metadata."""


class UnsafePickleError(CheckpointError):
    """A pickle references a global outside the allowlist; nothing from it was imported or run."""

    def __init__(self, message: str, *, global_name: str | None = None) -> None:
        super().__init__(message)
        self.global_name = global_name


class KeyNotFoundError(CheckpointError, KeyError):
    """The checkpoint has no entry with that key."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class AccessDeniedError(CheckpointError, PermissionError):
    """The store refused access to a file (HTTP 401/403, or local permissions)."""


class StorageError(CheckpointError, OSError):
    """Reading or writing a file failed for another reason, e.g. a store still failing after
    retries (5xx, throttling, dropped connections)."""


class TruncatedFileError(CorruptRecordError):
    """A file ends before a record it should hold (an interrupted save or download)."""


class ChecksumError(CorruptRecordError):
    """A record's bytes do not match the CRC-32 stored with them (bit rot, a bad copy)."""


class MismatchError(CorruptRecordError):
    """A record describes a different tensor than the metadata says (dtype, shape, size)."""


class CoverageError(FormatError):
    """A tensor's chunks overlap or leave holes, or a set of rank files is incomplete."""


class TensorsLeftAsObjectsError(FormatError):
    """Tensors ckptkit could only keep as objects (DTensors, ShardedTensors or tensor subclasses
    outside a set of rank files it reads): writing without them would be a silently partial
    output. ``keys`` names them."""

    def __init__(self, message: str, *, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


class LimitExceededError(CheckpointError):
    """A number read from a checkpoint (a count, rank, length, size, nesting depth, decompressed
    size…) is beyond what the files on hand can hold or a documented limit allows: refused before
    anything was allocated or looped over. The limits live in :mod:`ckptkit.limits` and
    :mod:`ckptkit.pickle_limits`."""


class PickleLimitError(LimitExceededError, UnsafePickleError):
    """A pickle exceeds a resource limit (size, memo, nesting, container size): refused before
    it could allocate or recurse. The limits are in :mod:`ckptkit.pickle_limits`."""


class UnsafePathError(FormatError):
    """A file a checkpoint refers to lies outside the checkpoint (an absolute path, ``..``,
    another bucket, a symlink leaving the folder) or is not a regular file (FIFO, device)."""


class OutputNameError(FormatError):
    """A name from the checkpoint cannot become an output name, or two entries would be written
    under the same name (after encoding, as safetensors keys, or a tensor and a sub-tree)."""


class OutputExistsError(CheckpointError, FileExistsError):
    """An output file already exists and ``overwrite`` was not given."""


class DestinationError(StorageError):
    """Writing the output failed: the disk is full, the destination is read-only, a name is too
    long for the file system, or another write error (nothing was left under a final name)."""


class UsageError(CheckpointError, ValueError):
    """The call's arguments are wrong (an unknown target, size, dtype or option value)."""


class DistributedError(CheckpointError):
    """A job spread over torch.distributed ranks failed: a rank raised (its rank, error type and
    message are named, on every rank) or a rank was lost (died, or missed the timeout).

    ``failures``: the failing ranks' ``(rank, error type, message)`` when the ranks agreed on
    them (every rank raised this same error); ``None`` when a rank was lost."""

    failures: list[tuple[int, str, str]] | None = None


class UnreachableStoreError(StorageError, NotACheckpointError):
    """The store behind a URL cannot be reached: its host is unknown, refuses connections or
    does not answer. A usage problem (a wrong URL or endpoint), so it is also a
    :class:`NotACheckpointError`: ``verify`` raises it instead of reporting damage."""


class MissingCredentialsError(AccessDeniedError, NotACheckpointError):
    """The store client found no usable credentials (none set, an unknown profile): nothing was
    asked of the store. Also a :class:`NotACheckpointError`, as :class:`UnreachableStoreError`."""


class MissingExtraError(CheckpointError, ImportError):
    """The call needs a package an extra of the distribution brings (torch, s3fs, matplotlib…)
    and it is not installed; the message names the ``pip install 'torch-ckptkit[EXTRA]'`` line.
    Also an ``ImportError``, as the failed import it stands for."""

    def __init__(self, message: str, *, extra: str = "all", module: str | None = None) -> None:
        super().__init__(message, name=module)
        self.extra = extra
