"""Megatron-LM legacy checkpoints (``--ckpt-format torch``), tensor and pipeline parallel,
merged into one TP=1, PP=1 model without Megatron.

Layout (Megatron-LM's ``get_checkpoint_name``): a run directory with
``latest_checkpointed_iteration.txt`` naming ``iter_NNNNNNN/`` (or ``release/``), which holds one
folder per model-parallel rank, ``mp_rank_<TP>`` (PP = 1) or ``mp_rank_<TP>_<PP>``, each with a
``model_optim_rng.pt``: a torch.save of ``{args, checkpoint_version, iteration, model,
optimizer, opt_param_scheduler, rng_state, …}``. Either directory opens, and so does one rank's
folder or file (as the whole set: one TP rank holds parts of tensors); the tracker alone decides
nothing (the iteration it names must hold the rank folders), and an iteration holding Megatron's
``metadata.json`` is the ``torch_dist`` format's.

Model. ``model`` is that rank's state dict, mcore names (``decoder.layers.N.mlp.linear_fc1.weight``)
or legacy ones (``language_model.encoder.layers.N.mlp.dense_h_to_4h.weight``, nested by module);
the tensor-parallel split dimension is not saved, so it comes from Megatron's naming rules
(:mod:`ckptkit.formats.parts.megatron_tp_rules`, shared with NeMo's model-parallel archives), and
every piece's shape is checked against the saved ``args`` (:mod:`.args`: hidden size, FFN size,
heads, query groups, kv channels, padded vocabulary, ``swiglu``). The merged entries
(:mod:`ckptkit.formats.parts.megatron_tp`) are ``model.<key>`` as the TP=1, PP=1 model names
them: each TP rank's piece a chunk at its offset, each pipeline stage's layers renumbered by the
layers before it (from ``num_layers``, the pipeline size and the first / last stage sizes in
``args``). Replicated parameters keep every TP rank's copy as a chunk (reads give rank 0's);
copies that differ are reported. The last stage's copy of tied word embeddings (PP > 1: legacy
``word_embeddings_for_head``, mcore ``output_layer``) is the alternate group ``tied_copy``,
readable but not written by unshard. ``_extra_state`` values (TransformerEngine metadata) are
per-rank objects.

Refused (:class:`MegatronLegacyError`, a :class:`~ckptkit.errors.FormatError` naming the file
and key), never guessed: a parameter no rule covers (MoE experts, multi-latent attention, BERT
heads…), pieces whose shapes or dtypes disagree with ``args`` or with each other, layers missing
from a stage, rank folders other than the TP × PP grid of ``args``, interleaved (virtual)
pipelines, expert parallelism. The rest of the files (:mod:`.run_state`): ``optimizer``
per rank, ``rng_state`` and ``common`` (args, iteration, scheduler…) as every rank's copies.
``distrib_optim.pt`` (distributed optimizer) is not read: listed with the files skipped, and why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ...catalog.model import Catalog, CatalogBuilder, Entry, Facts
from ...errors import CheckpointError, MissingFileError
from ...storage import Store
from ..detection import Detection
from ..parts.megatron_tp import MODEL_GROUP, TIED_GROUP, merge_model, warn_differing_copies
from ..parts.megatron_tp_rules import ModelArgs
from ..parts.megatron_tracker import TRACKER, detect_run, tracker_error
from ..parts.torch_save_files import load_pickles, pickle_entries
from .args import model_args
from .errors import MegatronLegacyError
from .layout import (
    RANK_DIR,
    RANK_FILE,
    RankFile,
    check_grid,
    rank_dirs,
    rank_files,
)
from .run_state import run_state_entries

__all__ = ["DISTRIBUTED_OPTIMIZER", "NAME", "MegatronLegacyError", "describe", "detect"]

NAME = "megatron_legacy"
#: Megatron's ``torch_dist`` iterations hold this (the ``megatron_dist`` format's).
_DIST_CONFIG = "metadata.json"
#: The distributed optimizer's state beside a rank file (not read).
DISTRIBUTED_OPTIMIZER = "distrib_optim.pt"
#: ``model0``, ``model1``…: one model chunk per virtual pipeline stage.
_VIRTUAL_MODEL = re.compile(r"^model\d+$")


def detect(storage: Store) -> Detection | None:
    """An iteration directory holding ``mp_rank_XX[_YYY]/model_optim_rng.pt``, a run directory
    whose tracker names one, or one rank's folder or file of one (the whole set is opened: one
    TP rank alone holds parts of tensors)."""
    one_rank = _one_rank(storage)
    if one_rank is not None:
        return one_rank
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return None
    found = _detect_here(storage, listing)
    if found is not None:
        return found
    return detect_run(storage, listing, NAME, _detect_here)


def _one_rank(storage: Store) -> Detection | None:
    """``…/iter_N/mp_rank_01`` or ``…/mp_rank_01/model_optim_rng.pt``: the iteration folder
    holding it, when it holds the rank folders (decided by the name first: no look-ups for
    other locations)."""
    parts = storage.url.rstrip("/").rsplit("/", 2)
    if len(parts) < 2:
        return None
    if parts[-1] == RANK_FILE and len(parts) == 3 and RANK_DIR.match(parts[-2]):
        named, levels = f"{parts[-2]}/{RANK_FILE}", 2
    elif RANK_DIR.match(parts[-1]):
        named, levels = parts[-1], 1
    else:
        return None
    iteration = storage
    try:
        for _ in range(levels):
            iteration = iteration.parent()[0]
        found = _detect_here(iteration, iteration.listdir())
    except (CheckpointError, NotADirectoryError, ValueError):
        return None
    if found is not None:
        what = "folder" if levels == 1 else "file"
        found.evidence[:0] = [f"{named} is one rank's {what}; the whole set beside it is opened"]
    return found


def _detect_here(storage: Store, listing: Mapping[str, int]) -> Detection | None:
    if _DIST_CONFIG in listing:
        return None
    names = rank_dirs(dict(listing))
    if not names or not storage.exists(f"{names[0]}/{RANK_FILE}"):
        return None
    shown = names[0] + (f" … {names[-1]}" if len(names) > 1 else "")
    return Detection(
        NAME,
        storage,
        [
            f"found {names[0]}/{RANK_FILE}: {len(names)} rank folder(s) {shown} "
            "(Megatron-LM --ckpt-format torch)"
        ],
    )


def describe(storage: Store) -> Catalog:
    """One catalog over every rank file: the merged model, then each rank's other state."""
    listing = storage.listdir()
    if TRACKER in listing and not rank_dirs(listing):  # a run whose tracker names no iteration
        raise tracker_error(storage, listing, _detect_here)
    found = rank_files(storage)
    pickled = load_pickles(storage, [r.file for r in found])
    values = {r.label: pickled[r.file].value for r in found}
    for rank in found:
        _check_top_level(storage, rank, values[rank.label])
    first = found[0]
    args = _args(storage, first, values[first.label])
    ranks = check_grid(storage, found, args)
    for rank in ranks[1:]:
        theirs = _args(storage, rank, values[rank.label])
        if theirs != args:
            raise MegatronLegacyError(
                f"{storage.describe(rank.file)}: its args describe another model or "
                f"parallelism than {storage.describe(first.file)}'s ({_differences(args, theirs)})",
                file=rank.file,
                key="args",
            )
    tops: dict[str, dict[str, list[Entry]]] = {}
    for rank in ranks:
        by_top: dict[str, list[Entry]] = {}
        for entry in pickle_entries(pickled[rank.file], "_"):
            by_top.setdefault(str(entry.path[1]), []).append(entry)
        tops[rank.label] = by_top
    model = merge_model(
        ranks,
        {label: by_top.pop(MODEL_GROUP) for label, by_top in tops.items()},
        args,
        storage.describe,
        error=MegatronLegacyError,
    )
    warn_differing_copies(storage, model.copies)
    builder = CatalogBuilder(NAME)
    builder.add_files(r.file for r in ranks)
    builder.add_all(model.entries, source=storage.describe())
    builder.add_all(run_state_entries(ranks, tops), source=storage.describe())
    tied = any(e.group == TIED_GROUP for e in model.entries)
    return builder.build(
        Facts(
            layout=f"Megatron-LM legacy (--ckpt-format torch), TP={args.tp} × PP={args.pp}",
            world_size=len(ranks),
            rank_files=tuple(r.file for r in ranks),
            alternate_groups=(TIED_GROUP,) if tied else (),
            skipped_files=_distributed_optimizer_files(storage, ranks),
        )
    )


