"""OLMo ``torch_new`` and OLMo-core (>= 1.0) step directories, opened as ONE checkpoint.

A step directory holds a DCP checkpoint in ``model_and_optim/``, each rank's trainer state in
``train/rank{N}.pt`` and the run config, ``config.yaml`` (OLMo, written last) or ``config.json``
plus the completion marker ``.metadata.json`` (OLMo-core, written last). The catalog is the DCP
catalog (its records re-rooted at the step directory: ``model_and_optim/__0_0.distcp``) plus
group ``train``: rank 0's trainer state with its keys unchanged (``train.global_step``,
``train.rng.torch``…), which is what OLMo's own unsharders write to ``train.pt``. Every rank's
copy is a chunk of the same entry, with its ``rank`` (see :mod:`.parts.rank_sets`).

A save that did not finish (a ``stepN-tmp`` directory, or no completion marker) still opens;
``catalog.facts.unfinished`` says why and a warning names the directory.
"""

from __future__ import annotations

import json
from typing import Any

from ..catalog.model import Catalog, CatalogBuilder, Facts
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..limits import first_missing
from ..storage import Store
from .detection import Detection
from .parts.dcp_metadata import DATA_FILE, METADATA, RANK_METADATA, read_dcp
from .parts.rank_sets import TRAIN_GROUP, RankSet, describe_ranks, rank_files
from .parts.unfinished import check_unfinished, name_reason

__all__ = [
    "NAME",
    "DCP_DIR",
    "TRAIN_DIR",
    "OLMO_CORE_MARKER",
    "OLMO_CONFIG",
    "OLMO_CORE_CONFIG",
    "detect",
    "describe",
]

NAME = "olmo_dcp"
DCP_DIR = "model_and_optim"
TRAIN_DIR = "train"
#: Files OLMo-core / OLMo write last: their presence marks a finished save.
OLMO_CORE_MARKER = ".metadata.json"
OLMO_CONFIG = "config.yaml"
OLMO_CORE_CONFIG = "config.json"
_SIGNS = (TRAIN_DIR, OLMO_CONFIG, OLMO_CORE_CONFIG, OLMO_CORE_MARKER)


def detect(storage: Store) -> Detection | None:
    """A step directory: ``model_and_optim/`` plus ``train/`` or an OLMo / OLMo-core config or
    marker beside it (a bare ``model_and_optim/`` parent stays plain DCP)."""
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return None
    if listing.get(DCP_DIR) != -1:
        return None
    signs = [name for name in _SIGNS if name in listing]
    if not signs:
        return None
    labels = {
        TRAIN_DIR: "train/ (per-rank trainer state)",
        OLMO_CONFIG: "config.yaml (OLMo)",
        OLMO_CORE_CONFIG: "config.json (OLMo-core)",
        OLMO_CORE_MARKER: ".metadata.json (OLMo-core completion marker)",
    }
    return Detection(NAME, storage, [f"{DCP_DIR}/ (DCP)"] + [labels[s] for s in signs])


def describe(storage: Store) -> Catalog:
    """The DCP catalog of ``model_and_optim/`` joined with the per-rank trainer state."""
    listing = storage.listdir()
    if listing.get(DCP_DIR) != -1:
        raise FormatError(f"{storage.describe()}: not a step directory: no {DCP_DIR}/ in it")
    facts, reasons = _layout(storage, listing)
    builder = CatalogBuilder(NAME)
    dcp_storage = storage.child(DCP_DIR)
    dcp_files: list[str] = []
    if not any(n == METADATA or RANK_METADATA.match(n) for n in dcp_storage.listdir()):
        reasons.append(f"{DCP_DIR}/{METADATA} is missing (DCP writes it last)")
    else:
        entries, dcp_files, dcp_facts = read_dcp(dcp_storage, prefix=f"{DCP_DIR}/")
        builder.add_files(dcp_files)
        builder.add_all(entries, source=dcp_storage.describe())
        facts.update(dcp_facts)
    facts["metadata_files"] = (
        *facts.get("metadata_files", ()),
        *([OLMO_CORE_MARKER] if OLMO_CORE_MARKER in listing else []),
    )
    train = _trainer_state(storage, listing, dcp_files, reasons)
    if train is not None:
        builder.add_files(train.files.values())
        builder.add_all(train.entries.values(), source=f"{storage.describe(TRAIN_DIR)}")
        facts["rank_files"] = tuple(train.files.values())
    if not builder.entries:
        raise FormatError(
            f"{storage.describe()}: nothing to open: no {DCP_DIR}/{METADATA} and no "
            f"{TRAIN_DIR}/rank<N>.pt"
        )
    return builder.build(Facts(unfinished=check_unfinished(storage, *reasons), **facts))


def _layout(storage: Store, listing: dict[str, int]) -> tuple[dict[str, Any], list[str]]:
    """OLMo or OLMo-core, the config file, and whether the completion marker is missing."""
    facts: dict[str, Any] = {}
    reasons: list[str] = []
    if OLMO_CORE_MARKER in listing:
        facts["layout"] = "OLMo-core"
        facts["olmo_core_metadata"] = _read_json(storage, OLMO_CORE_MARKER)
    elif OLMO_CONFIG in listing:
        facts["layout"] = "OLMo torch_new"
    else:
        facts["layout"] = "OLMo-core" if OLMO_CORE_CONFIG in listing else "unknown"
        reasons.append(
            f"no completion marker: neither {OLMO_CORE_MARKER} (OLMo-core writes it last) nor "
            f"{OLMO_CONFIG} (OLMo writes it last)"
        )
    facts["config_file"] = next(
        (name for name in (OLMO_CONFIG, OLMO_CORE_CONFIG) if name in listing), None
    )
    return facts, reasons


def _trainer_state(
    storage: Store, listing: dict[str, int], dcp_files: list[str], reasons: list[str]
) -> RankSet | None:
    """The per-rank trainer state in ``train/`` (rank 0's values read by default); missing
    ranks are an error unless the save is known to be unfinished (then one more reason)."""
    unfinished = bool(reasons) or name_reason(storage) is not None
    if listing.get(TRAIN_DIR) != -1:
        train_files = {}
    else:
        train_files = rank_files(storage, storage.listdir(TRAIN_DIR), prefix=f"{TRAIN_DIR}/")
    if not train_files:
        if not unfinished:
            reasons.append(f"no {TRAIN_DIR}/rank<N>.pt trainer state")
        return None
    ranks = describe_ranks(storage, train_files, group=TRAIN_GROUP, require_all=False)
    world = max(ranks.world_size, _dcp_world_size(dcp_files))
    missing = first_missing(train_files, world)
    if missing:
        names = ", ".join(f"{TRAIN_DIR}/rank{r}.pt" for r in missing)
        if not unfinished:
            raise FormatError(
                f"{storage.describe()}: {names} missing; the checkpoint has {world} ranks"
            )
        reasons.append(f"{names} missing")
    return ranks


def _dcp_world_size(files: list[str]) -> int:
    """Ranks that wrote DCP data files (``__R_K.distcp``): a lower bound of the world size."""
    ranks = [
        int(m.group(1))
        for name in files
        if (m := DATA_FILE.match(name.rsplit("/", 1)[-1])) is not None
    ]
    return max(ranks) + 1 if ranks else 0


def _read_json(storage: Store, name: str) -> Any:
    try:
        return json.loads(storage.read_file(name))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecordError(f"{storage.describe(name)}: not valid JSON: {exc}") from exc
