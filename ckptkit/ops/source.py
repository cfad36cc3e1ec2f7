"""What operations need of a checkpoint: its catalog, a reader over its storage, where it is.

Operations (convert, diff, sizes, verify, state_dict, plots, browser) take a path / fsspec URL
or an open :class:`Source` and call :func:`open_source`; they never import
:mod:`ckptkit.checkpoint`. :class:`ckptkit.Checkpoint` (the user-facing face: tables, reads) is
a :class:`Source`, so a checkpoint the user opened is used as it is.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from .. import formats
from ..catalog.model import Catalog, Entry
from ..errors import KeyNotFoundError
from ..formats import Detection
from ..reading import Reader
from ..storage import Storage

__all__ = ["SourceT", "Source", "open_location", "open_source"]

SourceT = TypeVar("SourceT", bound="Source")


class Source:
    """An opened checkpoint location: its :class:`Catalog` (metadata), a :class:`Reader` over
    its :class:`Storage` (bytes), and the :class:`Detection` that found its format."""

    def __init__(self, catalog: Catalog, detection: Detection, *, verify_crc: bool = True) -> None:
        self.catalog = catalog
        self.detection = detection
        self.storage = detection.storage
        self.reader = Reader(self.storage, catalog.object_globals, verify_crc=verify_crc)

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def format(self) -> str:
        return self.catalog.format

    def entry(self, key: str) -> Entry:
        """The catalog entry of ``key`` (dtype, shape, chunks and their records)."""
        try:
            return self.catalog.entries[key]
        except KeyError:
            hint = self.catalog.hint(keys=key)
            raise KeyNotFoundError(f"{self.url}: no entry {key!r} ({hint})") from None


def open_location(
    kind: type[SourceT],
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    format: str | None = None,
    cache: Literal["blocks", "files"] | None = None,
    verify_crc: bool = True,
) -> SourceT:
    """A ``kind`` (:class:`Source` or a subclass) over the checkpoint at ``url``: the format
    detected (or forced by ``format``) and described, reading only metadata. The one place a
    location is opened; :func:`ckptkit.open` documents the arguments."""
    storage = Storage(url, storage_options, cache=cache)
    detection = formats.detect(storage, format)
    return kind(formats.describe(detection), detection, verify_crc=verify_crc)


def open_source(
    src: str | Source,
    storage_options: dict[str, Any] | None = None,
    *,
    format: str | None = None,
    cache: Literal["blocks", "files"] | None = None,
    verify_crc: bool = True,
) -> Source:
    """``src`` itself when it is already open (a :class:`Source`, e.g. a
    :class:`ckptkit.Checkpoint`), else the location ``src`` opened (see :func:`open_location`);
    the other arguments apply only to opening."""
    if isinstance(src, Source):
        return src
    return open_location(
        Source,
        src,
        storage_options=storage_options,
        format=format,
        cache=cache,
        verify_crc=verify_crc,
    )
