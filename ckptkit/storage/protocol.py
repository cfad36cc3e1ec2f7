"""The narrow interfaces the upper layers need: :class:`Store`, what formats and operations call
on a checkpoint location (a :class:`~ckptkit.storage.Storage`), and :class:`Output`, what they
call on an :class:`~ckptkit.storage.AtomicOutput`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, Protocol, runtime_checkable

__all__ = ["Output", "RangedOutput", "Store"]


@runtime_checkable
class Store(Protocol):
    """A checkpoint location as formats and operations use it: names relative to it, exact
    byte ranges, sizes and listings; every name checked, every read bounded
    (:class:`~ckptkit.storage.Storage` is the implementation; see its methods)."""

    #: The location as the user gave it (a local path or an fsspec URL).
    url: str
    #: Its filesystem path (no protocol), under which every name resolves.
    root: str

    # -- naming ------------------------------------------------------------------------------

    def child(self, rel: str) -> Store:
        """The sub-directory ``rel`` as a location of its own."""
        ...

    def parent(self) -> tuple[Store, str]:
        """The containing directory, and this location's name in it."""
        ...

    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel``; an unsafe name raises :class:`UnsafePathError`."""
        ...

    def describe(self, rel: str = "") -> str:
        """``rel`` as the user would write it, for messages."""
        ...

    # -- listing and sizes -------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` (a file or directory) exists."""
        ...

    def isdir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a directory."""
        ...

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Names directly under ``rel`` mapped to their size in bytes (directories: -1)."""
        ...

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes."""
        ...

    def sizes(self, rels: Sequence[str]) -> dict[str, int | None]:
        """Sizes of many files, None for missing ones."""
        ...

    # -- reading -----------------------------------------------------------------------------

    def read_file(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """A whole small file, refused beyond ``max_bytes`` before anything is read."""
        ...

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Exactly the bytes of each ``(rel, start, end)``; a short read is a truncated file."""
        ...

    def open_sequential(
        self, rel: str, *, max_bytes: int | None = None
    ) -> AbstractContextManager[BinaryIO]:
        """A file object for one front-to-back pass over a whole file."""
        ...


@runtime_checkable
class Output(Protocol):
    """Files written all-or-nothing into a destination, as operations use them
    (:class:`~ckptkit.storage.AtomicOutput` is the implementation)."""

    def refuse_existing(self, names: Sequence[str]) -> None:
        """Fail before any work if a final name exists and overwriting is off."""
        ...

    def open(self, name: str) -> BinaryIO:
        """A new seekable file that will become ``name``."""
        ...

    def publish(self) -> list[tuple[str, str | None]]:
        """Every written file in place, or (on error) none; what was published."""
        ...

    def withdraw(self, published: list[tuple[str, str | None]]) -> None:
        """Take back files :meth:`publish` put in place."""
        ...

    def discard(self) -> None:
        """Remove every temporary file."""
        ...


@runtime_checkable
class RangedOutput(Protocol):
    """One output file written at offsets by several threads at once, each its own byte ranges
    (:meth:`Output.open_ranges <ckptkit.storage.AtomicOutput.open_ranges>`: a staged
    :class:`~ckptkit.storage.RangedFile`, or a multipart upload to an object store), and by
    the ranks of a job: each joins it by its :attr:`handle`, hands over what its writes left
    (:meth:`hand_over`) and the rank that publishes it takes that over (:meth:`take_over`)."""

    name: str
    #: Opened by another rank than the one that publishes it (``join_ranges``): that rank
    #: writes what is not in a part (a header).
    joined: bool

    @property
    def handle(self) -> str:
        """What another rank passes to join this file (a staged path, an upload id)."""
        ...

    def hand_over(self) -> Any:
        """Once this rank's writes are done: what the publishing rank needs of them."""
        ...

    def take_over(self, handovers: Iterable[Any]) -> None:
        """Take the other ranks' :meth:`hand_over`, before finishing the file."""
        ...

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write all of ``data`` at ``offset``."""
        ...

    def writer_at(self, offset: int) -> Callable[[bytes | memoryview], None]:
        """A ``write`` for a stream of pieces starting at ``offset``, each after the last."""
        ...

    def close(self) -> None:
        """No more writes."""
        ...
