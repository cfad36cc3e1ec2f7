"""The ``ckptkit`` command line: ``ckptkit inspect PATH [--json]``.

Errors print one line on stderr and exit with status 2; ``inspect --json`` imports neither torch
nor pandas, so it starts fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from .checkpoint import Checkpoint
from .checkpoint import open as open_checkpoint
from .errors import CheckpointError

EXIT_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkit`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError) as exc:
        print(f"ckptkit: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. `ckptkit inspect … | head`
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptkit", description="Inspect PyTorch checkpoints safely."
    )
    parser.add_argument("--version", action="version", version=f"ckptkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", help="summarise a checkpoint without loading tensors")
    inspect.add_argument("path", help="checkpoint directory or fsspec URL (s3://…)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--top", type=int, default=10, metavar="N", help="largest tensors to list (default 10)"
    )
    inspect.set_defaults(run=_inspect)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.path)
    if args.json:
        json.dump(inspect_json(ckpt), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(inspect_text(ckpt, top=args.top))
    return 0


def inspect_json(ckpt: Checkpoint) -> dict:
    """The ``inspect --json`` document, built from the catalog alone (no pandas, no torch)."""
    catalog = ckpt.catalog
    sizes = ckpt.storage.sizes(catalog.files)
    return {
        "format": catalog.format,
        "url": ckpt.url,
        "tensors": [
            {
                "key": e.key,
                "dtype": e.dtype.name,
                "shape": list(e.shape),
                "nbytes": e.nbytes,
                "n_chunks": e.n_chunks,
            }
            for e in catalog.tensors()
        ],
        "objects": [{"key": e.key, "nbytes": e.nbytes} for e in catalog.objects()],
        "files": [{"file": f, "size": sizes.get(f)} for f in catalog.files],
    }


def inspect_text(ckpt: Checkpoint, *, top: int = 10) -> str:
    """A human summary: totals, bytes by group and dtype, the largest tensors."""
    from .tables import human_bytes

    summary = ckpt.summary()
    tensors = ckpt.tensors
    largest = tensors.nlargest(top, "nbytes")[
        ["key", "dtype", "shape", "nbytes", "n_chunks", "sharded_dims"]
    ]
    largest = largest.assign(nbytes=largest["nbytes"].map(human_bytes))
    by_group = summary.by_group.assign(
        nbytes=summary.by_group["nbytes"].map(human_bytes),
        object_bytes=summary.by_group["object_bytes"].map(human_bytes),
    )
    by_rank = summary.by_rank.assign(size=summary.by_rank["size"].map(human_bytes))
    lines = [
        f"{ckpt.format} checkpoint {ckpt.url}",
        f"  {len(tensors)} tensors, {len(ckpt.catalog.objects())} objects, {len(ckpt.catalog.files)} files, "
        f"{human_bytes(summary.total_bytes)} on disk, {summary.parameters:,} parameters in 'model'",
        "",
        "by group:",
        by_group.to_string(),
        "",
        "by dtype:",
        summary.by_dtype.assign(nbytes=summary.by_dtype["nbytes"].map(human_bytes)).to_string(),
        "",
        "by rank:",
        by_rank[["size", "records"]].to_string(),
        "",
        f"largest {len(largest)} tensors:",
        largest.to_string(index=False),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
