"""Finding a DeepSpeed ZeRO tag directory: detection, the tag a run directory's ``latest``
names, and sorting a tag's files by rank, with a clear error for the layouts recognised but
not read (model parallelism, pipeline layer files, MoE expert files, NVMe offload).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import FormatError, MissingFileError
from ...limits import count_missing, first_missing
from ...storage import Store
from ..detection import Detection, file_location

NAME = "deepspeed_zero"
LATEST = "latest"
#: Files DeepSpeed copies beside the tags: its converters, never read.
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
PIPELINE_FILE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
MOE_FILE = re.compile(r"(?:^|_)expp_rank_\d+_|(?:^|_)expert_\d+_mp_rank_")
#: Where ZeRO-Infinity copies its NVMe swap files (``offloaded_tensors/rank{N}/``).
OFFLOAD_DIR = "offloaded_tensors"
#: A tag name ``latest`` may give: one plain path component.
TAG = re.compile(r"^[A-Za-z0-9_.+=-]{1,255}$")
MAX_LATEST_BYTES = 4096


# --------------------------------------------------------------------------------------------
# Detection.


def detect(storage: Store) -> Detection | None:
    """A ZeRO tag directory (``*_optim_states.pt`` beside ``*_model_states.pt``), or its parent
    whose ``latest`` names one."""
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
        return None
    if not inner:
        return None
    lines = [f"{LATEST} names tag {tag!r}: reading {tag}/"]
    lines += [f"{tag}/{line}" for line in inner]
    lines += [f"{name} (DeepSpeed's converter, not read)" for name in SCRIPTS if name in listing]
    return Detection(NAME, storage, lines)


def tag_evidence(listing: Mapping[str, int]) -> list[str]:
    """Why a listing looks like a ZeRO tag directory (empty: it does not)."""
    optim = sorted(n for n in listing if OPTIM_FILE.match(n))
    model = sorted(n for n in listing if MODEL_FILE.match(n))
    other = sorted(n for n in listing if PIPELINE_FILE.match(n) or MOE_FILE.search(n))
    if not (optim and model) and not (other and (optim or model)):
        return []
    lines = []
    if model:
        lines.append(f"{model[0]} … ({len(model)} model-state files)")
    if optim:
        prefix = " (bf16_ prefix: bf16 training)" if optim[0].startswith("bf16_") else ""
        lines.append(f"{optim[0]} … ({len(optim)} optimizer partitions){prefix}")
    if other:
        lines.append(f"{other[0]} … (pipeline / MoE files: not supported)")
    return lines


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
class TagFiles:
    """The ZeRO files of one tag directory, relative to the checkpoint root."""

    prefix: str  # "" or "<tag>/"
    optim: list[str]  # by DP rank
    model: list[str]  # one (stages 1/2) or one per DP rank (stage 3)
    sizes: dict[str, int]
    skipped: dict[str, str]


def list_tag_files(storage: Store, prefix: str) -> TagFiles:
    """Sort a tag directory's files; a clear error for layouts recognised but not read."""
    where = prefix.rstrip("/")
    listing = storage.listdir(where)
    source = storage.describe(where)
    optim: dict[int, str] = {}
    per_rank_model: dict[int, str] = {}
    shared_model: list[str] = []
    skipped: dict[str, str] = {}
    kinds = set()
    for name, size in sorted(listing.items()):
        _refuse_unsupported(name, size, source)
        if size < 0:
            skipped[prefix + name] = (
                "a directory (offload or universal-checkpoint state?): not read"
            )
        elif (m := OPTIM_FILE.match(name)) is not None:
            kinds.add(bool(m.group(1)))
            optim[int(m.group(2))] = prefix + name
        elif (m := MODEL_FILE.match(name)) is not None:
            if m.group(1) is None:
                shared_model.append(prefix + name)
            else:
                per_rank_model[int(m.group(1))] = prefix + name
        else:
            skipped[prefix + name] = "not a ZeRO model-state or optimizer-state file"
    if len(kinds) > 1:
        raise FormatError(f"{source}: both bf16_ and plain optimizer-state files: two saves mixed")
    if not optim:
        raise MissingFileError(f"{source}: no *_optim_states.pt files")
    world = len(optim)
    ranks = _all_ranks(optim, world, source, "optimizer-state")
    if per_rank_model:
        model = _all_ranks(per_rank_model, world, source, "model-state")
    elif shared_model:
        model = shared_model
    else:
        raise MissingFileError(f"{source}: no *_model_states.pt file")
    sizes = {prefix + n: s for n, s in listing.items() if s >= 0}
    return TagFiles(prefix, ranks, model, sizes, skipped)


def _refuse_unsupported(name: str, size: int, source: str) -> None:
    """A clear error for DeepSpeed files of layouts ckptkit recognises but does not read."""
    if size < 0 and name == OFFLOAD_DIR:
        raise FormatError(
            f"{source}: {name}/ holds ZeRO-Infinity NVMe-offloaded optimizer state (swap "
            "files); ckptkit does not read NVMe-offloaded ZeRO checkpoints"
        )
    if PIPELINE_FILE.match(name) or MOE_FILE.search(name):
        raise FormatError(
            f"{source}: {name} is a DeepSpeed pipeline-parallel or MoE file; ckptkit reads "
            "ZeRO data-parallel checkpoints only (no pipeline / expert parallelism)"
        )
    found = OPTIM_FILE.match(name) or MODEL_FILE.match(name)
    if found and int(found.group(found.re.groups)) != 0:
        raise FormatError(
            f"{source}: {name} belongs to model-parallel rank "
            f"{int(found.group(found.re.groups))}; ckptkit reads ZeRO checkpoints without "
            "tensor/model parallelism only (mp_rank_00)"
        )


def _all_ranks(files: Mapping[int, str], world: int, source: str, what: str) -> list[str]:
    """Files of ranks 0..world-1 in order; a missing one named."""
    if max(files) >= world or len(files) != world:
        missing = first_missing(files, max(files) + 1)
        raise MissingFileError(
            f"{source}: {what} files of ranks {missing} are missing "
            f"({count_missing(files, max(files) + 1)} in all; found ranks up to {max(files)})"
        )
    return [files[r] for r in range(world)]


__all__ = [
    "LATEST",
    "NAME",
    "SCRIPTS",
    "TagFiles",
    "detect",
    "latest_tag",
    "list_tag_files",
    "tag_evidence",
]
