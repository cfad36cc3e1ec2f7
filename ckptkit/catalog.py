"""The format-free description of a checkpoint: entries → chunks → byte records.

Format adapters (``ckptkit.formats``) produce a :class:`Catalog`; every operation (tables,
reading, unsharding, diffing) consumes one and never needs to know the on-disk format.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from .dtypes import DType


class Encoding(StrEnum):
    """How a record's bytes hold its value."""

    TORCH_SAVE = "torch_save"  # one complete torch.save zip archive (DCP .distcp items)
    SAFETENSORS = "safetensors"  # a tensor named ``Record.name`` inside a safetensors blob
    RAW = "raw"  # the element bytes themselves, little-endian (``stride`` None = row-major)
    # a torch.save zip's whole data.pkl; the value is the leaf at ``Record.name``, a JSON list
    # path into the unpickled structure such as '["param_groups", 0, "lr"]'
    PICKLE_LEAF = "pickle_leaf"
    # the record's bytes are one bare pickle (e.g. held in a uint8 tensor), decoded with the object
    # allowlist; the value is the leaf at ``Record.name`` (a JSON list path, None = all of it)
    PICKLE_BYTES = "pickle_bytes"


# Record and Chunk are plain (unfrozen) slotted classes so that an adapter may build them straight
# out of a pickle (DCP metadata has ~500k of each at scale); treat them as read-only.


@dataclass(slots=True)
class Record:
    """Where a chunk's bytes are: ``length`` bytes at ``offset`` in ``file`` (relative path)."""

    file: str
    offset: int
    length: int
    encoding: Encoding = Encoding.TORCH_SAVE
    transform: str | None = None  # a byte transform to undo first, e.g. "zstd"
    name: str | None = None  # SAFETENSORS: the tensor's name in the blob header
    stride: tuple[int, ...] | None = None  # RAW: element strides, None = row-major
    storage_offset: int = 0  # RAW: elements to skip before the first one
    crc32: int | None = None  # CRC-32 of exactly these bytes when the format stores one


def pickle_leaf(
    file: str,
    offset: int,
    length: int,
    path: Sequence[str | int],
    *,
    encoding: Encoding = Encoding.PICKLE_LEAF,
    crc32: int | None = None,
) -> Record:
    """A record for the value at ``path`` inside the pickle these bytes hold (``PICKLE_LEAF``:
    a torch.save ``data.pkl``; ``PICKLE_BYTES``: a bare pickle)."""
    return Record(file, offset, length, encoding, name=json.dumps(list(path)), crc32=crc32)


def leaf_path(record: Record) -> list[str | int]:
    """The path inside the pickle that :func:`pickle_leaf` stored (empty: the whole value)."""
    return json.loads(record.name) if record.name is not None else []


def shared(record: Record) -> bool:
    """True when the record is a whole pickle that other entries' leaves come from too."""
    return record.encoding is Encoding.PICKLE_LEAF or (
        record.encoding is Encoding.PICKLE_BYTES and record.name is not None
    )


@dataclass(slots=True)
class Chunk:
    """A box of a tensor: ``sizes`` elements starting at global ``offsets``.

    With ``flat`` the box is a range of the tensor flattened to 1-D (flat-parameter shards).
    ``record`` is None for a chunk that holds no elements.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    record: Record | None
    rank: int | None = None
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Entry:
    """One leaf of the state dict: a tensor (with chunks) or a non-tensor object (one record)."""

    key: str  # dotted, as torch's flattening spells it
    path: tuple[str | int, ...]  # the nesting to rebuild: ("optim", "param_groups", 0, "lr")
    kind: Literal["tensor", "object"]
    chunks: tuple[Chunk, ...]
    dtype: DType | None = None
    shape: tuple[int, ...] | None = None

    @property
    def group(self) -> str:
        """The top-level key (``model``, ``optim``, ``train``…)."""
        return str(self.path[0]) if self.path else self.key.split(".", 1)[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def n_chunks(self) -> int:
        """Distinct boxes the tensor is stored in (a box saved by several ranks counts once)."""
        return len({(c.offsets, c.flat) for c in self.chunks})

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor's elements; for objects, the bytes of their own records
        (0 for a leaf inside a shared pickle, whose share of it is unknown)."""
        if self.kind == "tensor" and self.dtype is not None:
            return self.numel * self.dtype.itemsize
        return sum(
            c.record.length for c in self.chunks if c.record is not None and not shared(c.record)
        )


@dataclass
class Catalog:
    """Everything known about a checkpoint without reading tensor bytes."""

    format: str
    entries: dict[str, Entry]
    files: list[str]  # data files the records point into, relative to the checkpoint root
    info: dict[str, Any] = field(default_factory=dict)  # format-specific facts (version, ids…)
    #: The allowlist PICKLE_LEAF pickles are decoded with (None: ``unpickler.OBJECT_GLOBALS``);
    #: set by formats whose torch.save pickles name more classes (ShardedTensor rank files).
    object_globals: Mapping[str, Any] | None = field(default=None, repr=False)

    def tensors(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.kind == "tensor"]

    def objects(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.kind == "object"]

    def select(
        self, keys: Sequence[str] | str | None = None, groups: Sequence[str] | str | None = None
    ) -> list[Entry]:
        """Entries whose dotted key matches any glob in ``keys`` and whose group is in ``groups``.

        ``None`` selects everything; ``keys=["model.blocks.0.*", "optim.state.*.exp_avg"]``.
        """
        keys = [keys] if isinstance(keys, str) else keys
        groups = (
            {groups} if isinstance(groups, str) else set(groups) if groups is not None else None
        )
        return [
            e
            for e in self.entries.values()
            if (groups is None or e.group in groups)
            and (keys is None or any(fnmatch.fnmatchcase(e.key, pattern) for pattern in keys))
        ]
