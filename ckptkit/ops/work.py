"""Running a plan's work items: on one thread, on ``workers`` threads, across the ranks of a
process group.

Operations (unshard, convert, verify, diff) first compute a deterministic plan, a list of
:class:`WorkItem` (what to do, and how many bytes it moves); this module decides which items
this process runs and runs them. Every rank computes the same plan, so assignment needs no
communication: :func:`ckptkit.distributed.balance` spreads items over ranks by bytes. Within a
process, items run largest first on a thread pool (reads, zlib, hashing and numpy release the
GIL); the first error stops the others at their next block and is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ..errors import UsageError

if TYPE_CHECKING:
    from .distributed import Ranks

__all__ = [
    "T",
    "R",
    "WorkItem",
    "Cancelled",
    "Stop",
    "check_workers",
    "consecutive_runs",
    "mine",
    "run",
    "run_everywhere",
    "PerThread",
]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class WorkItem(Generic[T]):
    """One unit of a plan: ``task`` (what the operation does with it) and the bytes it moves."""

    index: int
    nbytes: int
    task: T


class Cancelled(Exception):
    """Raised inside a worker when another worker failed: stop, the job is failing anyway."""


class Stop:
    """A flag workers check between blocks (:meth:`check`) so one failure ends the job soon."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled


def check_workers(workers: int) -> int:
    """``workers`` validated: a positive int (threads in this process)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UsageError(f"workers must be a positive integer, not {workers!r}")
    return workers


def consecutive_runs(sizes: Sequence[int], n: int) -> list[range]:
    """``sizes`` cut into at most ``n`` runs of consecutive indices of about equal total (each
    run ends once it reaches its share), none empty: a file's tensors for ``n`` writers."""
    total = sum(sizes)
    runs, start, done = [], 0, 0
    for i, size in enumerate(sizes):
        done += size
        if done * n >= total * (len(runs) + 1) and len(runs) < n - 1:
            runs.append(range(start, i + 1))
            start = i + 1
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def mine(items: Sequence[WorkItem], ranks: Ranks | None) -> list[WorkItem]:
    """The items this process runs: all of them, or this rank's share balanced by bytes
    (logged per rank with ``CKPTKIT_RANK_LOGS``)."""
    if ranks is None:
        return list(items)
    from .distributed import balance, rank_logger

    owners = balance([item.nbytes for item in items], ranks.world_size)
    share = [item for item, owner in zip(items, owners, strict=True) if owner == ranks.rank]
    rank_logger(ranks).info(
        "%d of %d work items, %d of %d bytes",
        len(share),
        len(items),
        sum(item.nbytes for item in share),
        sum(item.nbytes for item in items),
    )
    return share


def run(
    items: Sequence[WorkItem[T]],
    work: Callable[[WorkItem[T], Stop], R],
    *,
    workers: int = 1,
    stop: Stop | None = None,
) -> dict[int, R]:
    """``work(item, stop)`` for every item: in plan order on one thread, largest first on
    ``workers`` threads; results by item index. The first error sets ``stop`` (workers raise
    :class:`Cancelled` at their next check), waits for the running items to end, and is
    raised."""
    stop = stop or Stop()
    if check_workers(workers) == 1 or len(items) <= 1:
        return {item.index: work(item, stop) for item in items}
    ordered = sorted(items, key=lambda item: (-item.nbytes, item.index))
    results: dict[int, R] = {}
    with ThreadPoolExecutor(min(workers, len(ordered)), thread_name_prefix="ckptkit") as pool:
        futures = {pool.submit(work, item, stop): item for item in ordered}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            stop.set()
            for future in futures:
                future.cancel()
            wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            first = next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
            raise first
        for future, item in futures.items():
            results[item.index] = future.result()
    return results


def run_everywhere(
    items: Sequence[WorkItem[T]],
    work: Callable[[WorkItem[T], Stop], R],
    *,
    workers: int = 1,
    ranks: Ranks | None = None,
    what: str = "the work",
) -> dict[int, R]:
    """:func:`run` on this process's share (:func:`mine`); with ``ranks``, every rank then
    agrees (one failure raises on all) and gets every rank's results, so each returns the
    same as a single process would."""
    if ranks is None:
        return run(items, work, workers=workers)
    error, results = None, {}
    try:
        results = run(mine(items, ranks), work, workers=workers)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    ranks.agree(error, what)
    merged: dict[int, R] = {}
    for part in ranks.all_gather(results):
        merged.update(part)
    return merged


class PerThread(Generic[R]):
    """One ``make()`` per worker thread (readers keep caches that belong to one thread)."""

    def __init__(self, make: Callable[[], R]) -> None:
        self._make = make
        self._local = threading.local()

    def get(self) -> R:
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = self._make()
        return value
