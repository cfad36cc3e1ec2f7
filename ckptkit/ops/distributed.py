"""Coordination of a job spread over the ranks of a torch.distributed process group (torchrun).

Ranks compute the same plan, so they only need a few small collectives: :meth:`Ranks.all_gather`
and :meth:`Ranks.agree` (all-or-nothing: one rank's failure is raised on every rank, a lost rank
is an error within the timeout, never a hang). Collectives run on a gloo group over all ranks,
so they work on CPU whatever the user's default backend (NCCL included). Progress of the whole
job is counted in the process group's store and shown on rank 0. torch is imported only inside
functions: a single-process run never imports it here.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..errors import DistributedError, UsageError
from ..progress import ByteProgress

__all__ = [
    "MESSAGE_LIMIT",
    "FLUSH_BYTES",
    "FLUSH_SECONDS",
    "Ranks",
    "joined",
    "from_environment",
    "balance",
    "JobProgress",
    "rank_logger",
]

#: How much of a failing rank's error message every rank repeats (messages can be long).
MESSAGE_LIMIT = 2000
#: JobProgress batches a rank's bytes into one store update per this many bytes or seconds.
FLUSH_BYTES = 8 << 20
FLUSH_SECONDS = 0.5


@dataclass(frozen=True)
class Ranks:
    """This process's place in a process group, and ``group``: a gloo group over all ranks on
    which the CPU collectives below run. Every rank must make the same calls in the same order."""

    rank: int
    world_size: int
    group: Any

    def all_gather(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Every rank's ``value`` (picklable), indexed by rank; a lost rank raises
        :class:`DistributedError` naming ``what``."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, value, group=self.group)
        except RuntimeError as exc:  # gloo: connection closed by a dead peer, or timed out
            raise DistributedError(f"rank lost during {what}: {_first_line(exc)}") from exc
        return gathered

    def gather(self, value: Any, to: int, what: str = "gather") -> list[Any] | None:
        """Every rank's ``value`` (picklable) on rank ``to``, indexed by rank (None on the
        others): what only one rank needs, not sent to all; a lost rank raises
        :class:`DistributedError` naming ``what``."""
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        try:  # the group spans every rank in order: its ranks are the global ones
            dist.gather_object(value, gathered, dst=to, group=self.group)
        except RuntimeError as exc:  # gloo: connection closed by a dead peer, or timed out
            raise DistributedError(f"rank lost during {what}: {_first_line(exc)}") from exc
        return gathered

    def agree(self, error: BaseException | None, what: str) -> None:
        """All-or-nothing: every rank calls it with its own outcome (``None`` for success);
        if any rank failed, every rank raises :class:`DistributedError` naming the first failing
        rank and its error (chained to the local error on a rank that failed itself)."""
        report = None if error is None else _report(error)
        try:
            reports = self.all_gather(report, what)
        except DistributedError as lost:
            if error is not None:
                raise DistributedError(
                    f"{lost} (this rank had failed too: {report[0]}: {report[1]})"
                ) from error
            raise
        failures = [(rank, *found) for rank, found in enumerate(reports) if found is not None]
        if not failures:
            return
        rank, kind, message = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        failure = DistributedError(f"{what}: rank {rank} failed: {kind}: {message}{more}")
        failure.failures = failures
        raise failure from error


def _report(error: BaseException) -> tuple[str, str]:
    """What other ranks learn of a local error: its type name and (bounded) message."""
    message = str(error)
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + "…"
    return type(error).__name__, message


def _first_line(exc: BaseException) -> str:
    """A torch/gloo error, short: its first sentence without gloo's source location (gloo
    appends advice, torch a C++ stack trace)."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0] if lines else "")
    return f"{type(exc).__name__}: {text.split('. ')[0]}"


#: The :class:`Ranks` of the job this thread is inside (a :func:`joined` block), if any.
_joined: contextvars.ContextVar[Ranks | None] = contextvars.ContextVar("ckptkit_ranks")


