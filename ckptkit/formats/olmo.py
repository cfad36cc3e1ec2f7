"""OLMo ``torch_new`` and OLMo-core (>= 1.0) step directories, opened as ONE checkpoint.

A step directory holds a DCP checkpoint in ``model_and_optim/``, each rank's trainer state in
``train/rank{N}.pt`` and the run config, ``config.yaml`` (OLMo, written last) or ``config.json``
plus the completion marker ``.metadata.json`` (OLMo-core, written last). The catalog is the DCP
catalog (its records re-rooted at the step directory: ``model_and_optim/__0_0.distcp``) plus
group ``train``: rank 0's trainer state with its keys unchanged (``train.global_step``,
``train.rng.torch``…), which is what OLMo's own unsharders write to ``train.pt``. Every rank's
copy is a chunk of the same entry, with its ``rank`` (see :mod:`ckptkit.formats.legacy`).

A save that did not finish (a ``stepN-tmp`` directory, or no completion marker) still opens;
``catalog.info["unfinished"]`` says why and a warning names the directory.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..catalog import Catalog
from ..errors import CorruptRecordError, FormatError, MissingFileError
from ..limits import first_missing
from ..storage import Storage
from . import dcp, legacy
from .detection import Detection

NAME = "olmo_dcp"
DCP_DIR = "model_and_optim"
TRAIN_DIR = "train"
#: Files OLMo-core / OLMo write last: their presence marks a finished save.
OLMO_CORE_MARKER = ".metadata.json"
OLMO_CONFIG = "config.yaml"
OLMO_CORE_CONFIG = "config.json"
_SIGNS = (TRAIN_DIR, OLMO_CONFIG, OLMO_CORE_CONFIG, OLMO_CORE_MARKER)
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_METADATA = re.compile(r"^__\d+\.metadata$")  # DCP saved with use_collectives=False


def detect(storage: Storage) -> Detection | None:
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


def describe(storage: Storage) -> Catalog:
    """The DCP catalog of ``model_and_optim/`` joined with the per-rank trainer state."""
    listing = storage.listdir()
    if listing.get(DCP_DIR) != -1:
        raise FormatError(f"{storage.describe()}: not a step directory: no {DCP_DIR}/ in it")
    unfinished: list[str] = []
    name_reason = legacy.unfinished_name(storage)
    if name_reason:
        unfinished.append(name_reason)
    info: dict[str, Any] = {}

    if OLMO_CORE_MARKER in listing:
        info["layout"] = "OLMo-core"
        info["olmo_core_metadata"] = _read_json(storage, OLMO_CORE_MARKER)
    elif OLMO_CONFIG in listing:
        info["layout"] = "OLMo torch_new"
    else:
        info["layout"] = "OLMo-core" if OLMO_CORE_CONFIG in listing else "unknown"
        unfinished.append(
            f"no completion marker: neither {OLMO_CORE_MARKER} (OLMo-core writes it last) nor "
            f"{OLMO_CONFIG} (OLMo writes it last)"
        )
    for name in (OLMO_CONFIG, OLMO_CORE_CONFIG):
        if name in listing:
            info["config_file"] = name
            break

    entries: dict = {}
    files: list[str] = []
    dcp_storage = storage.child(DCP_DIR)
    if not any(n == dcp.METADATA or _RANK_METADATA.match(n) for n in dcp_storage.listdir()):
        unfinished.append(f"{DCP_DIR}/{dcp.METADATA} is missing (DCP writes it last)")
    else:
        catalog = dcp.describe(dcp_storage)
        _reroot(catalog, DCP_DIR)
        entries.update(catalog.entries)
        files.extend(catalog.files)
        for key in ("version", "checkpoint_id", "save_id"):
            if key in catalog.info:
                info[key] = catalog.info[key]
        info["metadata_files"] = [f"{DCP_DIR}/{n}" for n in catalog.info["metadata_files"]]

    train_files: dict[int, str] = {}
    if listing.get(TRAIN_DIR) == -1:
        train_listing = storage.listdir(TRAIN_DIR)
        train_files = legacy.rank_files(storage, train_listing, prefix=f"{TRAIN_DIR}/")
    if train_files:
        ranks = legacy.describe_ranks(
            storage, train_files, group=legacy.TRAIN_GROUP, require_all=False
        )
        world = max(ranks.world_size, _dcp_world_size(files))
        missing = first_missing(train_files, world)
        if missing:
            names = ", ".join(f"{TRAIN_DIR}/rank{r}.pt" for r in missing[:4])
            if not unfinished:
                raise FormatError(
                    f"{storage.describe()}: {names} missing; the checkpoint has {world} ranks"
                )
            unfinished.append(f"{names} missing")
        for key, entry in ranks.entries.items():
            if key in entries:
                raise FormatError(
                    f"{storage.describe(train_files[min(train_files)])}: trainer state key "
                    f"{key!r} is also in {DCP_DIR}/"
                )
            entries[key] = entry
        files.extend(train_files.values())
        info["train_files"] = list(train_files.values())
    elif not unfinished:
        unfinished.append(f"no {TRAIN_DIR}/rank<N>.pt trainer state")

    if not entries:
        raise FormatError(
            f"{storage.describe()}: nothing to open: no {DCP_DIR}/{dcp.METADATA} and no "
            f"{TRAIN_DIR}/rank<N>.pt"
        )
    if unfinished:
        info["unfinished"] = "; ".join(unfinished)
        legacy.warn_unfinished(storage, info["unfinished"])
    return Catalog(NAME, entries, files, info)


def _reroot(catalog: Catalog, prefix: str) -> None:
    """Make the DCP catalog's record files relative to the step directory."""
    seen: set[int] = set()
    for entry in catalog.entries.values():
        for chunk in entry.chunks:
            record = chunk.record
            if record is not None and id(record) not in seen:
                seen.add(id(record))
                record.file = f"{prefix}/{record.file}"
    catalog.files = [f"{prefix}/{name}" for name in catalog.files]


def _dcp_world_size(files: list[str]) -> int:
    """Ranks that wrote DCP data files (``__R_K.distcp``): a lower bound of the world size."""
    ranks = [
        int(m.group(1))
        for name in files
        if (m := _DATA_FILE.match(name.rsplit("/", 1)[-1])) is not None
    ]
    return max(ranks) + 1 if ranks else 0


def _read_json(storage: Storage, name: str) -> Any:
    try:
        return json.loads(storage.read_file(name))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecordError(f"{storage.describe(name)}: not valid JSON: {exc}") from exc
