"""The output files of unshard/convert, planned before any is written: one plan per group for
unsharded torch.save / safetensors output, data files and ``.metadata`` for a DCP directory,
each split into :class:`Task` work items that a :class:`Copier` feeds with the tensors' bytes.

Planning checks names (clashing paths, colliding files) before anything is read or written;
a task's ``write`` then streams its file(s) into the staged output, or its ``split`` lays the
file out so that several workers write its byte ranges (:class:`Split`, :class:`Part`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..catalog import output_names
from ..catalog.keys import MODEL_GROUP, nest
from ..catalog.model import Chunk, Entry
from ..decoding.unpickler import paused_gc
from ..dtypes import DType
from ..extras import require
from ..reading import Reader
from ..storage import AtomicOutput, RangedOutput
from . import work
from .writers import dcp as dcp_writer
from .writers import safetensors as safetensors_writer
from .writers import torch_save

__all__ = [
    "Copier",
    "OpenRanges",
    "Part",
    "Split",
    "Task",
    "WrittenFile",
    "dcp_tasks",
    "tied_entries",
    "transformers_tasks",
    "unsharded_tasks",
]


@dataclass
class WrittenFile:
    """One output file: its name under the destination, bytes, and what it holds."""

    name: str
    nbytes: int
    tensors: int
    objects: int


@dataclass(frozen=True)
class Task:
    """A unit of work of a plan: output file(s) written together, from ``entries``; ``split``,
    when the file's layout is known before its bytes (safetensors, torch.save), writes it as
    ``n`` parts that workers run at once instead."""

    names: list[str]
    entries: list[Entry]
    nbytes: int  # tensor bytes written, for balancing and progress
    write: Callable[[AtomicOutput, Copier], list[WrittenFile]]
    split: Callable[[OpenRanges, int], Split] | None = None


#: Opens a task's file at its full size for parts to fill: ``open_file(name, size)``, the
#: output's own new file (:meth:`AtomicOutput.open_ranges`) or the one another rank staged.
OpenRanges = Callable[[str, int], RangedOutput]


@dataclass(frozen=True)
class Part:
    """One byte range of a split task's file: ``entries`` written by ``write(copier)`` at
    their places, while other parts write theirs."""

    entries: list[Entry]
    nbytes: int
    write: Callable[[Copier], None]


@dataclass
class Split:
    """A task's file opened at its full size for :class:`Part` s to fill, by the threads of one
    process or the ranks of a job. ``learned()`` is what the parts run here found out that
    finishing needs (a zip's CRC-32s); ``finish`` (once every part succeeded, in the process
    that publishes the file) takes every process's and says what was written; ``close`` (in
    every case) releases the file. ``file`` is the file itself (what ranks hand over of it)."""

    file: RangedOutput
    parts: list[Part]
    learned: Callable[[], Any]
    finish: Callable[[list[Any]], list[WrittenFile]]
    close: Callable[[], None]


def unsharded_tasks(
    entries: list[Entry], values: dict[str, Any], to: str, limit: int | None, cast: DType | None
) -> list[Task]:
    """The tasks writing ``entries`` unsharded as ``to`` (``"torch"`` or ``"safetensors"``, in
    shards of at most ``limit`` bytes), one plan per group, their file names checked not to
    collide before any is written; ``values`` holds the objects' values, ``cast`` the dtype of
    floating tensors."""
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
    return [task for plan in plans for task in plan.tasks()]


def transformers_tasks(
    entries: list[Entry], values: dict[str, Any], limit: int | None, cast: DType | None
) -> tuple[list[Task], dict[str, str]]:
    """The tasks writing the ``model`` group's ``entries`` as transformers' ``save_pretrained``
    does, so ``from_pretrained`` loads the folder with the model's ``config.json`` beside it:
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    past ``limit`` bytes, split as huggingface_hub splits a state dict, each file's tensors in
    the safetensors library's order and its index in HF's layout, keys the model's own. Tied
    tensors (the same stored bytes under two keys) are written once, as transformers does:
    also returned, ``{left-out key: kept key}``."""
    tied = tied_entries(entries)
    kept = [e for e in entries if e.key not in tied]
    plan = _plan_safetensors(MODEL_GROUP, kept, values, limit, cast, transformers=True)
    output_names.check_distinct_files({plan.group: plan.names})
    return plan.tasks(), tied


def tied_entries(entries: list[Entry]) -> dict[str, str]:
    """``{key: earlier key}`` for each tensor whose stored bytes are exactly an earlier
    tensor's (same records, boxes, dtype and shape): a tied weight saved through one storage,
    like GPT-2's ``lm_head.weight`` in a ``pytorch_model.bin``."""
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for entry in entries:
        if entry.kind != "tensor" or not entry.chunks or entry.numel == 0:
            continue
        stored = (entry.dtype, entry.shape, *map(_stored_box, entry.chunks))
        kept = first.setdefault(stored, entry.key)
        if kept != entry.key:
            tied[entry.key] = kept
    return tied


def _stored_box(chunk: Chunk) -> tuple:
    record = chunk.record
    where = None if record is None else (
        record.file, record.offset, record.length, record.encoding, record.transform,
        record.name, record.stride, record.storage_offset,
    )  # fmt: skip
    return chunk.offsets, chunk.sizes, chunk.flat, where


def dcp_tasks(entries: list[Entry], values: dict[str, Any], n_files: int) -> list[Task]:
    """The tasks writing ``entries`` as a DCP directory: up to ``n_files`` data files (runs
    of consecutive entries of about equal bytes, one per rank and worker, as torch's writer
    has one per rank) and the ``.metadata``, every record's place planned first, so each file
    is written by whichever worker gets it. ``values`` holds the objects' values."""
    sizes = [e.nbytes if e.kind == "tensor" else 1 for e in entries]
    groups = [[entries[i] for i in run] for run in work.consecutive_runs(sizes, n_files)]
    files = dcp_writer.plan_records(groups, lambda entry: values[entry.key])
    tasks = []
    for index, (group, records) in enumerate(zip(groups, files, strict=True)):
        name = dcp_writer.data_file(index)
        tensors = [e for e in group if e.kind == "tensor"]
        counts = len(tensors), len(group) - len(tensors)
        write = functools.partial(_write_dcp_file, name, records, counts)
        tasks.append(Task([name], tensors, sum(e.nbytes for e in tensors), write))
    metadata = dcp_writer.metadata_bytes([r for records in files for r in records], entries)
    write = functools.partial(_write_bytes, dcp_writer.METADATA, metadata)
    tasks.append(Task([dcp_writer.METADATA], [], 0, write))
    return tasks


def _write_dcp_file(
    name: str,
    records: list[dcp_writer.PlannedRecord],
    counts: tuple[int, int],
    output: AtomicOutput,
    copier: Copier,
) -> list[WrittenFile]:
    """Write one DCP data file (``counts``: its tensors and objects), its records where the
    ``.metadata`` says they are."""
    with output.open(name) as stream:
        dcp_writer.write_records(
            stream, records, copy_record=copier.record, chunk_bytes=copier.chunk
        )
        size = stream.tell()
    return [WrittenFile(name, size, *counts)]


def _write_bytes(
    name: str, data: bytes, output: AtomicOutput, _copier: Copier
) -> list[WrittenFile]:
    """Write a file whose bytes are known (a DCP ``.metadata``, an index)."""
    with output.open(name) as stream:
        stream.write(data)
    return [WrittenFile(name, len(data), 0, 0)]


class Copier:
    """Produces each tensor's output bytes (cast when asked), advancing the progress bar;
    stops when another worker failed. A subclass that changes a tensor's bytes overrides both
    ``__call__`` (raw pieces) and :meth:`checked` (pieces for a zip writer)."""

    def __init__(self, reader: Reader, cast: DType | None, bar, stop: work.Stop) -> None:
        self.reader, self.cast, self.bar, self.stop = reader, cast, bar, stop

    def __call__(self, entry: Entry) -> Iterator[memoryview]:
        """The pieces of :meth:`checked` without their CRC-32s (one generator, not two: a
        small tensor is one piece, and the chain cost more than copying it)."""
        target = _out_dtype(entry.dtype, self.cast)
        stop, bar = self.stop, self.bar
        for piece, _ in self.reader.iter_checked(entry):
            stop.check()
            if target != entry.dtype:
                piece = _cast(piece, entry.dtype, target)
            bar.update(len(piece))
            yield piece
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
    torch = require("torch", f"casting {source.name} tensors to {target.name}")

    if not len(piece):
        return piece
    tensor = torch.frombuffer(bytearray(piece), dtype=dtypes.to_torch(source)).to(
        dtypes.to_torch(target)
    )
    return memoryview(tensor.view(torch.uint8).numpy())


class _Plan:
    """The output files of one group, and the tasks that write them."""

    group: str
    names: list[str]

    def tasks(self) -> list[Task]:
        raise NotImplementedError


