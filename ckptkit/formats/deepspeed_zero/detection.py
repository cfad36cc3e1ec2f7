"""Finding a DeepSpeed ZeRO tag directory: detection, the tag a run directory's ``latest``
names, and sorting a tag's files by rank (and, with pipeline parallelism, by stage and layer),
with an :class:`~ckptkit.errors.UnsupportedLayoutError` naming the layouts recognised but not
read (tensor parallelism, MoE expert files, NVMe offload).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...errors import FormatError, MissingFileError, UnsupportedLayoutError
from ...limits import count_missing, first_missing
from ...storage import Store
from ..detection import Detection, file_location, natural_order

NAME = "deepspeed_zero"
LATEST = "latest"
#: Files DeepSpeed copies beside the tags: its converters, never read.
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
#: ``PipelineModule.ckpt_layer_path``: ``layer_{idx:02d}[-model_{tp:02d}]-model_states.pt``
#: (the ``model_`` part when the topology has a tensor-parallel axis).
LAYER_FILE = re.compile(r"^layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")
MOE_FILE = re.compile(r"(?:^|_)expp_rank_\d+_|(?:^|_)expert_\d+_mp_rank_")
#: Where ZeRO-Infinity copies its NVMe swap files (``offloaded_tensors/rank{N}/``).
OFFLOAD_DIR = "offloaded_tensors"
#: A tag name ``latest`` may give: one plain path component.
TAG = re.compile(r"^[A-Za-z0-9_.+=-]{1,255}$")
MAX_LATEST_BYTES = 4096
#: Sub-directories looked into for tag directories when ``latest`` names none.
MAX_TAG_DIRS = 64


# --------------------------------------------------------------------------------------------
# Detection.


def detect(storage: Store) -> Detection | None:
    """A ZeRO tag directory (``*_optim_states.pt`` or pipeline layer files beside
    ``*_model_states.pt``), or its parent whose ``latest`` names one."""
    if file_location(storage) is not None:
        return None
    try:
        listing = storage.listdir()
    except (MissingFileError, NotADirectoryError):
        return None
    evidence = tag_evidence(listing)
    if evidence:
        return Detection(NAME, storage, evidence)
    if listing.get(LATEST, -1) < 0:
        return None
    try:
        tag = latest_tag(storage)
        inner = tag_evidence(storage.listdir(tag))
    except (FormatError, MissingFileError, NotADirectoryError):
        inner = []
    if not inner:  # a stale or damaged ``latest``: describe() names it and the tags there are
        tags = tags_below(storage, listing)
        if not tags:
            return None
        return Detection(
            NAME, storage, [f"{LATEST} names no tag directory; tags: {tags_text(tags)}"]
        )
    lines = [f"{LATEST} names tag {tag!r}: reading {tag}/"]
    lines += [f"{tag}/{line}" for line in inner]
    lines += [f"{name} (DeepSpeed's converter, not read)" for name in SCRIPTS if name in listing]
    return Detection(NAME, storage, lines)


def tag_evidence(listing: Mapping[str, int]) -> list[str]:
    """Why a listing looks like a ZeRO tag directory (empty: it does not)."""
    optim = sorted(n for n in listing if OPTIM_FILE.match(n))
    model = sorted(n for n in listing if MODEL_FILE.match(n))
    layers = sorted(n for n in listing if LAYER_FILE.match(n))
    moe = sorted(n for n in listing if MOE_FILE.search(n))
    if not (model and (optim or layers)) and not (moe and (optim or model)):
        return []
    lines = []
    if model:
        lines.append(f"{model[0]} … ({len(model)} model-state files)")
    if optim:
        prefix = " (bf16_ prefix: bf16 training)" if optim[0].startswith("bf16_") else ""
        lines.append(f"{optim[0]} … ({len(optim)} optimizer partitions){prefix}")
    if layers:
        lines.append(f"{layers[0]} … ({len(layers)} pipeline layer files)")
    if moe:
        lines.append(f"{moe[0]} … (MoE expert files: not supported)")
    return lines


def tags_below(storage: Store, listing: Mapping[str, int]) -> list[str]:
    """The sub-directories of a run directory that are ZeRO tag directories, in natural order
    (the last :data:`MAX_TAG_DIRS` looked into: the latest steps)."""
    tags = []
    folders = sorted((n for n, size in listing.items() if size < 0), key=natural_order)
    for name in folders[-MAX_TAG_DIRS:]:
        try:
            if tag_evidence(storage.listdir(name)):
                tags.append(name)
        except (MissingFileError, NotADirectoryError):
            continue
    return tags


def tags_text(tags: list[str]) -> str:
    """``tags`` for a message: the first few, and how many more."""
    return ", ".join(tags[:8]) + (f" … ({len(tags)} in all)" if len(tags) > 8 else "")


def latest_tag(storage: Store) -> str:
    """The tag ``latest`` names: one safe path component."""
    raw = storage.read_file(LATEST, max_bytes=MAX_LATEST_BYTES)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not TAG.match(tag) or tag in (".", ".."):
        raise FormatError(
            f"{storage.describe(LATEST)}: does not name a tag directory: {raw[:80]!r}"
        )
    return tag


# --------------------------------------------------------------------------------------------
# The files of a tag directory.


@dataclass
class StageFiles:
    """One pipeline stage's files: its model states and its data-parallel ranks' optimizer
    partitions (by DP rank)."""

    model: str
    optim: list[str]


@dataclass
class TagFiles:
    """The ZeRO files of one tag directory, relative to the checkpoint root.

    Without pipeline parallelism ``layers`` and ``stages`` are empty; with it, ``model`` and
    ``optim`` list every stage's files (stage by stage), ``stages`` sorts them and ``layers``
    maps each layer index to its ``layer_XX-model_states.pt``."""

    prefix: str  # "" or "<tag>/"
    optim: list[str]  # by DP rank
    model: list[str]  # one (stages 1/2) or one per DP rank (stage 3)
    sizes: dict[str, int]
    skipped: dict[str, str]
    layers: dict[int, str] = field(default_factory=dict)
    stages: list[StageFiles] = field(default_factory=list)


@dataclass
class _Listing:
    """A tag directory's files sorted by kind, relative to the checkpoint root."""

    prefix: str
    source: str
    names: list[str]
    sizes: dict[str, int]
    optim: dict[tuple[int, int], str] = field(default_factory=dict)  # (mp rank, dp rank)
    per_rank_model: dict[tuple[int, int], str] = field(default_factory=dict)  # (mp, dp)
    shared_model: dict[int, str] = field(default_factory=dict)  # mp rank
    layers: dict[int, str] = field(default_factory=dict)  # layer index
    skipped: dict[str, str] = field(default_factory=dict)