def _distributed_optimizer_files(storage: Store, ranks: list[RankFile]) -> dict[str, str]:
    """The ``distrib_optim.pt`` beside the rank files (``--use-distributed-optimizer``), with
    why they are not read."""
    names = [f"{r.label}/{DISTRIBUTED_OPTIMIZER}" for r in ranks]
    return {
        name: "the distributed optimizer's state (Megatron's distrib_optim.pt, buckets of "
        "flattened parameters): not read; open it by its path as a torch.save file"
        for name, size in storage.sizes(names).items()
        if size is not None
    }


def _check_top_level(storage: Store, rank: RankFile, value: object) -> None:
    """A rank file holds a dict with a ``model`` state dict (not virtual pipeline chunks)."""
    source = storage.describe(rank.file)
    if not isinstance(value, Mapping):
        raise MegatronLegacyError(
            f"{source}: holds a {type(value).__name__}, not Megatron's checkpoint dict",
            file=rank.file,
        )
    virtual = sorted(k for k in value if isinstance(k, str) and _VIRTUAL_MODEL.match(k))
    if virtual:
        raise MegatronLegacyError(
            f"{source}: holds {', '.join(virtual)}: an interleaved (virtual) pipeline's model "
            "chunks, which are not supported",
            file=rank.file,
            key=virtual[0],
        )
    model = value.get(MODEL_GROUP)
    if not isinstance(model, Mapping) or not model:
        raise MegatronLegacyError(
            f"{source}: no 'model' state dict (top-level keys: "
            f"{', '.join(map(str, list(value)[:12]))})",
            file=rank.file,
            key=MODEL_GROUP,
        )


def _args(storage: Store, rank: RankFile, value: Mapping) -> ModelArgs:
    source = storage.describe(rank.file)
    if "args" not in value:
        raise MegatronLegacyError(
            f"{source}: no 'args': without the run's arguments the merged shapes cannot be "
            "checked, so the ranks are not merged",
            file=rank.file,
            key="args",
        )
    return model_args(value["args"], rank.file, source, value.get("checkpoint_version"))


def _differences(ours: ModelArgs, theirs: ModelArgs) -> str:
    fields = [name for name in vars(ours) if getattr(ours, name) != getattr(theirs, name)]
    return ", ".join(
        f"{name} {getattr(theirs, name)!r} vs {getattr(ours, name)!r}" for name in fields
    )
