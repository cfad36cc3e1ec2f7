"""On-disk formats. Each adapter (a module named after its format) only *describes* a checkpoint
(``detect`` + ``describe``, feeding :class:`~ckptkit.catalog.CatalogBuilder`); reading, tables
and conversions work on the :class:`~ckptkit.catalog.Catalog` it returns. Adapters never import
each other: what several share lives in :mod:`.parts`."""

from __future__ import annotations

import dataclasses
from types import ModuleType

from ..catalog.model import Catalog
from ..errors import (
    AccessDeniedError,
    FormatError,
    LocationNotFoundError,
    MissingFileError,
    NotACheckpointError,
)
from ..storage import Store
from . import (
    accelerate,
    dcp,
    deepspeed_zero,
    hf_dcp_sharded,
    megatron_dist,
    megatron_legacy,
    nemo,
    olmo_core_v0,
    olmo_dcp,
    olmo_local,
    pointers,
    rank_files,
    safetensors,
    torch_save,
    torchscript,
)
from .detection import Detection
from .unread_files import with_unread_files

#: Adapters in detection order: the first whose ``detect`` answers wins (a directory holding
#: ``*.safetensors`` is safetensors even when ``model.pt`` sits next to them).
ADAPTERS: dict[str, ModuleType] = {
    olmo_dcp.NAME: olmo_dcp,  # a step dir holds model_and_optim/.metadata: before dcp
    # mp_rank_XX/model_optim_rng.pt; both read the iteration tracker: before megatron_dist
    megatron_legacy.NAME: megatron_legacy,
    megatron_dist.NAME: megatron_dist,  # metadata.json beside .metadata: before dcp
    accelerate.NAME: accelerate,  # DCP sub-folders beside scheduler.bin: before torch_save
    dcp.NAME: dcp,
    olmo_local.NAME: olmo_local,
    olmo_core_v0.NAME: olmo_core_v0,
    hf_dcp_sharded.NAME: hf_dcp_sharded,
    safetensors.NAME: safetensors,
    deepspeed_zero.NAME: deepspeed_zero,  # tag dirs hold torch.save zips: before rank_files
    rank_files.NAME: rank_files,  # rank{N}.pt are torch.save zips too: before torch_save
    torchscript.NAME: torchscript,  # TorchScript archives are torch zips too: before torch_save
    nemo.NAME: nemo,  # .nemo tars, NeMo 2 weights/ + context/ folders
    torch_save.NAME: torch_save,
}
#: Earlier names of formats, still accepted by ``format=``.
ALIASES = {"legacy": rank_files.NAME}


def detect(storage: Store, format: str | None = None) -> Detection:
    """Which format is at ``storage`` (or force ``format``); a clear error when none fits."""
    if format is not None:
        format = ALIASES.get(format, format)
        if format not in ADAPTERS:
            raise FormatError(f"unknown format {format!r}; known: {', '.join(ADAPTERS)}")
        found = ADAPTERS[format].detect(storage)
        return found or Detection(format, storage, ["forced by format="])
    pointer = pointers.inside_checkpoint(storage)
    if pointer is not None:
        raise NotACheckpointError(pointer)
    found = first_detection(storage)
    if found is not None:
        return found
    try:
        entries = storage.listdir()
    except MissingFileError as exc:
        if isinstance(exc.__cause__, AccessDeniedError):  # a store refusing everything (403)
            raise exc.__cause__ from None
        raise LocationNotFoundError(f"{storage.describe()}: no such file or directory") from None
    steps = pointers.checkpoints_below(storage, entries, first_detection, nested=True)
    if len(steps) == 1:
        only = _only_checkpoint(storage, steps[0])
        if only is not None:
            return only
    if steps:
        shown = ", ".join(steps[:8]) + (" …" if len(steps) > 8 else "")
        raise NotACheckpointError(
            f"{storage.describe()}: a folder of {len(steps)} checkpoint(s), not one: {shown}; "
            f"open one of them, e.g. ckptkit inspect {storage.describe(steps[-1])}"
        )
    listing = sorted(entries)
    seen = ", ".join(listing[:12]) + (" …" if len(listing) > 12 else "") if listing else "nothing"
    raise NotACheckpointError(
        f"{storage.describe()}: not a checkpoint ckptkit recognises; looked for .metadata, "
        f"metadata.json (Megatron torch_dist), latest_checkpointed_iteration.txt, "
        f"__<rank>.metadata, model_and_optim/ (+ train/, config.yaml|json), *.safetensors, "
        f"*.safetensors.index.json, DeepSpeed ZeRO *_optim_states.pt (+ latest), "
        f"rank<N>.pt, <name>_rank<N>.pt|.bin of DTensors/ShardedTensors, torch.save files (*.pt, *.pth, *.bin, *.ckpt, "
        f"*.pth.tar, *.tar, *.jit; zip or pre-1.6), TorchScript archives (torch.jit.save: "
        f"constants.pkl, code/), *.nemo (uncompressed tar), NeMo 2 weights/ + context/, "
        f"Accelerate pytorch_model_fsdp_<i>/ + optimizer_<i>/; "
        f"found {seen}"
    )


def _only_checkpoint(storage: Store, name: str) -> Detection | None:
    """The detection of ``name``, the one checkpoint below the folder ``storage`` (NeMo 2's
    ``weights/``, a run folder of one step), with a note saying it was opened in its stead."""
    found = first_detection(storage.child(name))
    if found is None:  # it went away since: the "a folder of 1 checkpoint" error says so
        return None
    note = f"opened {name}/, the only checkpoint in {storage.describe()}"
    found.evidence.insert(0, note)
    found.notes.append(note)
    return found


def first_detection(storage: Store) -> Detection | None:
    """The first adapter's verdict on ``storage``, in :data:`ADAPTERS` order."""
    for adapter in ADAPTERS.values():
        found = adapter.detect(storage)
        if found is not None:
            return found
    return None


def describe(detection: Detection) -> Catalog:
    """The catalog of a detected checkpoint (of just ``detection.files`` when they are named);
    of a local folder, with every file in it that it does not read in ``facts.skipped_files``."""
    adapter = ADAPTERS[detection.format]
    if detection.files is not None:
        catalog = adapter.describe(detection.storage, files=detection.files)
    else:
        catalog = with_unread_files(adapter.describe(detection.storage), detection.storage)
    if detection.notes:
        notes = (*detection.notes, *catalog.facts.notes)
        catalog = dataclasses.replace(
            catalog, facts=dataclasses.replace(catalog.facts, notes=notes)
        )
    return catalog


__all__ = ["ADAPTERS", "Detection", "detect", "describe"]
