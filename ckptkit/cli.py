"""The ``ckptkit`` command line: ``inspect``, ``unshard``, ``convert``, ``diff``, ``sizes``.

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
from .errors import CheckpointError, UsageError

EXIT_ERROR = 2


#: Characters a checkpoint's names may hold that a terminal would act on (C0/C1 controls but
#: newline and tab, DEL, bidirectional overrides): printed escaped, as ``\x1b``.
_UNPRINTABLE = {
    c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    for c in [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(c) not in "\n\t"
}


def printable(text: str) -> str:
    """``text`` with every character a terminal would interpret escaped (names come from the
    checkpoint: a key can hold an escape sequence that retitles the window or sets the
    clipboard)."""
    return text.translate(_UNPRINTABLE)


class _PrintableStream:
    """A text stream that escapes what :func:`printable` escapes before writing."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkit`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    stdout = sys.stdout
    sys.stdout = _PrintableStream(stdout)
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. `ckptkit inspect … | head`
        return 0
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"ckptkit: error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("ckptkit: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptkit", description="Inspect PyTorch checkpoints safely."
    )
    parser.add_argument("--version", action="version", version=f"ckptkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_inspect, _add_unshard, _add_convert, _add_diff, _add_sizes, _add_verify):
        add(commands)
    return parser


def _add_inspect(commands) -> None:
    inspect = commands.add_parser("inspect", help="summarise a checkpoint without loading tensors")
    inspect.add_argument("path", help="checkpoint directory or fsspec URL (s3://…)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--top", type=int, default=10, metavar="N", help="largest tensors to list (default 10)"
    )
    inspect.set_defaults(run=_inspect)


def _add_unshard(commands) -> None:
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


def _add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="rewrite a checkpoint as DCP (or unshard it)")
    _add_transfer_arguments(convert)
    convert.add_argument(
        "--to", choices=["dcp", "torch", "safetensors"], required=True, help="output format"
    )
    convert.set_defaults(run=_convert)


def _add_diff(commands) -> None:
    diff = commands.add_parser(
        "diff",
        help="compare two checkpoints key by key (exit 0: equal within tolerance, 1: different)",
    )
    diff.add_argument("a", help="checkpoint path or fsspec URL")
    diff.add_argument("b", help="checkpoint path or fsspec URL")
    diff.add_argument("--keys", nargs="+", metavar="GLOB", help="only keys matching these globs")
    diff.add_argument(
        "--rtol",
        type=float,
        default=1e-5,
        help="tolerance relative to each tensor's own scale (its largest |value| and its norm); "
        "default 1e-5",
    )
    diff.add_argument("--atol", type=float, default=0.0, help="absolute tolerance added (0)")
    diff.add_argument(
        "--key-map",
        nargs="+",
        metavar="OLD=NEW",
        help="rename key prefixes on both sides before matching, e.g. pytorch_model.=model.",
    )
    diff.add_argument(
        "--all",
        action="store_true",
        help=f"list every key (default: keys that are not equal, {DIFF_LIST_CAP} per status)",
    )
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    diff.add_argument("--quiet", action="store_true", help="no progress bar")
    diff.set_defaults(run=_diff)


def _add_sizes(commands) -> None:
    sizes = commands.add_parser("sizes", help="bytes on disk of checkpoints side by side")
    sizes.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint paths or URLs")
    sizes.add_argument("--labels", nargs="+", metavar="LABEL", help="row names (default: paths)")
    sizes.add_argument("--json", action="store_true", help="machine-readable output")
    sizes.set_defaults(run=_sizes)


def _add_verify(commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="read everything and report damage (exit 0: sound, 1: problems found)",
    )
    verify.add_argument("path", help="checkpoint path or fsspec URL")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument("--no-crc", dest="crc", action="store_false", help="skip CRC-32 checks")
    verify.set_defaults(run=_verify)


def _add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint path or fsspec URL")
    parser.add_argument("dst", help="output directory (path or fsspec URL)")
    parser.add_argument("--keys", nargs="+", metavar="GLOB", help="only keys matching these globs")
    parser.add_argument(
        "--groups", nargs="+", metavar="GROUP", help="only these groups, e.g. model"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-verify-crc",
        dest="verify_crc",
        action="store_false",
        help="skip checking what is read against the stored CRC-32 (faster)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="GLOB",
        help="leave out keys matching this glob (repeatable), e.g. 'optim.*'",
    )
    parser.add_argument(
        "--objects",
        choices=["keep", "drop", "error"],
        default="keep",
        help="objects of classes ckptkit does not decode: write them back as pickled (keep, "
        "the default; loading them needs those classes), leave them out (drop) or stop (error)",
    )


def _source(args: argparse.Namespace):
    """The source checkpoint, opened with the CRC setting of ``--no-verify-crc``."""
    return open_checkpoint(args.src, verify_crc=args.verify_crc)