@contextlib.contextmanager
def joined(timeout: float | None = None) -> Iterator[Ranks | None]:
    """This process's :class:`Ranks` for one job when torch.distributed is imported and
    initialised with more than one rank, else ``None`` (never imports torch).

    Entering makes a gloo group over all ranks (a collective: every rank enters), with
    ``timeout`` seconds for its collectives (``None``: torch's default); leaving destroys it,
    so nothing of ckptkit's outlives the job: a group still referenced when the interpreter
    shuts down can abort the process from gloo's threads. Inside a block, a nested ``joined``
    yields the outer block's ranks (one CLI command, one group).
    """
    outer = _joined.get(None)
    dist = sys.modules.get("torch.distributed")
    if outer is not None or dist is None or not dist.is_available() or not dist.is_initialized():
        yield outer
        return
    if dist.get_world_size() < 2:
        yield None
        return
    wait = None if timeout is None else timedelta(seconds=timeout)
    group = dist.new_group(backend="gloo", timeout=wait)
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), group)
    token = _joined.set(ranks)
    try:
        yield ranks
    finally:
        _joined.reset(token)
        if dist.is_initialized():
            with contextlib.suppress(ValueError):  # the caller destroyed it already
                dist.destroy_process_group(group)  # local: shuts gloo's threads down now


def _launched_by_torchrun() -> bool:
    """The environment torchrun (or another env:// launcher) gives each of several ranks."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world_size > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


@contextlib.contextmanager
def from_environment(timeout: float = 1800) -> Iterator[Ranks | None]:
    """For the CLI: under torchrun, a gloo process group initialised from the environment
    (destroyed on exit) and the :func:`joined` ranks of the command; an already initialised
    group is used as is; outside torchrun ``None``, without importing torch."""
    if not _launched_by_torchrun():
        with joined(timeout) as ranks:
            yield ranks
        return
    import torch.distributed as dist

    if dist.is_initialized():
        with joined(timeout) as ranks:
            yield ranks
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    try:
        with joined(timeout) as ranks:
            yield ranks
    finally:
        dist.destroy_process_group()


def balance(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank of each item, spreading bytes evenly and deterministically: largest item first
    (ties by index) onto the least loaded rank (ties by lowest rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be a positive integer, not {world_size!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise UsageError("item sizes must be non-negative integers")
    import heapq

    loads = [(0, rank) for rank in range(world_size)]  # a heap: (bytes, rank), least first
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


class JobProgress:
    """One progress bar for a whole job (bytes done by every rank), shown on rank 0.

    Single process: a :class:`~ckptkit.progress.ByteProgress`. Distributed: each rank adds its
    bytes, batched, to a counter in the process group's store; a daemon thread on rank 0 polls it
    into the bar. Constructing it is a collective (the ranks agree on a job id). On leaving,
    rank 0 waits for the other ranks to finish while their bytes still arrive (``stall`` seconds
    without news ends the wait).
    """

    def __init__(
        self, total: int, enabled: bool, desc: str, ranks: Ranks | None, *, stall: float = 60.0
    ) -> None:
        self.ranks = ranks
        self.stall = stall
        self._lock = threading.Lock()
        self._local = 0  # bytes this process reported
        self._pending = 0  # of those, bytes not yet added to the store
        self._seen = 0  # the job-wide total last read from the store
        self._last_flush = time.monotonic()
        self._closed = False
        self._store = None
        self._store_lost = False
        show = enabled and (ranks is None or ranks.rank == 0)
        self._bar = ByteProgress(total, show, desc)
        if ranks is None:
            return
        job = ranks.all_gather(uuid.uuid4().hex if ranks.rank == 0 else None, "progress")[0]
        self._key = f"ckptkit/progress/{job}"
        self._store = _default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="ckptkit-progress", daemon=True)
        self._thread.start()

    def __enter__(self) -> JobProgress:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        self.close(failed=kind is not None)

    @property
    def done(self) -> int:
        """Bytes done by the whole job as this process last saw them (rank 0 polls the store;
        a single process counts its own)."""
        return self._local if self._store is None else self._seen

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more done (thread-safe, any rank)."""
        with self._lock:
            self._local += nbytes
            if self._store is None:
                self._bar.update(nbytes)
                return
            self._pending += nbytes
            due = (
                self._pending >= FLUSH_BYTES or time.monotonic() - self._last_flush >= FLUSH_SECONDS
            )
        if due:
            self._flush()

    def close(self, failed: bool = False) -> None:
        """Send this rank's last bytes and say it finished; on rank 0 wait (unless ``failed``)
        for the other ranks, then show the final total and close the bar."""
        if self._closed:
            return
        self._closed = True
        if self._store is not None:
            self._stop.set()
            self._thread.join()
            self._flush()
            self._store_add("finished", 1)
            if self.ranks.rank == 0 and not failed:
                self._wait_for_ranks()
            self._poll()
        self._bar.__exit__(None, None, None)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, 0
            self._last_flush = time.monotonic()
        if pending:
            self._store_add("bytes", pending)

    def _poll(self) -> None:
        total = self._store_add("bytes", 0)
        if total is not None and total > self._seen:
            if self.ranks.rank == 0:
                self._bar.update(total - self._seen)
            self._seen = total

    def _tick(self) -> None:
        """The daemon thread: send batched bytes on every rank, poll the total on rank 0."""
        while not self._stop.wait(FLUSH_SECONDS):
            self._flush()
            if self.ranks.rank == 0:
                self._poll()

    def _wait_for_ranks(self) -> None:
        """Poll until every rank finished, or nothing moved for ``stall`` seconds (a rank
        died: the agreement that follows reports it)."""
        last_change, last_seen = time.monotonic(), self._seen
        while (self._store_add("finished", 0) or 0) < self.ranks.world_size:
            self._poll()
            if self._store_lost:
                return
            if self._seen != last_seen:
                last_change, last_seen = time.monotonic(), self._seen
            elif time.monotonic() - last_change > self.stall:
                return
            time.sleep(0.05)

    def _store_add(self, name: str, amount: int) -> int | None:
        """``store.add`` on this job's key (atomic; 0 reads); ``None`` once the store is lost
        (a dead rank 0 can take it along): progress is cosmetic, the job's collectives report
        the failure."""
        if self._store is None or self._store_lost:
            return None
        try:
            return int(self._store.add(f"{self._key}/{name}", amount))
        except Exception as exc:  # a closed TCPStore: DistStoreError, RuntimeError, OSError
            logging.getLogger(__name__).debug("progress store lost: %s", exc)
            self._store_lost = True
            return None


