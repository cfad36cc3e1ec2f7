"""Per-rank torch.save files in one directory: ``rank{N}.pt`` (FSDP1 ``SHARDED_STATE_DICT``,
OLMo "legacy" / "torch_legacy" checkpoints, per-rank FSDP2 DTensors), and named sets as
training libraries write them: verl / SkyRL ``model_world_size_2_rank_0.pt`` (+ ``optim_…``,
``extra_state_…``), Accelerate FSDP ``use_dcp=False`` ``pytorch_model_fsdp_0_rank0.bin`` (+
``optimizer_0_rank0.bin``). All ranks' pieces become one catalog (see :mod:`.parts.rank_sets`).

``rank{N}.pt`` files are recognised by name. Named sets are recognised by content: their names
only say which files form a set, and the pickle of one of them (no other file, no tensor bytes)
must hold DTensors or ShardedTensors; otherwise they are plain torch.save files.
"""

from __future__ import annotations

from ..catalog.model import Catalog, CatalogBuilder, Entry, Facts
from ..errors import CoverageError, FormatError, MissingFileError
from ..storage import Store
from .detection import Detection, file_location
from .parts.fsdp_pickles import ALLOWED_GLOBALS
from .parts.rank_sets import (
    NAMED_RANK_FILE,
    RANK_FILE,
    NamedRankSet,
    describe_ranks,
    named_rank_sets,
    rank_files,
    sharded_sets_evidence,
    sniff_sharding,
)
from .parts.torch_save_files import SUFFIXES, describe_files, group_of, probe
from .parts.unfinished import check_unfinished

NAME = "rank_files"
#: OLMo writes its run config beside the rank files (rank 0, after them).
CONFIG_FILE = "config.yaml"
#: verl writes its FSDP settings beside the rank files, and the HF model config below them.
FSDP_CONFIG = "fsdp_config.json"
HF_CONFIG = "huggingface/config.json"


def detect(storage: Store) -> Detection | None:
    """Per-rank files when the directory holds ``rank{N}.pt`` files, or named rank files one of
    which holds DTensors / ShardedTensors (or one such file is named)."""
    located = file_location(storage)
    if located is not None:
        return _detect_file(*located)
    try:
        listing = storage.listdir()
    except MissingFileError:
        return None
    names = [name for name in listing if RANK_FILE.match(name) and listing[name] >= 0]
    if not names:
        return _detect_named(storage, listing)
    names.sort(key=lambda name: int(RANK_FILE.match(name).group(1)))
    shown = ", ".join(names[:3]) + (f" … {names[-1]}" if len(names) > 3 else "")
    evidence = [f"per-rank torch.save files {shown}"]
    if CONFIG_FILE in listing:
        evidence.append(f"{CONFIG_FILE} (OLMo)")
    return Detection(NAME, storage, evidence)


def _detect_file(parent: Store, name: str) -> Detection | None:
    """A named rank file: ``rank{N}.pt`` by its name, another by what its pickle holds."""
    if RANK_FILE.match(name):
        return Detection(
            NAME, parent, [f"{name} is one rank's file; the whole set beside it is opened"]
        )
    if not NAMED_RANK_FILE.match(name):
        return None
    kind = sniff_sharding(parent, name)
    if kind is None:
        return None
    return Detection(
        NAME, parent, [f"{name} is one rank's file ({kind}s); the whole set beside it is opened"]
    )


def _detect_named(storage: Store, listing: dict[str, int]) -> Detection | None:
    """Named rank files whose first set's lowest rank file holds sharded tensors (the only
    pickle read: every other file is checked when the checkpoint is described)."""
    sets = named_rank_sets(storage, listing, strict=False)
    if not sets:
        return None
    first = sets[0]
    file = first.files[min(first.files)]
    kind = sniff_sharding(storage, file, listing[file])
    if kind is None:
        return None
    evidence = [sharded_sets_evidence(sets, kind)]
    evidence += [f"found {name}" for name in (FSDP_CONFIG,) if name in listing]
    return Detection(NAME, storage, evidence)


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """One catalog over every ``rank{N}.pt`` in the directory, or else over every named set of
    rank files (``files`` is ignored: one rank of a sharded set cannot be read on its own)."""
    listing = storage.listdir()
    by_rank = rank_files(storage, listing)
    if not by_rank:
        sets = named_rank_sets(storage, listing)
        if sets:
            return _describe_named(storage, listing, sets)
        raise FormatError(
            f"{storage.describe()}: no rank{{N}}.pt files (nor <name>_rank<N>.pt|.bin, "
            "<name>_world_size_<N>_rank_<R>.pt)"
        )
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


def _describe_named(storage: Store, listing: dict[str, int], sets: list[NamedRankSet]) -> Catalog:
    """One catalog over named sets of rank files, each under its group, checked to be one
    checkpoint: every set complete (0..N-1, as the names and contents say) and of one world
    size. Other torch.save files beside them (Accelerate's ``scheduler.bin``) are groups of
    their own, unless their group is a set's."""
    for named in sets:
        named.check_names(storage)  # before reading anything: name the missing files
    builder = CatalogBuilder(NAME, object_globals=ALLOWED_GLOBALS)
    worlds: dict[int, NamedRankSet] = {}
    sharding = None
    entries: list[Entry] = []
    for named in sets:
        sizes = {name: listing[name] for name in named.files.values()}
        ranks = describe_ranks(
            storage,
            named.files,
            sizes,
            group=named.group,
            require_all=False,
            template=named.template,
        )
        if named.world_size is not None and ranks.world_size != named.world_size:
            raise CoverageError(
                f"{storage.describe(named.files[min(named.files)])}: the names say world size "
                f"{named.world_size}, but the {ranks.world_size_from} says {ranks.world_size}"
            )
        ranks.raise_for_missing(storage)
        worlds.setdefault(ranks.world_size, named)
        sharding = sharding or ranks.sharding
        builder.add_files(named.files.values())
        entries += ranks.entries.values()
    if len(worlds) > 1:
        shown = ", ".join(f"{s.shown}: {world} ranks" for world, s in worlds.items())
        raise CoverageError(f"{storage.describe()}: rank files of different world sizes ({shown})")
    others = _other_files(storage, listing, sets)
    builder.add_files(others)
    builder.add_all(entries, source=storage.describe())
    builder.add_all(describe_files(storage, others).values(), source=storage.describe())
    return builder.build(
        Facts(
            world_size=next(iter(worlds)),
            rank_files=tuple(name for named in sets for name in named.files.values()),
            sharding=sharding,
            metadata_files=(FSDP_CONFIG,) if FSDP_CONFIG in listing else (),
            config_file=HF_CONFIG if listing.get(HF_CONFIG.split("/")[0], 0) < 0 else None,
            unfinished=check_unfinished(storage),
        )
    )


def _other_files(storage: Store, listing: dict[str, int], sets: list[NamedRankSet]) -> dict:
    """``{name: group}`` of the torch.save files beside the named sets that are not rank files
    and whose group no set holds (their first bytes read to tell torch.save files apart)."""
    groups = {named.group for named in sets}
    rank_names = {name for named in sets for name in named.files.values()}
    candidates = {
        name: size
        for name, size in sorted(listing.items())
        if name.endswith(SUFFIXES)
        and size >= 0
        and name not in rank_names
        and group_of(name) not in groups
    }
    kinds = probe(storage, candidates)
    return {name: group_of(name) for name in candidates if kinds[name] is not None}


__all__ = ["CONFIG_FILE", "FSDP_CONFIG", "HF_CONFIG", "NAME", "describe", "detect"]
