"""Checkpoints made of checkpoints: a trainer's output folder whose sub-folders are DCP
checkpoints of their own (Accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``), described
as ONE catalog by putting each part's entries under a group of the whole (``model``, ``optim``),
their records re-rooted at the folder (``optimizer_0/__0_0.distcp``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ...catalog.model import Entry
from ...errors import FormatError
from ...storage import Store
from .dcp_metadata import read_dcp

__all__ = ["DcpPart", "regroup", "read_dcp_part"]


@dataclasses.dataclass(frozen=True)
class DcpPart:
    """A DCP sub-folder described as part of a whole: its entries under the part's group, its
    data files and its facts (``metadata_files``, ``version``…), names relative to the whole."""

    folder: str
    group: str
    entries: list[Entry]
    files: list[str]
    facts: dict[str, Any]


def read_dcp_part(storage: Store, folder: str, group: str) -> DcpPart:
    """The DCP in the sub-folder ``folder`` of ``storage``, from its metadata alone, its
    entries under ``group`` (see :func:`regroup`)."""
    entries, files, facts = read_dcp(storage.child(folder), prefix=f"{folder}/")
    return DcpPart(folder, group, regroup(entries, group, storage.describe(folder)), files, facts)


def regroup(entries: Iterable[Entry], group: str, source: str) -> list[Entry]:
    """``entries`` of a part under ``group``: a part whose entries share one top-level key
    (Accelerate's ``optimizer``) has that key replaced (``optimizer.state.w.exp_avg`` →
    ``optim.state.w.exp_avg``), any other part is put below ``group`` whole. A key that does
    not spell its path (no part written by torch has one) is refused, naming it."""
    entries = list(entries)
    tops = {entry.path[0] for entry in entries}
    keep = 1 if len(tops) == 1 else 0
    out = []
    for entry in entries:
        if entry.key != ".".join(map(str, entry.path)):
            raise FormatError(f"{source}: key {entry.key!r} does not spell its path {entry.path}")
        path = (group, *entry.path[keep:])
        key = ".".join(map(str, path))
        out.append(dataclasses.replace(entry, key=key, path=path, model_depth=None))
    return out
