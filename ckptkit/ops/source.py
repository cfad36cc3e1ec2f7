"""What operations need of a checkpoint: its catalog, a reader over its storage, where it is.

Operations (convert, diff, sizes, verify, state_dict, plots, browser) take a path / fsspec URL
or an open :class:`Source` and call :func:`open_source`; they never import
:mod:`ckptkit.checkpoint`. :class:`ckptkit.Checkpoint` (the user-facing face: tables, reads) is
a :class:`Source`, so a checkpoint the user opened is used as it is.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from .. import formats
from ..catalog.model import Catalog, Entry
from ..errors import KeyNotFoundError
from ..formats import Detection
from ..reading import Reader
from ..storage import Storage

__all__ = ["SourceT", "Source", "open_location", "open_source", "select_entries"]

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
    allow_roots: Sequence[str | os.PathLike[str]] | None = None,
) -> SourceT:
    """A ``kind`` (:class:`Source` or a subclass) over the checkpoint at ``url``: the format
    detected (or forced by ``format``) and described, reading only metadata. The one place a
    location is opened; :func:`ckptkit.open` documents the arguments."""
    storage = Storage(url, storage_options, cache=cache, allow_roots=allow_roots)
    detection = formats.detect(storage, format)
    return kind(formats.describe(detection), detection, verify_crc=verify_crc)


def open_source(
    src: str | Source,
    storage_options: dict[str, Any] | None = None,
    *,
    format: str | None = None,
    cache: Literal["blocks", "files"] | None = None,
    verify_crc: bool = True,
    allow_roots: Sequence[str | os.PathLike[str]] | None = None,
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
        allow_roots=allow_roots,
    )


def select_entries(
    source: Source,
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    *,
    exclude: Sequence[str] | str | None = None,
    what: str = "key",
) -> list[Entry]:
    """The entries ``keys`` globs and ``groups`` select (see :meth:`Catalog.select`), less those
    ``exclude`` globs match. A group, key glob or exclude glob that matches nothing raises
    :class:`KeyNotFoundError` naming it, with the groups there are and the closest keys
    (:meth:`Catalog.hint`): a mistyped name must never give an empty or unfiltered result.
    ``what`` names the entries in messages (``"no tensor matches …"``)."""
    catalog = source.catalog
    key_list = [keys] if isinstance(keys, str) else list(keys or ())
    group_list = [groups] if isinstance(groups, str) else list(groups or ())
    excluded = [exclude] if isinstance(exclude, str) else list(exclude or ())
    present = {e.group for e in catalog.entries.values()}
    for group in group_list:
        if group not in present:
            raise KeyNotFoundError(f"{source.url}: no group {group!r} ({catalog.hint()})")
    in_groups = catalog.select(None, groups) if groups is not None else catalog.entries.values()
    for pattern in key_list:
        if not any(fnmatch.fnmatchcase(e.key, pattern) for e in in_groups):
            where = f" in groups {group_list}" if groups is not None else ""
            raise KeyNotFoundError(
                f"{source.url}: no {what}{where} matches {pattern!r} ({catalog.hint(pattern)})"
            )
    selected = catalog.select(keys, groups)
    for pattern in excluded:
        if not any(fnmatch.fnmatchcase(e.key, pattern) for e in selected):
            raise KeyNotFoundError(
                f"{source.url}: exclude={pattern!r} matches no selected {what} "
                f"({catalog.hint(pattern)})"
            )
    if (keys is not None or groups is not None) and not selected:
        raise KeyNotFoundError(
            f"{source.url}: nothing matches keys={keys!r} groups={groups!r} "
            f"({catalog.hint(keys, groups)})"
        )
    return [e for e in selected if not any(fnmatch.fnmatchcase(e.key, p) for p in excluded)]
