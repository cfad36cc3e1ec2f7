"""Where a checkpoint's bytes on disk go: the one count of files and bytes every report shows.

Bytes are counted per *stored record* (a storage, a byte range in a file), each once however
many entries view it: storages shared by tensor views, tied weights, DeepSpeed's fp32 groups
seen through per-parameter entries, replicated chunks. A record lying inside another one's
range (a view of part of a storage) adds nothing; the alternate groups of
:attr:`Facts.alternate_groups` (Megatron's ``stacked.*``) are views of bytes other groups hold:
named (``alternate_bytes``), never added, save for a record no other group's records reach (a
stacked tensor whose per-layer views could not be made). So ``tensor_bytes + object_bytes <=
data_bytes`` and ``overhead_bytes >= 0`` hold by construction, and :class:`ByteAccount` checks
it.

Pure Python over the catalog and a mapping of file sizes: neither pandas nor torch.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import Catalog, Encoding, Entry

__all__ = ["FileBytes", "GroupBytes", "ByteAccount", "counted_files", "account_bytes"]


@dataclass(frozen=True)
class FileBytes:
    """One data file's distinct stored records and the tensor / object bytes they hold."""

    records: int = 0
    tensor_bytes: int = 0
    object_bytes: int = 0


@dataclass(frozen=True)
class GroupBytes:
    """The stored bytes a top-level group owns: records it is the first entry to view."""

    tensor_bytes: int = 0
    object_bytes: int = 0


@dataclass(frozen=True)
class ByteAccount:
    """Files and bytes of one checkpoint, as ``inspect`` (text and JSON), ``summary()``, the
    reprs and ``compare_sizes`` all report them.

    ``files`` are the data files the records point into, then the metadata files the catalog
    read (``.metadata``, an index, ``latest``); ``size`` is the bytes on disk of all of them.
    ``tensor_bytes`` / ``object_bytes`` are the bytes of distinct stored records; the rest of
    the data files is ``overhead_bytes`` (zip and pickle framing, headers).
    """

    data_files: tuple[str, ...]
    metadata_files: tuple[str, ...]
    #: size on disk of every counted file (None: missing)
    sizes: Mapping[str, int | None]
    per_file: Mapping[str, FileBytes]
    #: by the group of the first entry viewing each record
    by_group: Mapping[str, GroupBytes]
    #: tensor bytes by the dtype of the first entry viewing each record
    by_dtype: Mapping[str, int]
    #: stored bytes by (every group viewing the record, ``"tensor"`` / ``"object"``): what a
    #: split into categories needs (a record shared by groups of two categories)
    shares: Mapping[tuple[frozenset[str], str], int]
    #: groups whose entries re-expose bytes other groups hold (not added)
    alternate_groups: tuple[str, ...] = ()
    #: the tensor bytes the alternate groups' entries view that other groups' records hold
    #: (counted there, not again)
    alternate_bytes: int = 0
    tensor_bytes: int = field(init=False)
    object_bytes: int = field(init=False)
    records: int = field(init=False)

    def __post_init__(self) -> None:
        values = self.per_file.values()
        object.__setattr__(self, "tensor_bytes", sum(f.tensor_bytes for f in values))
        object.__setattr__(self, "object_bytes", sum(f.object_bytes for f in values))
        object.__setattr__(self, "records", sum(f.records for f in values))
        _check_invariants(self)

    @property
    def files(self) -> tuple[str, ...]:
        """Every file counted: data files, then metadata files."""
        return (*self.data_files, *self.metadata_files)

    @property
    def data_bytes(self) -> int:
        return sum(self.sizes.get(name) or 0 for name in self.data_files)

    @property
    def metadata_bytes(self) -> int:
        return sum(self.sizes.get(name) or 0 for name in self.metadata_files)

    @property
    def size(self) -> int:
        """Bytes on disk of every counted file (missing ones count 0)."""
        return self.data_bytes + self.metadata_bytes

    @property
    def overhead_bytes(self) -> int:
        """Bytes of the data files that are neither tensor nor object records: framing."""
        return self.data_bytes - self.tensor_bytes - self.object_bytes

    @property
    def missing(self) -> list[str]:
        """Counted files that are not there."""
        return [name for name in self.files if self.sizes.get(name) is None]