def _default_store() -> Any:
    """The default process group's store (the TCPStore torchrun or init_process_group made)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class _RankTag(logging.Filter):
    """Marks every record with ``rank_tag`` ("[rank r/w host]") and prefixes its message."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "rank_tag", None) is None:
            record.rank_tag = self.tag
            record.msg = f"{self.tag.replace('%', '%%')} {record.msg}"
        return True


def rank_logger(ranks: Ranks | None) -> logging.Logger:
    """The ``ckptkit.distributed`` logger, its records tagged "[rank r/w host]". With
    ``CKPTKIT_RANK_LOGS=1`` every rank logs INFO to stderr; with a directory path there, to one
    file per rank in it (``rank{r}.log``)."""
    rank, world_size = (0, 1) if ranks is None else (ranks.rank, ranks.world_size)
    logger = logging.getLogger("ckptkit.distributed")
    for old in [f for f in logger.filters if isinstance(f, _RankTag)]:
        logger.removeFilter(old)
    logger.addFilter(_RankTag(f"[rank {rank}/{world_size} {socket.gethostname()}]"))
    for old in [h for h in logger.handlers if getattr(h, "ckptkit_rank_log", False)]:
        logger.removeHandler(old)
        old.close()
        logger.setLevel(logging.NOTSET)  # the level this function had raised to INFO
    wanted = os.environ.get("CKPTKIT_RANK_LOGS", "").strip()
    if wanted in ("", "0"):
        return logger
    if wanted == "1":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        folder = Path(wanted)
        folder.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(folder / f"rank{rank}.log")
    handler.ckptkit_rank_log = True
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger
