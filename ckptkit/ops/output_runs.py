"""Running the output tasks of a plan (:mod:`.output_plans`): this process's share on threads,
every rank's into an output staged on every rank and published only when all succeeded, and
the files every rank wrote gathered in plan order.

A file larger than a worker's share is written as byte ranges by several workers: the threads
of its process, and the ranks too (one stages it or starts its multipart upload and publishes
it, every rank opens it and writes its parts; see :func:`run_tasks`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import tunables
from ..dtypes import DType
from ..errors import DistributedError
from ..storage import AtomicOutput, RangedOutput, Storage, atomic_output
from . import distributed, work
from .output_plans import Copier, Part, Split, Task, WrittenFile
from .source import Source

if TYPE_CHECKING:
    from .distributed import Ranks

__all__ = ["gathered", "run_tasks", "staged"]


@contextlib.contextmanager
def staged(destination: Storage, overwrite: bool, ranks: Ranks | None) -> Iterator[AtomicOutput]:
    """An :class:`AtomicOutput` for this process, committed only when the block succeeded on
    every rank: each rank stages its own files, all agree, each publishes its own, all agree
    again, and a failure anywhere takes back what any rank published."""
    if ranks is None:
        with atomic_output(destination, overwrite=overwrite) as output:
            yield output
        return
    output = AtomicOutput(destination, overwrite=overwrite)
    agreed_failure = False
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
    except DistributedError as exc:
        agreed_failure = exc.failures is not None  # then every rank raises it, here
        raise
    finally:
        output.discard()
        if agreed_failure:  # a folder made for the output held other ranks' staging folders
            with contextlib.suppress(DistributedError):
                ranks.all_gather(None, "removing the staging folders")
            output.remove_created_folders()


def gathered(written: dict[int, list[WrittenFile]], ranks: Ranks | None) -> list[WrittenFile]:
    """Every rank's written files, in plan order (the order a single process writes them)."""
    if ranks is not None:
        merged: dict[int, list[WrittenFile]] = {}
        for part in ranks.all_gather(written):
            merged.update(part)
        written = merged
    return [file for index in sorted(written) for file in written[index]]


def run_tasks(
    tasks: list[Task],
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
        lambda: Copier(source.reader.fresh() if fresh else source.reader, cast, bar, stop)
    )

    log = distributed.rank_logger(ranks)

    def write(item: work.WorkItem[Task | Part], _stop: work.Stop) -> list[WrittenFile] | None:
        copier = copiers.get()
        copier.reader.read_ahead(item.task.entries)  # small tensors: many per batch of reads
        if isinstance(item.task, Part):
            item.task.write(copier)
            return None
        log.info("writing %s (%d bytes)", ", ".join(item.task.names), item.nbytes)
        written = item.task.write(output, copier)
        log.info("wrote %s", ", ".join(item.task.names))
        return written

    shared = _shared_files(items, ranks, output)
    share = work.mine([item for item in items if item.index not in shared], ranks)
    splits: dict[int, Split] = {}
    results: dict[int, list[WrittenFile] | None] = {}
    try:
        units = _open_shared(shared, items, ranks, output, workers, splits, log)
        error = None
        handed: dict[int, Any] = {}  # what this rank's writes left for a shared file's owner
        try:
            units += _split_large(share, len(items) + len(units), output, workers, splits, log)
            results = work.run(units, write, workers=workers, stop=stop)
            if ranks is not None:
                handed = {
                    i: splits[i].file.hand_over() for i, o in shared.items() if o != ranks.rank
                }
        except Exception as exc:
            if not shared:
                raise
            error = exc  # the other ranks learn of it before anything else is called
        learned = {index: [split.learned()] for index, split in splits.items()}
        if shared:  # every rank's parts are done before the file's owner finishes it
            assert ranks is not None
            learned.update(_gather_shared(shared, splits, handed, error, ranks))
        for index, split in splits.items():
            if index not in shared or (ranks is not None and shared[index] == ranks.rank):
                results[index] = split.finish(learned[index])
    finally:
        for split in splits.values():
            split.close()
    return {index: files for index, files in results.items() if files is not None}


def _gather_shared(
    shared: dict[int, int],
    splits: dict[int, Split],
    handed: dict[int, Any],
    error: BaseException | None,
    ranks: Ranks,
) -> dict[int, list[Any]]:
    """Once every rank wrote its parts of the shared files (or failed: then every rank
    raises): what each rank's parts learned, by file; the owner of each file takes over what
    the other ranks' writes left (:meth:`RangedOutput.hand_over`)."""
    ranks.agree(error, "writing the files the ranks share")
    found = ranks.all_gather({i: splits[i].learned() for i in shared}, "the shared files")
    received = {}  # what the other ranks handed over of the files this rank owns
    for index, owner in shared.items():  # every gather first: the same calls on every rank
        handovers = ranks.gather(handed.get(index), owner, "what the ranks wrote of a file")
        if handovers is not None:
            received[index] = [h for rank, h in enumerate(handovers) if rank != owner]
    for index, handovers in received.items():
        splits[index].file.take_over(handovers)
    return {index: [part[index] for part in found] for index in shared}


