"""Writing a checkpoint in another format: unsharded torch.save / safetensors, or DCP.

Unsharding gives one output per top-level group (``model``, ``optim``, ``train``…); tensor bytes
are copied one tensor (or one row-chunk) at a time, and all files are staged and renamed into
place only on success.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .. import dtypes
from ..catalog import output_names
from ..catalog.keys import nest
from ..catalog.model import Chunk, Entry
from ..decoding.known_objects import decoded, opaque_names
from ..dtypes import DType
from ..errors import FormatError, MissingFileError, OutputExistsError, UnsafePickleError, UsageError
from ..reading import Reader
from ..storage import AtomicOutput, Storage, atomic_output
from ..units import parse_size
from . import distributed, work
from .source import Source, open_source
from .writers import dcp as dcp_writer
from .writers import safetensors as safetensors_writer
from .writers import torch_save

if TYPE_CHECKING:
    from .distributed import Ranks

Target = Literal["torch", "safetensors", "dcp"]
#: What unshard/convert do with an object holding classes ckptkit does not decode: write it
#: back as the pickle built it (``keep``), leave the entry out (``drop``) or refuse (``error``).
ObjectPolicy = Literal["keep", "drop", "error"]


@dataclass
class WrittenFile:
    """One output file: its name under the destination, bytes, and what it holds."""

    name: str
    nbytes: int
    tensors: int
    objects: int


@dataclass
class UnshardResult:
    """What :func:`unshard` wrote where; non-tensor entries of safetensors output are listed
    under the ``*.objects.pt`` side files that hold them. ``opaque`` names the object entries
    written back as their pickle built them, with the classes ckptkit did not decode (loading
    them needs those classes, and runs their code); ``dropped`` the entries left out, and why."""

    destination: str
    files: list[WrittenFile] = field(default_factory=list)
    opaque: dict[str, list[str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([vars(f) for f in self.files])

    def __str__(self) -> str:
        from ..units import human_bytes

        lines = [
            f"wrote {len(self.files)} files ({human_bytes(self.nbytes)}) to {self.destination}"
        ]
        lines += [
            f"  {f.name:<40} {human_bytes(f.nbytes):>10}  {f.tensors} tensors, {f.objects} objects"
            for f in self.files
        ]
        for title, notes in (
            ("written as pickled (classes ckptkit does not decode)", _joined(self.opaque)),
            ("left out", self.dropped),
        ):
            if notes:
                lines.append(f"{len(notes)} objects {title}:")
                lines += [f"  {key}: {why}" for key, why in list(notes.items())[:_LISTED]]
                if len(notes) > _LISTED:
                    lines.append(f"  … and {len(notes) - _LISTED} more")
        return "\n".join(lines)


#: Keys listed per kind in :meth:`UnshardResult.__str__`.
_LISTED = 10


def _joined(opaque: dict[str, list[str]]) -> dict[str, str]:
    return {key: ", ".join(names) for key, names in opaque.items()}


def unshard(
    src: str | Source,
    dst: str,
    *,
    to: Literal["torch", "safetensors"] = "torch",
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    objects: ObjectPolicy = "keep",
    exclude: Sequence[str] | str | None = None,
    workers: int = 1,
) -> UnshardResult:
    """Write the checkpoint ``src`` unsharded into the directory ``dst``, one file per group.

    ``to="torch"``: ``<group>.pt`` holding exactly what torch's ``dcp_to_torch_save`` puts under
    that group (nesting, objects included), streamed so ``torch.load(mmap=True)`` works.
    ``to="safetensors"``: ``<group>.safetensors`` with dotted keys relative to the group (HF
    ``-0000i-of-0000N`` shards + index with ``max_shard_size``); the group's non-tensor entries
    go to ``<group>.objects.pt``. ``keys`` (globs) and ``groups`` select entries; ``dtype``
    casts floating tensors; ``exclude`` (globs) leaves entries out. Objects holding classes
    ckptkit does not decode are written back as their pickle built them (``objects="keep"``,
    listed in the result's ``opaque``), left out (``"drop"``) or refused (``"error"``); nothing
    of them runs here. Memory stays at about the largest tensor; nothing appears under a
    final name unless everything succeeded, and existing files are kept unless ``overwrite``.

    The output files are a plan's work items: ``workers`` threads write several at once, and
    inside an initialised torch.distributed process group (e.g. under ``torchrun``) each rank
    writes its share, balanced by bytes, and the files appear only when every rank succeeded.
    """
    if to not in ("torch", "safetensors"):
        raise UsageError(f"to must be 'torch' or 'safetensors', not {to!r}")
    work.check_workers(workers)
    source = open_source(src, storage_options)
    cast = dtypes.dtype(dtype) if dtype is not None else None
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    destination = Storage(dst, storage_options)
    result = UnshardResult(destination.describe())
    entries, values = _selected_values(source, keys, groups, exclude, objects, result)
    tasks = [task for plan in _plans(entries, values, to, limit, cast) for task in plan.tasks()]
    ranks = distributed.current()
    total = sum(task.nbytes for task in tasks)
    with (
        distributed.JobProgress(total, progress, "unshard", ranks) as bar,
        _staged(destination, overwrite, ranks) as output,
    ):
        names = [name for task in tasks for name in task.names]
        output.refuse_existing(names)
        _refuse_another_checkpoint(destination, names)
        written = _run_tasks(tasks, output, source, cast, bar, workers, ranks)
    result.files = _gathered(written, ranks)
    return result


@contextlib.contextmanager
def _staged(destination: Storage, overwrite: bool, ranks: Ranks | None) -> Iterator[AtomicOutput]:
    """An :class:`AtomicOutput` for this process, committed only when the block succeeded on
    every rank: each rank stages its own files, all agree, each publishes its own, all agree
    again, and a failure anywhere takes back what any rank published."""
    if ranks is None:
        with atomic_output(destination, overwrite=overwrite) as output:
            yield output
        return
    output = AtomicOutput(destination, overwrite=overwrite)
    try:
        error = None
        try:
            yield output
        except BaseException as exc:
            error = exc
        ranks.agree(error, "writing the outputs")
        published: list = []
        try:
            published = output.publish()
            error = None
        except BaseException as exc:
            error = exc
        try:
            ranks.agree(error, "publishing the outputs")
        except BaseException:
            output.withdraw(published)
            raise
    finally:
        output.discard()


def _gathered(written: dict[int, list[WrittenFile]], ranks: Ranks | None) -> list[WrittenFile]:
    """Every rank's written files, in plan order (the order a single process writes them)."""
    if ranks is not None:
        merged: dict[int, list[WrittenFile]] = {}
        for part in ranks.all_gather(written):
            merged.update(part)
        written = merged
    return [file for index in sorted(written) for file in written[index]]


def _run_tasks(
    tasks: list[_Task],
    output: AtomicOutput,
    source: Source,
    cast: DType | None,
    bar: distributed.JobProgress,
    workers: int,
    ranks: Ranks | None,
) -> dict[int, list[WrittenFile]]:
    """Write this process's share of ``tasks`` on ``workers`` threads, each with its own
    reader (a reader's caches belong to one thread); the files each task wrote, by index."""
    items = [work.WorkItem(i, task.nbytes, task) for i, task in enumerate(tasks)]
    stop = work.Stop()
    fresh = workers > 1
    copiers = work.PerThread(
        lambda: _Copier(source.reader.fresh() if fresh else source.reader, cast, bar, stop)
    )

    log = distributed.rank_logger(ranks)

    def write(item: work.WorkItem[_Task], _stop: work.Stop) -> list[WrittenFile]:
        copier = copiers.get()
        copier.reader.read_ahead(item.task.entries)  # small tensors: many per batch of reads
        log.info("writing %s (%d bytes)", ", ".join(item.task.names), item.nbytes)
        written = item.task.write(output, copier)
        log.info("wrote %s", ", ".join(item.task.names))
        return written

    return work.run(work.mine(items, ranks), write, workers=workers, stop=stop)


def _refuse_another_checkpoint(destination: Storage, names: list[str]) -> None:
    """One folder, one checkpoint: refuse to write groups the folder already holds in another
    format or sharding (``model.safetensors`` beside a new ``model.pt``), between which a
    reader could only choose silently. ``overwrite`` does not help: it replaces files of the
    same name, and the others would stay."""
    try:
        existing = destination.listdir()
    except MissingFileError:
        return
    ours = set(names)
    groups = {output_names.group_of_file(name) for name in names} - {None}
    others = sorted(
        n for n in existing if n not in ours and output_names.group_of_file(n) in groups
    )
    if others:
        shown = ", ".join(others[:4]) + (" …" if len(others) > 4 else "")
        raise OutputExistsError(
            f"{destination.describe()} already holds {shown}: the same group(s) in another "
            "format or sharding; write to an empty folder (one folder, one checkpoint)"
        )


def _selected_values(
    source: Source,
    keys: Sequence[str] | str | None,
    groups: Sequence[str] | str | None,
    exclude: Sequence[str] | str | None,
    policy: ObjectPolicy,
    result: UnshardResult,
) -> tuple[list[Entry], dict[str, Any]]:
    """The entries to write and their objects' values (as pickled, tensors in memory), after
    ``keys`` / ``groups`` / ``exclude`` and the object ``policy``; records what was left out
    or carried opaquely in ``result``. Nothing left at all is an error, not an empty output."""
    if policy not in ("keep", "drop", "error"):
        raise UsageError(f"objects must be 'keep', 'drop' or 'error', not {policy!r}")
    excluded = [exclude] if isinstance(exclude, str) else list(exclude or ())
    entries = []
    for entry in source.catalog.select(keys, groups):
        pattern = next((p for p in excluded if fnmatch.fnmatchcase(entry.key, p)), None)
        if pattern is None:
            entries.append(entry)
        else:
            result.dropped[entry.key] = f"exclude={pattern!r}"
    objects = [e for e in entries if e.kind == "object"]
    raw = source.reader.read_objects(objects, decode=False, tensors="data") if objects else []
    values = dict(zip((e.key for e in objects), raw, strict=True))
    for key, value in values.items():
        names = opaque_names(decoded(value))
        if not names:
            continue
        if policy == "error":
            raise UnsafePickleError(
                f"{key!r} holds {', '.join(names)}, which ckptkit does not decode; "
                "objects='keep' writes it back as pickled, objects='drop' or exclude= leaves it out",
                global_name=names[0],
            )
        if policy == "drop":
            result.dropped[key] = f"holds {', '.join(names)} (objects='drop')"
        else:
            result.opaque[key] = names
    entries = [e for e in entries if e.key not in result.dropped]
    if not entries:
        raise FormatError(
            f"{source.url}: nothing matches keys={keys!r} groups={groups!r}"
            + (f" ({len(result.dropped)} entries left out)" if result.dropped else "")
            + f"; {source.catalog.hint(keys, groups)}"
        )
    return entries, {k: v for k, v in values.items() if k not in result.dropped}


def _plans(
    entries: list[Entry], values: dict[str, Any], to: str, limit: int | None, cast: DType | None
) -> list[_Plan]:
    """One output plan per group, their file names checked not to collide before any is written."""
    by_group: dict[str, list[Entry]] = {}
    for entry in entries:
        by_group.setdefault(entry.group, []).append(entry)
    plans = [
        _plan_torch(group, items, values, cast)
        if to == "torch"
        else _plan_safetensors(group, items, values, limit, cast)
        for group, items in by_group.items()
    ]
    output_names.check_distinct_files({plan.group: plan.names for plan in plans})
    return plans


def convert(
    src: str | Source,
    dst: str,
    *,
    to: Target = "dcp",
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    objects: ObjectPolicy = "keep",
    exclude: Sequence[str] | str | None = None,
    workers: int = 1,
) -> UnshardResult:
    """Write ``src`` into ``dst`` as format ``to``.

    ``to="dcp"``: a DCP directory (``.metadata`` + ``__0_0.distcp``) that torch's ``dcp.load``
    reads at any world size; chunks keep their boxes and records already in torch.save form are
    copied byte for byte, so DCP → DCP with ``keys``/``groups`` is a cheap way to slim a
    checkpoint (e.g. drop the optimizer). ``"torch"`` / ``"safetensors"`` unshard.
    ``objects``, ``exclude`` and ``workers`` work as for :func:`unshard` (a DCP output is one
    data file: one worker writes it).
    """
    if to in ("torch", "safetensors"):
        return unshard(
            src,
            dst,
            to=to,
            keys=keys,
            groups=groups,
            storage_options=storage_options,
            overwrite=overwrite,
            progress=progress,
            objects=objects,
            exclude=exclude,
            workers=workers,
        )
    if to != "dcp":
        raise UsageError(f"to must be 'dcp', 'torch' or 'safetensors', not {to!r}")
    work.check_workers(workers)
    source = open_source(src, storage_options)
    destination = Storage(dst, storage_options)
    result = UnshardResult(destination.describe())
    entries, values = _selected_values(source, keys, groups, exclude, objects, result)
    names = [dcp_writer.DATA_FILE, dcp_writer.METADATA]
    tensors = [e for e in entries if e.kind == "tensor"]
    write = functools.partial(_write_dcp, entries, values)
    task = _Task(names, tensors, sum(e.nbytes for e in tensors), write)
    ranks = distributed.current()
    with (
        distributed.JobProgress(task.nbytes, progress, "convert", ranks) as bar,
        _staged(destination, overwrite, ranks) as output,
    ):
        output.refuse_existing(names)
        written = _run_tasks([task], output, source, None, bar, workers, ranks)
    result.files = _gathered(written, ranks)
    return result


def _write_dcp(
    entries: list[Entry], values: dict[str, Any], output: AtomicOutput, copier: _Copier
) -> list[WrittenFile]:
    """Write ``entries`` as the DCP data file and its ``.metadata`` into ``output``. ``values``
    holds the objects' values."""
    with output.open(dcp_writer.DATA_FILE) as stream:
        records = dcp_writer.write_records(
            stream,
            entries,
            copy_record=copier.record,
            chunk_bytes=copier.chunk,
            object_value=lambda entry: values[entry.key],
        )
        data_size = stream.tell()
    metadata = dcp_writer.metadata_bytes(records, entries)
    with output.open(dcp_writer.METADATA) as stream:
        stream.write(metadata)
    n_objects = len(values)
    return [
        WrittenFile(dcp_writer.DATA_FILE, data_size, len(entries) - n_objects, n_objects),
        WrittenFile(dcp_writer.METADATA, len(metadata), 0, 0),
    ]


class _Copier:
    """Produces each tensor's output bytes (cast when asked), advancing the progress bar;
    stops when another worker failed."""

    def __init__(self, reader: Reader, cast: DType | None, bar, stop: work.Stop) -> None:
        self.reader, self.cast, self.bar, self.stop = reader, cast, bar, stop

    def __call__(self, entry: Entry) -> Iterator[memoryview]:
        for piece in self.checked(entry):
            yield piece.data if isinstance(piece, torch_save.CheckedBytes) else piece
            piece = None  # not held while the reader fetches the next batch

    def checked(self, entry: Entry) -> Iterator[memoryview | torch_save.CheckedBytes]:
        """The pieces, those the reader just checked with their CRC-32 (for a zip writer)."""
        target = _out_dtype(entry.dtype, self.cast)
        for piece, crc in self.reader.iter_checked(entry):
            self.stop.check()
            if target != entry.dtype:
                piece, crc = _cast(piece, entry.dtype, target), None
            self.bar.update(len(piece))
            yield piece if crc is None else torch_save.CheckedBytes(piece, crc)
            piece = None  # not held while the reader fetches the next batch

    def record(self, entry: Entry, chunk: Chunk) -> bytes:
        """A chunk's stored record, byte for byte (CRC-checked by the reader unless it was
        opened with ``verify_crc=False``)."""
        self.stop.check()
        data = self.reader.read_record(entry, chunk)
        self.bar.update(chunk.numel * entry.dtype.itemsize)
        return data

    def chunk(self, entry: Entry, chunk: Chunk) -> Iterator[memoryview]:
        """One chunk's bytes; the whole tensor streams when the chunk is all of it."""
        if (
            chunk.offsets == (0,) * len(entry.shape)
            and chunk.sizes == entry.shape
            and not chunk.flat
        ):
            yield from self(entry)
            return
        piece = self.reader.read_chunk(entry, chunk)
        self.bar.update(len(piece))
        yield piece


def _out_dtype(dt: DType, cast: DType | None) -> DType:
    return cast if cast is not None and dt.is_floating else dt


def _cast(piece: memoryview, source: DType, target: DType) -> memoryview:
    import torch

    if not len(piece):
        return piece
    tensor = torch.frombuffer(bytearray(piece), dtype=dtypes.to_torch(source)).to(
        dtypes.to_torch(target)
    )
    return memoryview(tensor.view(torch.uint8).numpy())


@dataclass(frozen=True)
class _Task:
    """A unit of work of a plan: output file(s) written together, from ``entries``."""

    names: list[str]
    entries: list[Entry]
    nbytes: int  # tensor bytes written, for balancing and progress
    write: Callable[[AtomicOutput, _Copier], list[WrittenFile]]


class _Plan:
    group: str
    names: list[str]

    def tasks(self) -> list[_Task]:
        raise NotImplementedError


@dataclass
class _TorchPlan(_Plan):
    group: str
    entries: list[Entry]
    values: dict[str, Any]  # the objects' values, by key
    cast: DType | None = None
    name: str = ""

    @property
    def names(self) -> list[str]:
        return [self.name or f"{output_names.encode_stem(self.group)}.pt"]

    def tasks(self) -> list[_Task]:
        nbytes = sum(e.numel * _out_dtype(e.dtype, self.cast).itemsize for e in self.tensors)
        return [_Task(self.names, self.tensors, nbytes, self.write)]

    @property
    def tensors(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "tensor"]

    def write(self, output: AtomicOutput, copier: _Copier) -> list[WrittenFile]:
        name = self.names[0]
        structure, streamed = _structure(self.entries, self.values, copier.cast)
        with output.open(name) as stream:
            torch_save.write(
                stream,
                structure,
                lambda slot: copier.checked(streamed[id(slot)]),
                archive_name=output_names.encode_stem(self.group),
            )
            size = stream.tell()
        objects = sum(e.kind == "object" for e in self.entries)
        return [WrittenFile(name, size, len(self.entries) - objects, objects)]


def _plan_torch(
    group: str, entries: list[Entry], values: dict[str, Any], cast: DType | None
) -> _TorchPlan:
    plan = _TorchPlan(group, entries, values, cast)
    _structure_paths(entries)  # clashing paths refused before anything is read or written
    return plan


def _structure(
    entries: list[Entry], values: dict[str, Any], cast: DType | None
) -> tuple[Any, dict[int, Entry]]:
    """The group's nested value with tensors as slots (filled later) and objects as pickled."""
    streamed: dict[int, Entry] = {}
    items = []
    for entry in entries:
        if entry.kind == "object":
            value = values[entry.key]
        else:
            value = torch_save.TensorSlot(_out_dtype(entry.dtype, cast), entry.shape)
            streamed[id(value)] = entry
        items.append((_inner_path(entry), value))
    nested = nest(items)
    if len(entries) == 1 and len(entries[0].path) == 1:  # a group that is itself a leaf
        nested = next(iter(nested.values()))
    return nested, streamed


def _inner_path(entry: Entry) -> tuple:
    """The entry's path inside its group's file (a group that is itself a leaf: its own)."""
    return entry.path[1:] if len(entry.path) > 1 else entry.path


def _structure_paths(entries: list[Entry]) -> None:
    """Check that the group's paths nest without clashes (see :func:`state_dict.nest`)."""
    nest((_inner_path(e), None) for e in entries)


@dataclass
class _SafetensorsPlan(_Plan):
    group: str
    shards: list[list[tuple[safetensors_writer.SafetensorsItem, Entry]]]
    objects: list[Entry]
    values: dict[str, Any]

    @property
    def stem(self) -> str:
        return output_names.encode_stem(self.group)

    @property
    def tensor_names(self) -> list[str]:
        n = len(self.shards)
        if n == 1:
            return [f"{self.stem}.safetensors"]
        return [f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    @property
    def names(self) -> list[str]:
        names = self.tensor_names if self.shards[0] else []
        if len(self.shards) > 1:
            names.append(f"{self.stem}.safetensors.index.json")
        if self.objects:
            names.append(f"{self.stem}.objects.pt")
        return names

    def tasks(self) -> list[_Task]:
        tasks = []
        if self.shards[0]:
            for name, shard in zip(self.tensor_names, self.shards, strict=True):
                write = functools.partial(self._write_shard, name, shard)
                nbytes = sum(item.nbytes for item, _ in shard)
                tasks.append(_Task([name], [entry for _, entry in shard], nbytes, write))
        if len(self.shards) > 1:
            index = f"{self.stem}.safetensors.index.json"
            tasks.append(_Task([index], [], 0, lambda output, _copier: [self._write_index(output)]))
        if self.objects:
            side = _TorchPlan(self.group, self.objects, self.values, name=f"{self.stem}.objects.pt")
            tasks += side.tasks()
        return tasks

    @staticmethod
    def _write_shard(
        name: str,
        shard: list[tuple[safetensors_writer.SafetensorsItem, Entry]],
        output: AtomicOutput,
        copier: _Copier,
    ) -> list[WrittenFile]:
        by_item = {id(item): entry for item, entry in shard}
        with output.open(name) as stream:
            safetensors_writer.write(
                stream,
                [item for item, _ in shard],
                lambda item: copier(by_item[id(item)]),
                metadata={"format": "pt"},
            )
            return [WrittenFile(name, stream.tell(), len(shard), 0)]

    def _write_index(self, output: AtomicOutput) -> WrittenFile:
        """The HF ``*.safetensors.index.json`` naming each tensor's shard."""
        index = {
            "metadata": {
                "total_size": sum(item.nbytes for shard in self.shards for item, _ in shard)
            },
            "weight_map": {
                item.name: name
                for name, shard in zip(self.tensor_names, self.shards, strict=True)
                for item, _ in shard
            },
        }
        name = f"{self.stem}.safetensors.index.json"
        data = json.dumps(index, indent=2).encode()
        with output.open(name) as stream:
            stream.write(data)
        return WrittenFile(name, len(data), 0, 0)


def _plan_safetensors(
    group: str, entries: list[Entry], values: dict[str, Any], limit: int | None, cast: DType | None
) -> _SafetensorsPlan:
    shards: list[list[tuple[safetensors_writer.SafetensorsItem, Entry]]] = [[]]
    size = 0
    tensors = [e for e in entries if e.kind == "tensor"]
    names = output_names.safetensors_names({e.key: _inner_path(e) for e in tensors})
    objects = [e for e in entries if e.kind == "object"]
    _structure_paths(objects)
    for entry in tensors:
        item = safetensors_writer.SafetensorsItem(
            names[entry.key], _out_dtype(entry.dtype, cast), entry.shape
        )
        if limit is not None and shards[-1] and size + item.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((item, entry))
        size += item.nbytes
    return _SafetensorsPlan(group, shards, objects, values)
