"""Hugging Face Accelerate ``save_state`` folders of an FSDP sharded state dict, opened as ONE
checkpoint.

With FSDP's ``SHARDED_STATE_DICT`` (and ``use_dcp``, the default), ``Accelerator.save_state(DIR)``
writes each model's state dict as a DCP folder ``pytorch_model_fsdp_{i}/`` (top-level key
``model``) and each optimizer's as ``optimizer_{i}/`` (key ``optimizer``), then, as every
``save_state`` does, torch.save files: ``scheduler.bin`` (``scheduler_{i}.bin``),
``random_states_{rank}.pkl`` from every rank, maybe ``sampler.bin``, ``dl_state_dict.bin``,
``scaler.pt`` and ``custom_checkpoint_{i}.pkl``. The catalog combines them (see
:mod:`.parts.sub_checkpoints`): group ``model`` (``model_{i}`` for the i-th model) from each model
folder with its keys as Accelerate's loader reads them (``model.transformer.wte.weight``), group
``optim`` (``optim_{i}``) from each optimizer folder (``optim.state.<fqn>.exp_avg``), their
records re-rooted at DIR (``optimizer_0/__1_0.distcp``), and one group per torch.save file, named
after it (``scheduler``, ``random_states_0``…): the scheduler's values and the RNG states are
objects, but for the CPU generator's state, a uint8 tensor as torch keeps it.

The plain ``save_state`` folder (``model.safetensors`` + ``optimizer.bin``…) opens as safetensors,
and ``use_dcp=False``'s per-rank ``*_rank{r}.bin`` files as rank files; neither is this format.
"""

from __future__ import annotations

import re
from typing import Any

from ..catalog.model import Catalog, CatalogBuilder, Facts
from ..errors import FormatError, MissingFileError
from ..storage import Store
from .detection import Detection
from .parts.dcp_metadata import DATA_FILE, METADATA
from .parts.sub_checkpoints import read_dcp_part
from .parts.torch_save_files import describe_files, probe

__all__ = ["NAME", "MODEL_DIR", "OPTIMIZER_DIR", "STATE_FILE", "detect", "describe"]

NAME = "accelerate"
#: ``save_fsdp_model``'s DCP folder of the i-th model, and ``save_fsdp_optimizer``'s.
MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)$")
OPTIMIZER_DIR = re.compile(r"^optimizer_(\d+)$")
#: The torch.save files ``save_accelerator_state`` and ``save_custom_state`` write beside them.
STATE_FILE = re.compile(
    r"^(?:(?:scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin|scaler\.pt"
    r"|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl)$"
)
_LAYOUT = "Accelerate save_state, FSDP SHARDED_STATE_DICT"


def detect(storage: Store) -> Detection | None:
    """An Accelerate folder when it holds a ``pytorch_model_fsdp_{i}/`` or ``optimizer_{i}/``
    sub-folder that is a DCP checkpoint (its ``.metadata``, or its ``.distcp`` files)."""
    parts = _dcp_parts(storage)
    if not parts:
        return None
    try:
        listing = storage.listdir()
    except MissingFileError:
        return None
    evidence = [f"{folder}/ (DCP, group {group})" for folder, group in parts.items()]
    states = sorted(name for name, size in listing.items() if size >= 0 and STATE_FILE.match(name))
    if states:
        evidence.append("Accelerate state files: " + ", ".join(states[:4]))
    return Detection(NAME, storage, evidence)


def describe(storage: Store) -> Catalog:
    """The model and optimizer DCP folders under groups ``model`` and ``optim``, and the
    torch.save state files beside them, each under its own group."""
    folders = _dcp_parts(storage)
    if not folders:
        raise FormatError(
            f"{storage.describe()}: not an Accelerate FSDP save_state folder: no "
            "pytorch_model_fsdp_<i>/ or optimizer_<i>/ DCP folder in it"
        )
    builder = CatalogBuilder(NAME)
    facts: dict[str, Any] = {"layout": _LAYOUT, "metadata_files": ()}
    for folder, group in folders.items():
        part = read_dcp_part(storage, folder, group)
        builder.add_files(part.files)
        builder.add_all(part.entries, source=storage.describe(folder))
        facts["metadata_files"] += tuple(part.facts.get("metadata_files", ()))
        for name in ("version", "checkpoint_id", "save_id"):
            facts.setdefault(name, part.facts.get(name))
    states = _state_files(storage)
    builder.add_files(states)
    builder.add_all(describe_files(storage, states).values(), source=storage.describe())
    return builder.build(Facts(**facts))


def _dcp_parts(storage: Store) -> dict[str, str]:
    """``{folder: group}`` of the model and optimizer DCP folders, models first, by index."""
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return {}
    found: list[tuple[int, int, str, str]] = []
    for name, size in listing.items():
        for order, (pattern, stem) in enumerate(((MODEL_DIR, "model"), (OPTIMIZER_DIR, "optim"))):
            match = pattern.match(name)
            if size < 0 and match is not None and _is_dcp(storage, name):
                index = int(match.group(1))
                found.append((order, index, name, stem if index == 0 else f"{stem}_{index}"))
    return {name: group for _, _, name, group in sorted(found)}


def _is_dcp(storage: Store, folder: str) -> bool:
    """Whether ``folder`` holds DCP's ``.metadata`` or data files (a save cut short before
    ``.metadata``: ``describe`` then says it is missing)."""
    try:
        names = storage.listdir(folder)
    except MissingFileError:
        return False
    return METADATA in names or any(DATA_FILE.match(name) for name in names)


def _state_files(storage: Store) -> dict[str, str]:
    """``{file: group}`` of the torch.save state files beside the DCP folders (a file named
    like one that is not a torch.save file is left to the skipped files)."""
    listing = storage.listdir()
    named = {n: s for n, s in sorted(listing.items()) if s >= 0 and STATE_FILE.match(n)}
    kinds = probe(storage, named)
    return {name: name.rsplit(".", 1)[0] for name in named if kinds[name] is not None}