def _shared_files(
    items: list[work.WorkItem[Task]], ranks: Ranks | None, output: AtomicOutput
) -> dict[int, int]:
    """The tasks whose one file every rank writes byte ranges of, and the rank that stages
    (or starts the upload of) and publishes each, in turn: under several ranks, a file
    holding more than a rank's share of the bytes (and at least
    :data:`~ckptkit.tunables.SPLIT_FILE_BYTES`), into a local destination (a file system every
    rank sees) or as a multipart upload to an object store. The same on every rank."""
    if ranks is None or ranks.world_size == 1:
        return {}
    total = sum(item.nbytes for item in items)
    indices = [
        item.index
        for item in items
        if item.task.split is not None
        and item.nbytes >= tunables.SPLIT_FILE_BYTES
        and item.nbytes * ranks.world_size > total
        and (output.local or output.uploads(item.nbytes))
    ]
    return {index: n % ranks.world_size for n, index in enumerate(indices)}


def _open_shared(
    shared: dict[int, int],
    items: list[work.WorkItem[Task]],
    ranks: Ranks | None,
    output: AtomicOutput,
    workers: int,
    splits: dict[int, Split],
    log: logging.Logger,
) -> list[work.WorkItem[Task | Part]]:
    """Open the files the ranks share, collectively (every rank calls it): the owner of each
    stages it (or starts its upload) and tells the others its handle; every rank then opens it
    too and takes its parts of ``world_size * workers``, balanced by bytes (numbered after the
    tasks). The splits are recorded in ``splits``; a failure on any rank fails every rank."""
    if not shared:
        return []
    assert ranks is not None
    n_parts = ranks.world_size * workers
    owned: dict[int, str] = {}  # the handles of the files this rank owns, by task index

    def open_own(index: int, name: str, size: int) -> RangedOutput:
        file = output.open_ranges(name, size)
        owned[index] = file.handle
        return file

    error = None
    try:
        for index, owner in shared.items():
            if owner == ranks.rank:
                own = functools.partial(open_own, index)
                splits[index] = items[index].task.split(own, n_parts)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    ranks.agree(error, "staging the files the ranks share")
    handles = {
        i: h for part in ranks.all_gather(owned, "the shared files") for i, h in part.items()
    }
    try:
        for index, owner in shared.items():
            if owner != ranks.rank:
                join = functools.partial(_join, output, handles[index])
                splits[index] = items[index].task.split(join, n_parts)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    ranks.agree(error, "opening the files the ranks share")
    units: list[work.WorkItem[Task | Part]] = []
    next_index = len(items)
    for index in shared:
        parts = splits[index].parts
        owners = distributed.balance([part.nbytes for part in parts], ranks.world_size)
        mine = [part for part, rank in zip(parts, owners, strict=True) if rank == ranks.rank]
        log.info(
            "writing %d of the %d parts of %s (shared by the ranks)",
            len(mine), len(parts), items[index].task.names[0],
        )  # fmt: skip
        for part in mine:
            units.append(work.WorkItem(next_index, part.nbytes, part))
            next_index += 1
    return units


def _join(output: AtomicOutput, handle: str, name: str, size: int) -> RangedOutput:
    """``output.join_ranges`` with the handle first (for :func:`functools.partial`)."""
    return output.join_ranges(name, handle, size)


def _split_large(
    share: list[work.WorkItem[Task]],
    next_index: int,
    output: AtomicOutput,
    workers: int,
    splits: dict[int, Split],
    log: logging.Logger,
) -> list[work.WorkItem[Task | Part]]:
    """This process's work units: each task whole, except that with several ``workers`` a
    file holding more than a worker's share of the bytes (and at least
    :data:`~ckptkit.tunables.SPLIT_FILE_BYTES`) is opened at its full size and written as
    parts, one per worker, at once (recorded in ``splits`` by task index, to finish; the
    parts numbered from ``next_index``). A file going up to an object store in parts
    (:meth:`AtomicOutput.uploads`) is opened that way too, in one part with one worker."""
    share_bytes = sum(item.nbytes for item in share)
    units: list[work.WorkItem[Task | Part]] = []
    index = next_index
    for item in share:
        task = item.task
        spread = (
            workers > 1
            and item.nbytes >= tunables.SPLIT_FILE_BYTES
            and item.nbytes * workers > share_bytes
        )
        if task.split is None or not (spread or output.uploads(item.nbytes)):
            units.append(item)
            continue
        split = splits[item.index] = task.split(output.open_ranges, workers if spread else 1)
        log.info("writing %s as %d parts (%d bytes)", task.names[0], len(split.parts), item.nbytes)
        for part in split.parts:
            units.append(work.WorkItem(index, part.nbytes, part))
            index += 1
    return units