@dataclass
class _TorchPlan(_Plan):
    """A group as one torch.save file (``<group>.pt``, or ``name``), written by one task."""

    group: str
    entries: list[Entry]
    values: dict[str, Any]  # the objects' values, by key
    cast: DType | None = None
    name: str = ""

    @property
    def names(self) -> list[str]:
        return [self.name or f"{output_names.encode_stem(self.group)}.pt"]

    def tasks(self) -> list[Task]:
        nbytes = sum(e.numel * _out_dtype(e.dtype, self.cast).itemsize for e in self.tensors)
        return [Task(self.names, self.tensors, nbytes, self.write, self.split)]

    @property
    def tensors(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "tensor"]

    def write(self, output: AtomicOutput, copier: Copier) -> list[WrittenFile]:
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
        return [self._written(name, size)]

    def split(self, open_file: OpenRanges, n: int) -> Split:
        """The file as ``n`` runs of consecutive storages of about equal bytes, each written
        at its place: the same bytes as :meth:`write`, by ``n`` workers."""
        name = self.names[0]
        structure, streamed = _structure(self.entries, self.values, self.cast)
        archive = torch_save.RangedZip(structure, output_names.encode_stem(self.group))
        file = open_file(name, archive.size)
        try:
            if not file.joined:  # the pickle and small records: the rank that opened it
                archive.write_records(file)
        except BaseException:
            file.close()
            raise
        storages = archive.streamed
        slots = archive.slots

        def write(run: range, copier: Copier) -> None:
            for i in run:
                slot = slots[storages[i]]
                archive.write_storage(file, storages[i], copier.checked(streamed[id(slot)]))

        def finish(learned: list[Any]) -> list[WrittenFile]:
            size = archive.finish(file, learned)
            file.close()
            return [self._written(name, size)]

        runs = work.consecutive_runs([slots[i].nbytes for i in storages], n)
        parts = [
            Part(
                [streamed[id(slots[storages[i]])] for i in run],
                sum(slots[storages[i]].nbytes for i in run),
                functools.partial(write, run),
            )
            for run in runs
        ]
        return Split(file, parts, archive.crcs, finish, file.close)

    def _written(self, name: str, size: int) -> WrittenFile:
        objects = sum(e.kind == "object" for e in self.entries)
        return WrittenFile(name, size, len(self.entries) - objects, objects)


def _plan_torch(
    group: str, entries: list[Entry], values: dict[str, Any], cast: DType | None
) -> _TorchPlan:
    """The torch.save plan of ``group``, its paths checked to nest."""
    plan = _TorchPlan(group, entries, values, cast)
    _structure_paths(entries)  # clashing paths refused before anything is read or written
    return plan


def _structure(
    entries: list[Entry], values: dict[str, Any], cast: DType | None
) -> tuple[Any, dict[int, Entry]]:
    """The group's nested value with tensors as slots (filled later) and objects as pickled;
    each entry's path inside its group's file is :attr:`Entry.inner_path` (a group that is
    itself a leaf: its own; the model's own keys for a model kept under another key)."""
    streamed: dict[int, Entry] = {}
    items = []
    with paused_gc():  # an object or two per entry, no cycle: see paused_gc
        for entry in entries:
            if entry.kind == "object":
                value = values[entry.key]
            else:
                value = torch_save.TensorSlot(_out_dtype(entry.dtype, cast), entry.shape)
                streamed[id(value)] = entry
            items.append((entry.inner_path, value))
        nested = nest(items)
    if len(entries) == 1 and len(entries[0].path) == 1 and entries[0].model_depth is None:
        nested = next(iter(nested.values()))  # a group that is itself a leaf
    return nested, streamed


def _structure_paths(entries: list[Entry]) -> None:
    """Check that the group's paths nest without clashes (see :func:`state_dict.nest`)."""
    nest([(e.inner_path, None) for e in entries])