def counted_files(catalog: Catalog) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(data files, metadata files)`` a checkpoint consists of: the files its records point
    into, and the files that only describe it (those not also data files)."""
    data = tuple(catalog.files)
    metadata = tuple(
        name for name in dict.fromkeys(catalog.facts.metadata_files) if name not in data
    )
    return data, metadata


def account_bytes(catalog: Catalog, sizes: Mapping[str, int | None]) -> ByteAccount:
    """The :class:`ByteAccount` of ``catalog`` given the sizes of its files (``sizes`` maps
    the names :func:`counted_files` gives; an absent or None size is a missing file).

    Each stored record is counted once: records are identified by file and byte range, and
    one lying inside an earlier record's range adds nothing. A RAW record's bytes are all
    element bytes; another tensor record (a torch.save archive, a safetensors blob, a
    compressed record) holds at most its chunk's element bytes; an object record is all its
    bytes. Bytes past a file's end are not counted (a truncated file has fewer of them).
    An alternate group's record adds only when no other group's record reaches its bytes.
    """
    data_files, metadata_files = counted_files(catalog)
    alternates = tuple(catalog.facts.alternate_groups)
    primary, alternate = _stored_records(catalog, set(alternates))
    per_file: dict[str, list[int]] = {name: [0, 0, 0] for name in data_files}
    by_group: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_dtype: dict[str, int] = defaultdict(int)
    shares: dict[tuple[frozenset[str], str], int] = defaultdict(int)
    primary_spans, alternate_spans = _by_file(primary), _by_file(alternate)
    alternate_bytes = 0
    for file in dict.fromkeys([*primary_spans, *alternate_spans]):
        size = sizes.get(file) or 0
        spans = primary_spans.get(file, [])
        counted = list(_distinct_bytes(spans, size))
        # an alternate record adds only where no other group's record reaches (else it is a
        # view of theirs: named in ``alternate_bytes``)
        reached = _merged(spans)
        alone = []
        for start, end, record in alternate_spans.get(file, ()):
            if _overlaps(reached, start, end):
                alternate_bytes += record.payload
            elif end > start:
                alone.append((start, end, record))
        counted += _distinct_bytes(alone, size)
        totals = per_file.setdefault(file, [0, 0, 0])
        for record, nbytes in counted:
            tensor = record.owner.kind == "tensor"
            totals[0] += 1
            totals[1 if tensor else 2] += nbytes
            by_group[record.owner.group][0 if tensor else 1] += nbytes
            if tensor:
                by_dtype[record.owner.dtype.name] += nbytes
            shares[(frozenset(record.groups), record.owner.kind)] += nbytes
    return ByteAccount(
        data_files=data_files,
        metadata_files=metadata_files,
        sizes={name: sizes.get(name) for name in (*data_files, *metadata_files)},
        per_file={name: FileBytes(*counts) for name, counts in per_file.items()},
        by_group={group: GroupBytes(*counts) for group, counts in by_group.items()},
        by_dtype=dict(by_dtype),
        shares=dict(shares),
        alternate_groups=alternates,
        alternate_bytes=alternate_bytes,
    )


@dataclass
class _Stored:
    """One distinct stored record: the first entry viewing it, every viewer's group, and the
    most element bytes any viewer says it holds."""

    owner: Entry
    groups: set[str]
    payload: int


def _stored_records(
    catalog: Catalog, alternates: set[str]
) -> tuple[dict[tuple[str, int, int], _Stored], dict[tuple[str, int, int], _Stored]]:
    """Distinct records by ``(file, offset, length)``: those of the other groups' entries, and
    those of the alternate groups' entries."""
    primary: dict[tuple[str, int, int], _Stored] = {}
    alternate: dict[tuple[str, int, int], _Stored] = {}
    for entry in catalog.entries.values():
        group = entry.group
        stored = alternate if group in alternates else primary
        itemsize = entry.dtype.itemsize if entry.kind == "tensor" else None
        for chunk in entry.chunks:
            record = chunk.record
            if record is None:
                continue
            length = record.length
            if itemsize is not None and record.encoding is not Encoding.RAW:
                payload = min(length, chunk.numel * itemsize)
            else:
                payload = length
            key = (record.file, record.offset, length)
            found = stored.get(key)
            if found is None:
                stored[key] = _Stored(entry, {group}, payload)
            else:
                found.groups.add(group)
                found.payload = max(found.payload, payload)
    return primary, alternate


