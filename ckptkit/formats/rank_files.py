"""Per-rank torch.save files ``rank{N}.pt`` in one directory: FSDP1 ``SHARDED_STATE_DICT``,
OLMo "legacy" / "torch_legacy" checkpoints, per-rank FSDP2 DTensors. All ranks' pieces become
one catalog (see :mod:`.parts.rank_sets`)."""

from __future__ import annotations

from ..catalog.model import Catalog, CatalogBuilder, Facts
from ..errors import FormatError, MissingFileError
from ..storage import Storage
from .detection import Detection, file_location
from .parts.fsdp_pickles import ALLOWED_GLOBALS
from .parts.rank_sets import RANK_FILE, describe_ranks, rank_files
from .parts.unfinished import check_unfinished

NAME = "rank_files"
#: OLMo writes its run config beside the rank files (rank 0, after them).
CONFIG_FILE = "config.yaml"


def detect(storage: Storage) -> Detection | None:
    """Per-rank files when the directory holds ``rank{N}.pt`` files (or one is named)."""
    located = file_location(storage)
    if located is not None:
        parent, name = located
        if not RANK_FILE.match(name):
            return None
        return Detection(
            NAME, parent, [f"{name} is one rank's file; the whole set beside it is opened"]
        )
    try:
        listing = storage.listdir()
    except MissingFileError:
        return None
    names = [name for name in listing if RANK_FILE.match(name) and listing[name] >= 0]
    if not names:
        return None
    names.sort(key=lambda name: int(RANK_FILE.match(name).group(1)))
    shown = ", ".join(names[:3]) + (f" … {names[-1]}" if len(names) > 3 else "")
    evidence = [f"per-rank torch.save files {shown}"]
    if CONFIG_FILE in listing:
        evidence.append(f"{CONFIG_FILE} (OLMo)")
    return Detection(NAME, storage, evidence)


def describe(storage: Storage, files: list[str] | None = None) -> Catalog:
    """One catalog over every ``rank{N}.pt`` in the directory (``files`` is ignored: one rank
    of a sharded set cannot be read on its own)."""
    listing = storage.listdir()
    by_rank = rank_files(storage, listing)
    if not by_rank:
        raise FormatError(f"{storage.describe()}: no rank{{N}}.pt files")
    ranks = describe_ranks(storage, by_rank, {name: listing[name] for name in by_rank.values()})
    builder = CatalogBuilder(NAME, object_globals=ALLOWED_GLOBALS)
    builder.add_files(by_rank.values())
    builder.add_all(ranks.entries.values(), source=storage.describe())
    return builder.build(
        Facts(
            world_size=ranks.world_size,
            rank_files=tuple(by_rank.values()),
            sharding=ranks.sharding,
            config_file=CONFIG_FILE if CONFIG_FILE in listing else None,
            unfinished=check_unfinished(storage),
        )
    )