@dataclass
class _SafetensorsPlan(_Plan):
    """A group as safetensors shards (one task each), their index when more than one, and the
    ``<group>.objects.pt`` side file for its non-tensor entries; ``transformers``: the index as
    ``save_pretrained`` writes it (keys sorted, a final newline)."""

    group: str
    shards: list[list[tuple[safetensors_writer.SafetensorsItem, Entry]]]
    objects: list[Entry]
    values: dict[str, Any]
    transformers: bool = False

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

    def tasks(self) -> list[Task]:
        tasks = []
        if self.shards[0]:
            for name, shard in zip(self.tensor_names, self.shards, strict=True):
                write = functools.partial(self._write_shard, name, shard)
                split = functools.partial(self._split_shard, name, shard)
                nbytes = sum(item.nbytes for item, _ in shard)
                tasks.append(Task([name], [entry for _, entry in shard], nbytes, write, split))
        if len(self.shards) > 1:
            index = f"{self.stem}.safetensors.index.json"
            write = functools.partial(_write_bytes, index, self._index_bytes())
            tasks.append(Task([index], [], 0, write))
        if self.objects:
            side = _TorchPlan(self.group, self.objects, self.values, name=f"{self.stem}.objects.pt")
            tasks += side.tasks()
        return tasks

    @staticmethod
    def _write_shard(
        name: str,
        shard: list[tuple[safetensors_writer.SafetensorsItem, Entry]],
        output: AtomicOutput,
        copier: Copier,
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

    @staticmethod
    def _split_shard(
        name: str,
        shard: list[tuple[safetensors_writer.SafetensorsItem, Entry]],
        open_file: OpenRanges,
        n: int,
    ) -> Split:
        """The shard as ``n`` runs of consecutive tensors of about equal bytes, each written at
        its offsets: the same bytes as :meth:`_write_shard`, by ``n`` workers."""
        items = [item for item, _ in shard]
        header = safetensors_writer.header_bytes(items, metadata={"format": "pt"})
        starts = safetensors_writer.data_starts(header, items)
        size = len(header) + sum(item.nbytes for item in items)
        file = open_file(name, size)
        try:
            if not file.joined:  # the header: the rank that opened it
                file.write_at(0, header)
        except BaseException:
            file.close()
            raise

        def write(run: range, copier: Copier) -> None:
            for i in run:
                item, entry = shard[i]
                safetensors_writer.write_item(file.writer_at(starts[i]), item, copier(entry))

        def finish(_learned: list[Any]) -> list[WrittenFile]:
            file.close()
            return [WrittenFile(name, size, len(shard), 0)]

        parts = [
            Part(
                [shard[i][1] for i in run],
                sum(items[i].nbytes for i in run),
                functools.partial(write, run),
            )
            for run in work.consecutive_runs([item.nbytes for item in items], n)
        ]
        return Split(file, parts, lambda: None, finish, file.close)

    def _index_bytes(self) -> bytes:
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
        if self.transformers:
            return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        return json.dumps(index, indent=2).encode()


def _plan_safetensors(
    group: str,
    entries: list[Entry],
    values: dict[str, Any],
    limit: int | None,
    cast: DType | None,
    *,
    transformers: bool = False,
) -> _SafetensorsPlan:
    """The safetensors plan of ``group``: tensors in order, a new shard whenever the next would
    take the current one past ``limit`` bytes. With ``transformers``, as ``save_pretrained``
    does: a tensor larger than ``limit`` gets a shard of its own (the current one goes on), and
    each shard's tensors are in the order the safetensors library stores them."""
    shards: list[list[tuple[safetensors_writer.SafetensorsItem, Entry]]] = [[]]
    size = 0
    tensors = [e for e in entries if e.kind == "tensor"]
    names = output_names.safetensors_names({e.key: e.inner_path for e in tensors})
    objects = [e for e in entries if e.kind == "object"]
    _structure_paths(objects)
    for entry in tensors:
        item = safetensors_writer.SafetensorsItem(
            names[entry.key], _out_dtype(entry.dtype, cast), entry.shape
        )
        if transformers and limit is not None and item.nbytes > limit:
            shards.insert(len(shards) - 1, [(item, entry)])  # before the one filling up
            continue
        if limit is not None and shards[-1] and size + item.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((item, entry))
        size += item.nbytes
    if transformers:
        if not shards[-1] and len(shards) > 1:
            shards.pop()  # the shard being filled when the last tensor went alone
        shards = [sorted(shard, key=_library_order) for shard in shards]
    return _SafetensorsPlan(group, shards, objects, values, transformers)


#: The safetensors library's dtypes in its ``Dtype`` enum order: ``save_file`` stores a file's
#: tensors by dtype, last of these first, then by name.
_LIBRARY_DTYPES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16",
    "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip


def _library_order(pair: tuple[safetensors_writer.SafetensorsItem, Entry]) -> tuple:
    """Where ``safetensors.torch.save_file`` puts a tensor in its file (dtype, then name)."""
    item = pair[0]
    code = item.dtype.safetensors
    rank = _LIBRARY_DTYPES.index(code) if code in _LIBRARY_DTYPES else len(_LIBRARY_DTYPES)
    return -rank, item.name