def list_tag_files(storage: Store, prefix: str) -> TagFiles:
    """Sort a tag directory's files; a clear error for layouts recognised but not read."""
    where = prefix.rstrip("/")
    found = _sort_listing(storage.listdir(where), prefix, storage.describe(where))
    if found.layers:
        return _pipeline_files(found)
    return _data_parallel_files(found)


def _sort_listing(listing: Mapping[str, int], prefix: str, source: str) -> _Listing:
    """Each file of a tag directory under its kind; layouts not read refused by name."""
    sizes = {prefix + n: s for n, s in listing.items() if s >= 0}
    found = _Listing(prefix, source, sorted(listing), sizes)
    kinds = set()
    for name, size in sorted(listing.items()):
        _refuse_unsupported(name, size, source)
        if size < 0:
            found.skipped[prefix + name] = (
                "a directory (offload or universal-checkpoint state?): not read"
            )
        elif (m := OPTIM_FILE.match(name)) is not None:
            kinds.add(bool(m.group(1)))
            found.optim[int(m.group(3)), int(m.group(2))] = prefix + name
        elif (m := MODEL_FILE.match(name)) is not None:
            if m.group(1) is None:
                found.shared_model[int(m.group(2))] = prefix + name
            else:
                found.per_rank_model[int(m.group(2)), int(m.group(1))] = prefix + name
        elif (m := LAYER_FILE.match(name)) is not None:
            index = int(m.group(1))
            if index in found.layers:
                raise FormatError(
                    f"{source}: {name} and {found.layers[index].rsplit('/', 1)[-1]} both "
                    f"hold pipeline layer {index}: files of two saves mixed"
                )
            found.layers[index] = prefix + name
        else:
            found.skipped[prefix + name] = "not a ZeRO model-state or optimizer-state file"
    if len(kinds) > 1:
        raise FormatError(f"{source}: both bf16_ and plain optimizer-state files: two saves mixed")
    return found


def _data_parallel_files(found: _Listing) -> TagFiles:
    """A tag without pipeline layer files: ZeRO over data-parallel ranks only."""
    source = found.source
    for mp, _ in [*found.optim, *found.per_rank_model, *((mp, 0) for mp in found.shared_model)]:
        if mp != 0:  # without pipeline layer files, only tensor/model parallelism
            name = next(
                n
                for n in found.names
                if (m := OPTIM_FILE.match(n) or MODEL_FILE.match(n))
                and int(m.group(m.re.groups)) == mp
            )
            raise UnsupportedLayoutError(
                f"{source}: {name} belongs to model-parallel rank {mp}; ckptkit reads ZeRO "
                "checkpoints without tensor/model parallelism only (mp_rank_00; or pipeline "
                "parallel, with layer_XX-model_states.pt files)"
            )
    if not found.optim:
        raise MissingFileError(f"{source}: no *_optim_states.pt files")
    ranks = _all_ranks({dp: f for (_, dp), f in found.optim.items()}, source, "optimizer-state")
    if found.per_rank_model:
        per_rank = {dp: f for (_, dp), f in found.per_rank_model.items()}
        model = _all_ranks(per_rank, source, "model-state", len(ranks))
    elif found.shared_model:
        model = list(found.shared_model.values())
    else:
        raise MissingFileError(f"{source}: no *_model_states.pt file")
    return TagFiles(found.prefix, ranks, model, found.sizes, found.skipped)


