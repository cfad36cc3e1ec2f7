"""The ``ckptkit`` command line: ``inspect``, ``unshard``, ``convert``.

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
    except (CheckpointError, OSError, ValueError) as exc:
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

    unshard = commands.add_parser(
        "unshard", help="write one unsharded file per group (model, optim, …)"
    )
    _add_transfer_arguments(unshard)
    unshard.add_argument(
        "--to", choices=["torch", "safetensors"], default="torch", help="output format"
    )
    unshard.add_argument("--dtype", help="cast floating tensors, e.g. bfloat16")
    unshard.add_argument("--max-shard-size", help="split safetensors output, e.g. 5GB")
    unshard.set_defaults(run=_unshard)

    convert = commands.add_parser("convert", help="rewrite a checkpoint as DCP (or unshard it)")
    _add_transfer_arguments(convert)
    convert.add_argument(
        "--to", choices=["dcp", "torch", "safetensors"], required=True, help="output format"
    )
    convert.set_defaults(run=_convert)
    return parser


def _add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint path or fsspec URL")
    parser.add_argument("dst", help="output directory (path or fsspec URL)")
    parser.add_argument("--keys", nargs="+", metavar="GLOB", help="only keys matching these globs")
    parser.add_argument(
        "--groups", nargs="+", metavar="GROUP", help="only these groups, e.g. model"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _unshard(args: argparse.Namespace) -> int:
    from .convert import unshard

    result = unshard(
        args.src,
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(result)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert

    result = convert(
        args.src,
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(result)
    return 0


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