def _by_file(
    stored: Mapping[tuple[str, int, int], _Stored],
) -> dict[str, list[tuple[int, int, _Stored]]]:
    """Each file's records as ``(start, end, record)``, by start, the longer first."""
    spans: dict[str, list[tuple[int, int, _Stored]]] = defaultdict(list)
    for (file, offset, length), record in stored.items():
        spans[file].append((offset, offset + length, record))
    for listed in spans.values():
        listed.sort(key=lambda span: (span[0], -span[1]))
    return spans


def _merged(spans: list[tuple[int, int, _Stored]]) -> list[tuple[int, int]]:
    """The byte ranges ``spans`` (sorted by start) cover, merged: disjoint, in order."""
    merged: list[tuple[int, int]] = []
    for start, end, _ in spans:
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlaps(merged: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` shares a byte with one of the disjoint sorted ``merged``."""
    at = bisect.bisect_right(merged, (start, math.inf)) - 1  # the last range starting <= start
    before = merged[at] if at >= 0 else None
    after = merged[at + 1] if at + 1 < len(merged) else None
    return (before is not None and start < before[1] and end > start) or (
        after is not None and after[0] < end
    )


def _distinct_bytes(spans: list[tuple[int, int, _Stored]], size: int):
    """``(record, bytes it adds)`` for each record of one file not lying inside an earlier
    one's range: its payload less what earlier records already cover, within the file."""
    covered = 0  # end of the ranges seen so far
    for start, end, record in spans:
        if start < covered and start < end <= covered:
            continue  # inside a record already counted: a view of the same bytes
        overlap = max(0, covered - start)
        new = max(0, min(end, size) - max(start, covered))
        yield record, max(0, min(record.payload - overlap, new))
        covered = max(covered, end)


def _check_invariants(account: ByteAccount) -> None:
    """The invariants every report relies on; a violation is a bug in this module."""
    problems = []
    for name, counts in account.per_file.items():
        size = account.sizes.get(name) or 0
        if min(counts.tensor_bytes, counts.object_bytes, counts.records) < 0:
            problems.append(f"{name}: negative counts {counts}")
        if counts.tensor_bytes + counts.object_bytes > size:
            problems.append(f"{name}: {counts} hold more than its {size} bytes")
    if account.overhead_bytes < 0:
        problems.append(f"overhead {account.overhead_bytes} < 0")
    grouped = account.by_group.values()
    if (sum(g.tensor_bytes for g in grouped), sum(g.object_bytes for g in grouped)) != (
        account.tensor_bytes,
        account.object_bytes,
    ):
        problems.append("groups do not add up to the totals")
    if sum(account.by_dtype.values()) != account.tensor_bytes:
        problems.append("dtypes do not add up to the tensor bytes")
    if sum(account.shares.values()) != account.tensor_bytes + account.object_bytes:
        problems.append("shares do not add up to the stored bytes")
    if problems:
        raise AssertionError("ckptkit byte account: " + "; ".join(problems))