def _pipeline_files(found: _Listing) -> TagFiles:
    """A pipeline-parallel tag: one ``mp_rank_{stage}`` model-state file per stage and, per
    stage, the ZeRO optimizer partitions of its data-parallel ranks."""
    source = found.source
    if found.per_rank_model:
        name = next(iter(found.per_rank_model.values())).rsplit("/", 1)[-1]
        raise UnsupportedLayoutError(
            f"{source}: {name} (per-rank model states: ZeRO stage 3) beside pipeline layer "
            "files; ckptkit reads DeepSpeed pipeline checkpoints with ZeRO stage 0-1 only "
            "(DeepSpeed itself refuses pipeline parallelism with ZeRO stage 2 or 3)"
        )
    if not found.shared_model:
        raise MissingFileError(
            f"{source}: pipeline layer files but no mp_rank_XX_model_states.pt (one per stage)"
        )
    stages = _all_ranks(found.shared_model, source, "pipeline-stage model-state (mp_rank_XX)")
    if not found.optim:  # ZeRO stage 0, or every partition missing: the model states tell
        stage_files = [StageFiles(model, []) for model in stages]
        layers = dict(sorted(found.layers.items()))
        return TagFiles(found.prefix, [], stages, found.sizes, found.skipped, layers, stage_files)
    by_stage: dict[int, dict[int, str]] = {}
    for (mp, dp), name in found.optim.items():
        by_stage.setdefault(mp, {})[dp] = name
    extra = sorted(set(by_stage) - set(range(len(stages))))
    if extra:
        raise MissingFileError(
            f"{source}: optimizer partitions of pipeline stage {extra[0]}, but its model states "
            f"(mp_rank_{extra[0]:02d}_model_states.pt) is missing"
        )
    world = max(len(ranks) for ranks in by_stage.values())
    stage_files = []
    for stage, model in enumerate(stages):
        if stage not in by_stage:
            raise MissingFileError(
                f"{source}: no optimizer partitions of pipeline stage {stage} "
                f"(zero_pp_rank_*_mp_rank_{stage:02d}_optim_states.pt)"
            )
        ranks = _all_ranks(by_stage[stage], source, f"stage {stage} optimizer-state", world)
        stage_files.append(StageFiles(model, ranks))
    return TagFiles(
        found.prefix,
        [f for s in stage_files for f in s.optim],
        stages,
        found.sizes,
        found.skipped,
        dict(sorted(found.layers.items())),
        stage_files,
    )


def _refuse_unsupported(name: str, size: int, source: str) -> None:
    """An :class:`UnsupportedLayoutError` for DeepSpeed files of layouts ckptkit recognises but
    does not read."""
    if size < 0 and name == OFFLOAD_DIR:
        raise UnsupportedLayoutError(
            f"{source}: {name}/ holds ZeRO-Infinity NVMe-offloaded optimizer state (swap "
            "files); ckptkit does not read NVMe-offloaded ZeRO checkpoints"
        )
    if MOE_FILE.search(name):
        raise UnsupportedLayoutError(
            f"{source}: {name} is a DeepSpeed MoE (expert-parallel) file; ckptkit does not "
            "read DeepSpeed MoE checkpoints"
        )
    layer = LAYER_FILE.match(name)
    if layer and layer.group(2) is not None and int(layer.group(2)) != 0:
        raise UnsupportedLayoutError(
            f"{source}: {name} is tensor-parallel rank {int(layer.group(2))}'s slice of "
            f"pipeline layer {int(layer.group(1))}; ckptkit reads DeepSpeed pipeline "
            "checkpoints without tensor parallelism only (pipeline + tensor parallel: the "
            "layer files do not record which dimension each tensor is split along)"
        )


def _all_ranks(
    files: Mapping[int, str], source: str, what: str, world: int | None = None
) -> list[str]:
    """Files of ranks 0..world-1 in order (world: as many as found); a missing one named."""
    world = len(files) if world is None else world
    if max(files) >= world or len(files) != world:
        last = max(max(files) + 1, world)
        missing = first_missing(files, last)
        raise MissingFileError(
            f"{source}: {what} files of ranks {missing} are missing "
            f"({count_missing(files, last)} in all; found ranks up to {max(files)})"
        )
    return [files[r] for r in range(world)]


__all__ = [
    "LATEST",
    "NAME",
    "SCRIPTS",
    "StageFiles",
    "TagFiles",
    "detect",
    "latest_tag",
    "tags_below",
    "tags_text",
    "list_tag_files",
    "tag_evidence",
]
