"""Damage detection: read a whole checkpoint and list what is wrong with it, file by key.

:func:`verify` checks that every file exists with the size its records need, that every record
parses and agrees with the metadata (dtype, shape, size), the CRC-32 of every record that
carries one (torch.save zip members: DCP records, ``*.pt`` storages), and that every tensor's
chunks cover it exactly once. Problems come back as a DataFrame instead of an exception, so one
pass reports them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import tunables
from ..catalog.model import (
    Catalog,
    Chunk,
    Encoding,
    Entry,
    Record,
    distinct_chunks,
    left_as_objects_text,
    tensors_left_as_objects,
)
from ..errors import (
    CheckpointError,
    ChecksumError,
    CorruptRecordError,
    CoverageError,
    FormatError,
    LimitExceededError,
    MismatchError,
    MissingFileError,
    NotACheckpointError,
    PickleLimitError,
    TensorsLeftAsObjectsError,
    TruncatedFileError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedLayoutError,
)
from ..reading import Reader, check_coverage, strided_view
from . import distributed, work
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

    from .distributed import Ranks

__all__ = [
    "COLUMNS",
    "LEFT_AS_OBJECTS",
    "PROBLEMS",
    "problem_kind",
    "Problem",
    "verify",
    "verify_checkpoint",
    "INTEGRITY_FILE",
]

COLUMNS = ["file", "key", "problem", "detail"]
#: The ``problem`` of a file holding tensors ckptkit could only keep as objects.
LEFT_AS_OBJECTS = "tensors left as objects"

#: The ``problem`` column: the most specific error class wins.
PROBLEMS: list[tuple[type[CheckpointError], str]] = [
    (TruncatedFileError, "truncated"),
    (ChecksumError, "checksum"),
    (MismatchError, "mismatch"),
    (TensorsLeftAsObjectsError, LEFT_AS_OBJECTS),
    (CoverageError, "coverage"),
    (MissingFileError, "missing file"),
    (PickleLimitError, "pickle limit"),
    (UnsafePickleError, "unsafe pickle"),
    (UnsafePathError, "unsafe path"),
    (LimitExceededError, "limit"),
    (CorruptRecordError, "corrupt record"),
    (FormatError, "format"),
    (CheckpointError, "error"),
]


def problem_kind(exc: BaseException) -> str:
    """The ``problem`` label of an error (``"checksum"`` for a :class:`ChecksumError`…)."""
    return next((label for cls, label in PROBLEMS if isinstance(exc, cls)), "error")


@dataclass
class Problem:
    file: str | None
    key: str | None
    problem: str
    detail: str


def verify(
    src: str | Source,
    *,
    storage_options: dict[str, Any] | None = None,
    crc: bool = True,
    workers: int = 1,
) -> pd.DataFrame:
    """Problems of the checkpoint at ``src`` (a path, fsspec URL or open checkpoint; see
    :meth:`ckptkit.Checkpoint.verify`); a checkpoint that cannot even be opened (missing
    ``.metadata``, a rank file missing from a set) is one problem row rather than an
    exception; a location that is not a checkpoint at all (a typo, a folder of steps) raises
    :class:`~ckptkit.errors.NotACheckpointError`, and a checkpoint in a layout ckptkit does not
    read (DeepSpeed pipeline + tensor parallelism…) :class:`~ckptkit.errors.UnsupportedLayoutError`,
    so a CI job can tell a wrong path or an unsupported layout from damage. Tensors are checked on ``workers`` threads, and spread over the ranks of an
    initialised torch.distributed process group (every rank returns the whole table).

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        storage_options: fsspec options for ``src`` (when a URL).
        crc: check every record's stored CRC-32 (default True); False skips that for speed.
        workers: threads checking tensors at once.

    Returns:
        A DataFrame with columns ``file``, ``key``, ``problem`` (``"truncated"``,
        ``"checksum"``, ``"missing file"``…) and ``detail``, one row per problem; empty when
        the checkpoint is sound.

    Example:
        >>> problems = ckptkit.verify("s3://bucket/run/step_1000")
        >>> problems.empty
        True
    """
    try:
        source = open_source(src, storage_options, verify_crc=crc)
    except (NotACheckpointError, UnsupportedLayoutError):
        raise  # a usage problem, not damage
    except CheckpointError as exc:
        return _frame([Problem(None, None, problem_kind(exc), str(exc))])
    return verify_checkpoint(source, crc=crc, workers=workers)


def verify_checkpoint(source: Source, *, crc: bool = True, workers: int = 1) -> pd.DataFrame:
    """Problems of an open checkpoint: one row per damaged file, record or tensor."""
    workers = work.check_workers(workers)
    with distributed.joined() as ranks:
        return _frame(_problems(source, crc, workers, ranks))


def _frame(problems: list[Problem]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame([vars(p) for p in problems], columns=COLUMNS)


def _problems(source: Source, crc: bool, workers: int, ranks: Ranks | None) -> list[Problem]:
    """Files and records first (cheap, on every rank), then the tensors as work items (the
    objects as one more), rows in catalog order whoever checked them."""
    catalog, storage = source.catalog, source.storage
    records = [
        (entry, chunk)
        for entry in catalog.entries.values()
        for chunk in entry.chunks
        if chunk.record is not None
    ]
    files = list(dict.fromkeys([*catalog.files, *(c.record.file for _, c in records)]))
    sizes = storage.sizes(files)
    missing = list(_missing_files(files, sizes, records))
    unreadable: set[int] = set()  # id() of records not worth reading
    truncated = list(_truncated_records(records, sizes, unreadable))
    readers = work.PerThread(lambda: Reader(storage, catalog.object_globals, verify_crc=crc))
    tensors, objects = catalog.tensors(), catalog.objects()
    items = [work.WorkItem(0, 0, "integrity"), work.WorkItem(1, 0, "objects")]
    items += [work.WorkItem(i + 2, entry.nbytes, entry) for i, entry in enumerate(tensors)]

    def check(item: work.WorkItem[Entry | str], stop: work.Stop) -> list[Problem]:
        stop.check()
        if item.task == "integrity":
            return list(_integrity_problems(source))
        if item.task == "objects":
            return list(_object_problems(readers.get(), objects, unreadable))
        return list(_tensor_problems(readers.get(), item.task, unreadable))

    found = work.run_everywhere(items, check, workers=workers, ranks=ranks, what="verify")
    checked = [p for index in range(2, len(items)) for p in found[index]]
    left = list(_left_as_objects(catalog))
    return left + missing + found[0] + truncated + checked + found[1]


def _left_as_objects(catalog: Catalog) -> Iterator[Problem]:
    """A row per file holding tensors ckptkit could only keep as objects (DTensors outside a
    set of rank files, tensor subclasses): the checkpoint reads "clean" but without them."""
    by_file: dict[str, list[Entry]] = {}
    for entry in tensors_left_as_objects(catalog.entries.values()):
        by_file.setdefault(entry.chunks[0].record.file, []).append(entry)
    for file, entries in by_file.items():
        yield Problem(
            file,
            entries[0].key if len(entries) == 1 else None,
            LEFT_AS_OBJECTS,
            f"{left_as_objects_text(entries)}; not read as tensors, so reads, unshard and "
            "convert would lack them",
        )


def _missing_files(
    files: list[str], sizes: dict[str, int | None], records: list[tuple[Entry, Chunk]]
) -> Iterator[Problem]:
    """A row per file that is not there, naming a few of the keys it holds."""
    for file in files:
        if sizes.get(file) is None:
            keys = sorted({e.key for e, c in records if c.record.file == file})
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            yield Problem(file, None, "missing file", f"no such file; it holds {shown or '-'}")


def _truncated_records(
    records: list[tuple[Entry, Chunk]], sizes: dict[str, int | None], unreadable: set[int]
) -> Iterator[Problem]:
    """A row per record past the end of its file; those and records of missing files are
    added to ``unreadable``."""
    for entry, chunk in records:
        record, size = chunk.record, sizes.get(chunk.record.file)
        if size is None:
            unreadable.add(id(record))
        elif record.offset + record.length > size:
            unreadable.add(id(record))
            yield Problem(
                record.file,
                entry.key,
                "truncated",
                f"the record needs bytes [{record.offset}, {record.offset + record.length}), "
                f"the file has {size} bytes",
            )


def _tensor_problems(reader: Reader, entry: Entry, unreadable: set[int]) -> Iterator[Problem]:
    """Coverage of ``entry`` by its distinct chunks, then every readable chunk read."""
    distinct = distinct_chunks(entry.chunks)
    try:
        check_coverage(entry, distinct)
    except (CoverageError, LimitExceededError) as exc:
        yield Problem(None, entry.key, problem_kind(exc), str(exc))
    readable = [c for c in distinct if c.record is not None and id(c.record) not in unreadable]
    yield from _check_tensor(reader, entry, readable)


def _object_problems(
    reader: Reader, objects: list[Entry], unreadable: set[int]
) -> Iterator[Problem]:
    """Every readable object decoded; the leaves of one pickle are decoded together (a row
    for the pickle, no key, when it fails)."""
    shared: dict[tuple, list[Entry]] = {}
    for entry in objects:
        record = entry.chunks[0].record if entry.chunks else None
        if record is None or id(record) in unreadable:
            continue
        shared.setdefault((record.file, record.offset, record.length), []).append(entry)
    for (file, _, _), entries in shared.items():
        pickled = entries[0].chunks[0].record.encoding in (
            Encoding.PICKLE_LEAF,
            Encoding.PICKLE_BYTES,
            Encoding.DOCUMENT,
        )
        groups = [entries[:1]] if pickled else [[e] for e in entries]
        for group in groups:
            try:
                reader.read_objects(group, tensors="ref")
            except CheckpointError as exc:
                key = group[0].key if len(entries) == 1 or not pickled else None
                yield Problem(file, key, problem_kind(exc), str(exc))


def _check_tensor(reader: Reader, entry: Entry, chunks: list[Chunk]) -> Iterator[Problem]:
    """Read every chunk of ``entry`` in bounded batches; a failing batch is re-read chunk by
    chunk to name the record at fault."""
    batch: list[Chunk] = []
    size = 0
    for chunk in [*chunks, None]:
        if chunk is not None and (not batch or size + chunk.record.length <= tunables.BATCH_BYTES):
            batch.append(chunk)
            size += chunk.record.length
            continue
        if batch:
            try:
                _read_chunks(reader, entry, batch)
            except CheckpointError as exc:
                if len(batch) == 1:
                    yield _problem(batch[0].record, entry, exc)
                else:
                    for one in batch:
                        try:
                            _read_chunks(reader, entry, [one])
                        except CheckpointError as exc_one:
                            yield _problem(one.record, entry, exc_one)
        batch, size = ([chunk], chunk.record.length) if chunk is not None else ([], 0)


def _read_chunks(reader: Reader, entry: Entry, chunks: list[Chunk]) -> None:
    for chunk, data in zip(chunks, reader.decode_chunks(entry, chunks), strict=True):
        source = f"{reader.storage.describe(chunk.record.file)} @{chunk.record.offset}"
        view = strided_view(data, f"{source} ({entry.key})")
        if view.size != chunk.numel or (not chunk.flat and view.shape != chunk.sizes):
            raise MismatchError(
                f"{source}: {entry.key!r} record holds shape {list(view.shape)}, the metadata "
                f"says {list(chunk.sizes)}"
            )


def _problem(record: Record, entry: Entry, exc: CheckpointError) -> Problem:
    return Problem(record.file, entry.key, problem_kind(exc), str(exc))


#: A checkpoint's own per-file SHA-256 list (Megatron-core >= 0.18 ``integrity.json``).
INTEGRITY_FILE = "integrity.json"
_HASH_PIECE = 8 << 20


def _integrity_problems(source: Source) -> Iterator[Problem]:
    """A row per file whose SHA-256 differs from the ``integrity.json`` the checkpoint lists
    among its metadata files (``{file: hex}``, possibly under one key, or ``{file: {"sha256":
    hex}}``); files are hashed in bounded pieces."""
    storage = source.storage
    for name in source.catalog.facts.metadata_files:
        if name.rsplit("/", 1)[-1] != INTEGRITY_FILE:
            continue
        try:
            listed = _sha256_list(json.loads(storage.read_file(name)))
        except (CheckpointError, ValueError, UnicodeDecodeError) as exc:
            yield Problem(name, None, "format", f"unreadable integrity list: {exc}")
            continue
        folder = name[: -len(INTEGRITY_FILE)]
        for file, expected in listed.items():
            yield from _check_sha256(storage, folder + file, expected)


def _sha256_list(data: Any) -> dict[str, str]:
    """``{file: lowercase hex}`` from an integrity list, wherever its one mapping sits."""
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), dict):
        inner = next(iter(data.values()))
        if inner and all(isinstance(v, str | dict) for v in inner.values()):
            data = inner
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    out = {}
    for file, value in data.items():
        digest = value.get("sha256") if isinstance(value, dict) else value
        if not isinstance(file, str) or not isinstance(digest, str) or len(digest) != 64:
            raise ValueError(f"entry {str(file)[:80]!r} is not a file and a SHA-256")
        out[file] = digest.lower()
    return out


def _check_sha256(storage: Any, file: str, expected: str) -> Iterator[Problem]:
    try:
        size = storage.size(file)
        digest = hashlib.sha256()
        for start in range(0, size, _HASH_PIECE):
            (piece,) = storage.read_ranges([(file, start, min(size, start + _HASH_PIECE))])
            digest.update(piece)
    except CheckpointError as exc:
        yield Problem(file, None, problem_kind(exc), str(exc))
        return
    if digest.hexdigest() != expected:
        yield Problem(
            file,
            None,
            "checksum",
            f"SHA-256 {digest.hexdigest()} differs from {expected} in {INTEGRITY_FILE}",
        )
