"""Where a legacy Megatron checkpoint's files are: the run directory's tracker, the iteration
directory's ``mp_rank_XX[_YYY]/model_optim_rng.pt`` rank files (Megatron-LM's
``get_checkpoint_name``), checked against the parallel sizes ``args`` states."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import CoverageError
from ...storage import Store
from ..parts.megatron_tp_rules import ModelArgs
from .errors import MegatronLegacyError

__all__ = [
    "RANK_DIR",
    "RANK_FILE",
    "RankFile",
    "check_grid",
    "rank_dirs",
    "rank_files",
]

#: One model-parallel rank's folder: ``mp_rank_<TP>`` or, with pipeline stages,
#: ``mp_rank_<TP>_<PP>``; a third number is the expert-parallel rank.
RANK_DIR = re.compile(r"^mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?(?:_(?P<ep>\d{3}))?$")
#: The file in each rank folder: model, optimizer and RNG state.
RANK_FILE = "model_optim_rng.pt"


@dataclass(frozen=True)
class RankFile:
    """One model-parallel rank's file: its folder (``label``), tensor- and pipeline-parallel
    ranks, and ``rank`` = ``pp · TP + tp``, the rank its chunks carry."""

    label: str
    tp: int
    pp: int
    rank: int

    @property
    def file(self) -> str:
        return f"{self.label}/{RANK_FILE}"


def rank_dirs(listing: dict[str, int]) -> list[str]:
    """The ``mp_rank_*`` folders in a directory listing, sorted."""
    return sorted(name for name, size in listing.items() if size < 0 and RANK_DIR.match(name))


def rank_files(storage: Store) -> list[RankFile]:
    """Every rank folder's file, by (pp, tp), with TP and PP ranks from the folder names
    (before ``args`` is read: the grid is checked by :func:`check_grid`). Expert-parallel
    folders (a third number) are refused; a folder without its file is a
    :class:`~ckptkit.errors.CoverageError` naming it."""
    names = rank_dirs(storage.listdir())
    if not names:
        raise MegatronLegacyError(f"{storage.describe()}: no mp_rank_XX/{RANK_FILE}")
    found = []
    for name in names:
        match = RANK_DIR.match(name)
        if match.group("ep") is not None:
            raise MegatronLegacyError(
                f"{storage.describe(name)}: an expert-parallel rank folder (mp_rank_TT_PPP_EEE); "
                "expert parallelism is not supported",
                file=name,
            )
        pp = int(match.group("pp")) if match.group("pp") is not None else 0
        found.append(RankFile(name, int(match.group("tp")), pp, 0))
    sizes = storage.sizes([r.file for r in found])
    missing = [r.file for r in found if sizes.get(r.file) is None]
    if missing:
        shown = ", ".join(storage.describe(f) for f in missing[:4])
        raise CoverageError(f"{shown}: missing; every rank folder holds its {RANK_FILE}")
    return sorted(found, key=lambda r: (r.pp, r.tp))


def check_grid(storage: Store, found: list[RankFile], args: ModelArgs) -> list[RankFile]:
    """The rank files in rank order (``pp · TP + tp``) once they are exactly the TP × PP grid
    ``args`` states, named as Megatron names them (``mp_rank_TT`` when PP = 1, else
    ``mp_rank_TT_PPP``); else a :class:`~ckptkit.errors.CoverageError` naming the missing
    folders, or a :class:`MegatronLegacyError` naming an unexpected one."""
    expected = {
        (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if args.pp > 1 else "")): (tp, pp)
        for pp in range(args.pp)
        for tp in range(args.tp)
    }
    present = {r.label for r in found}
    extra = sorted(present - set(expected))
    if extra:
        raise MegatronLegacyError(
            f"{storage.describe(extra[0])}: not a rank of this checkpoint: its args say "
            f"TP={args.tp}, PP={args.pp} (rank folders "
            f"{'mp_rank_TT_PPP' if args.pp > 1 else 'mp_rank_TT'}); mixed checkpoints?",
            file=extra[0],
        )
    missing = [name for name in expected if name not in present]
    if missing:
        shown = ", ".join(storage.describe(f"{name}/{RANK_FILE}") for name in missing[:4])
        more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
        raise CoverageError(
            f"{shown}{more}: missing; args say TP={args.tp} × PP={args.pp} = "
            f"{len(expected)} rank files, {len(present)} are there"
        )
    return [
        RankFile(label, tp, pp, pp * args.tp + tp)
        for label, (tp, pp) in sorted(expected.items(), key=lambda item: item[1][::-1])
    ]