def _unshard(args: argparse.Namespace) -> int:
    from .convert import unshard

    result = unshard(
        _source(args),
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
        objects=args.objects,
        exclude=args.exclude,
    )
    print(result)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert

    result = convert(
        _source(args),
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        overwrite=args.overwrite,
        progress=not args.quiet,
        objects=args.objects,
        exclude=args.exclude,
    )
    print(result)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .diff import SAME, diff

    key_map = None
    if args.key_map:
        pairs = [item.split("=", 1) for item in args.key_map]
        if any(len(pair) != 2 for pair in pairs):
            raise UsageError(f"--key-map takes OLD=NEW prefixes, got {args.key_map}")
        key_map = dict(pairs)
    frame = diff(
        args.a,
        args.b,
        keys=args.keys,
        key_map=key_map,
        rtol=args.rtol,
        atol=args.atol,
        progress=not args.quiet and not args.json,
    )
    same = bool(frame["status"].isin(SAME).all())
    if args.json:
        json.dump(diff_json(frame, same), sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(diff_text(frame, same, show_all=args.all))
    return 0 if same else 1


def diff_json(frame, same: bool) -> dict:
    """The ``diff --json`` document: settings, verdict, counts per status and every row."""
    import math

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
        if isinstance(value, tuple):
            return list(value)
        return None if value is None or value != value else value

    rows = [
        {column: clean(value) for column, value in row.items()}
        for row in frame.astype(object).to_dict("records")
    ]
    return {
        "a": frame.attrs.get("a"),
        "b": frame.attrs.get("b"),
        "rtol": frame.attrs.get("rtol"),
        "atol": frame.attrs.get("atol"),
        "same": same,
        "counts": {k: int(v) for k, v in frame["status"].value_counts().items()},
        "keys": rows,
    }


#: Keys listed per status in ``diff``'s text output unless ``--all`` is given.
DIFF_LIST_CAP = 20


def diff_text(frame, same: bool, *, show_all: bool = False) -> str:
    """A human report: verdict and counts, then the keys of each status that is not ``equal``,
    worst first, at most :data:`DIFF_LIST_CAP` per status unless ``show_all``."""
    from .diff import STATUSES

    counts = frame["status"].value_counts()
    ordered = [status for status in reversed(STATUSES) if status in counts]
    verdict = "equal within tolerance" if same else "DIFFERENT"
    summary = ", ".join(f"{counts[status]} {status}" for status in ordered)
    lines = [
        f"a: {frame.attrs.get('a')}",
        f"b: {frame.attrs.get('b')}",
        f"{len(frame)} keys (rtol={frame.attrs.get('rtol')}, atol={frame.attrs.get('atol')}): "
        f"{summary or 'none'} -> {verdict}",
    ]
    for status in ordered:
        if status == "equal" and not show_all:
            continue
        rows = frame[frame["status"] == status]
        shown = rows if show_all else rows.head(DIFF_LIST_CAP)
        lines += ["", f"{status} ({len(rows)}):", _diff_table(shown)]
        if len(shown) < len(rows):
            lines.append(f"  … and {len(rows) - len(shown)} more (--all lists them)")
    return "\n".join(lines)


def _diff_table(rows) -> str:
    """The rows of one status, with the columns that say something for it."""
    columns = ["key", "dtype", "shape"]
    if rows["max_abs"].notna().any():
        columns += ["max_abs", "rel_l2", "cosine", "frac_outside"]
    if rows["note"].astype(bool).any():
        columns.append("note")
    table = rows[columns].astype(object)
    for column in columns:
        table[column] = [_cell(value) for value in table[column]]
    return table.to_string(index=False)


def _cell(value) -> str:
    """A table cell: floats to 3 significant digits, missing values blank."""
    if value is None or value != value:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _sizes(args: argparse.Namespace) -> int:
    from .sizes import compare_sizes

    frame = compare_sizes(*args.paths, labels=args.labels)
    if args.json:
        rows = [
            {"label": label, **{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}}
            for label, row in frame.to_dict("index").items()
        ]
        json.dump({"checkpoints": rows}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(sizes_text(frame))
    return 0


def sizes_text(frame) -> str:
    """The ``compare_sizes`` frame with byte counts in kB/MB/GB."""
    from .tables import human_bytes

    shown = frame.copy()
    for column in shown.columns:
        if column not in ("format", "files", "records", "ratio"):
            shown[column] = shown[column].map(human_bytes)
    shown["ratio"] = shown["ratio"].map(lambda r: f"{r:.3f}x")
    return shown.T.to_string()


def _verify(args: argparse.Namespace) -> int:
    from .verify import verify

    frame = verify(args.path, crc=args.crc)
    if args.json:
        rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
        json.dump({"path": args.path, "ok": frame.empty, "problems": rows}, sys.stdout)
        sys.stdout.write("\n")
    elif frame.empty:
        print(f"{args.path}: no problems found")
    else:
        print(f"{args.path}: {len(frame)} problem(s)")
        print(frame.to_string(index=False, max_colwidth=120))
    return 0 if frame.empty else 1


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
        f"{human_bytes(summary.total_bytes)} on disk, {summary.parameters_text}",
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
