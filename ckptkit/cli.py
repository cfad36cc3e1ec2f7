"""The ``ckptkit`` command line: ``inspect``, ``unshard``, ``convert``, ``merge-lora``, ``diff``,
``verify``, ``sizes``, ``stats`` (and ``notebooks`` / ``notebook``, from
:mod:`ckptkit.notebook_runs`).

Exit status: 0 done (and, for ``diff`` / ``verify``, nothing found), 1 differences or damage
found, 2 a usage error, something that is not a checkpoint, a checkpoint layout ckptkit does
not read, or a store that cannot be reached or used (one line on stderr), 130 interrupted.
Progress bars appear only on a terminal.
``inspect --json`` imports neither torch nor pandas, so it starts fast.

The module reads top to bottom: the entry point, the parser (one builder per command and the
argument groups they share), then one handler per command, each calling an operation and a
renderer of :mod:`ckptkit.views`.

Longer than most: eight commands' parsers and handlers; the renderers live in views/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__, notebook_runs
from .checkpoint import open as open_checkpoint
from .errors import CheckpointError, UsageError
from .ops import distributed
from .views.machine import diff_json, inspect_json, sizes_json, stats_csv, stats_json, verify_json
from .views.reports import (
    DIFF_LIST_CAP,
    diff_text,
    inspect_text,
    sizes_text,
    stats_text,
    unshard_text,
    verify_text,
)
from .views.terminal import PrintableStream, printable

__all__ = ["EXIT_ERROR", "EXIT_FOUND", "EXIT_INTERRUPTED", "main"]

EXIT_FOUND = 1  # diff found differences, verify found damage
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptkit`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    stdout = sys.stdout
    sys.stdout = PrintableStream(stdout)
    code = None
    try:
        with distributed.from_environment() as ranks:  # under torchrun: a gloo process group
            if ranks is not None and ranks.rank != 0:  # every rank has the result: one prints
                sys.stdout = PrintableStream(open(os.devnull, "w"))  # noqa: SIM115
            code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # e.g. `ckptkit inspect … | head`: the reader has what it wanted
        _silence_stdout()
        return 0
    except KeyboardInterrupt:  # outputs are staged: nothing half-written is left behind
        if code is not None:  # the command had finished (its outputs published, reported)
            return code
        print("ckptkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"ckptkit: error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # a storage backend's own errors (botocore credentials, HTTP)
        if os.environ.get("CKPTKIT_DEBUG"):
            raise
        print(f"ckptkit: error: {type(exc).__name__}: {printable(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        sys.stdout = stdout


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests)
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptkit",
        description="Inspect, unshard, convert, compare and verify PyTorch checkpoints, safely.",
        epilog="exit status: 0 ok, 1 differences or damage found, 2 usage error or not a "
        "checkpoint, 130 interrupted. `ckptkit COMMAND --help` shows examples.",
    )
    parser.add_argument("--version", action="version", version=f"ckptkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_inspect,
        _add_unshard,
        _add_convert,
        _add_merge_lora,
        _add_diff,
        _add_sizes,
        _add_verify,
        _add_stats,
    ):
        add(commands)
    notebook_runs.add_commands(commands, _command)
    return parser


def _command(commands, name: str, help: str, examples: str) -> argparse.ArgumentParser:
    """A sub-command with its examples under ``--help``."""
    return commands.add_parser(
        name,
        help=help,
        description=help,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_inspect(commands) -> None:
    inspect = _command(
        commands,
        "inspect",
        "summarise a checkpoint without loading tensors or running its pickles",
        "  ckptkit inspect run/step3\n"
        "  ckptkit inspect s3://bucket/run/step3 --anon --top 20\n"
        "  ckptkit inspect model.safetensors --json | jq .summary",
    )
    inspect.add_argument("path", help="checkpoint directory or fsspec URL (s3://…)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    _add_wide_argument(inspect)
    inspect.add_argument(
        "--top",
        type=int,
        metavar="N",
        help="largest tensors to list (default: 10; with --json, every tensor)",
    )
    _add_remote_arguments(inspect)
    inspect.set_defaults(run=_inspect)


def _add_unshard(commands) -> None:
    unshard = _command(
        commands,
        "unshard",
        "write one unsharded file per group (model, optim, …), streaming in bounded memory",
        "  ckptkit unshard run/step3 out/\n"
        "  ckptkit unshard --groups model run/step3 out/ --to safetensors --max-shard-size 5GB\n"
        "  ckptkit unshard run/step3 out/ --exclude 'optim.*' --dtype bf16\n"
        "  ckptkit unshard run/step3 out/ --to safetensors --max-shard-size 2GB --workers 4\n"
        "  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\\n"
        "      -m ckptkit unshard s3://bucket/run/step3 s3://bucket/release/ --to safetensors \\\n"
        "      --max-shard-size 5GB   # every rank writes its share of the shards",
    )
    _add_transfer_arguments(unshard)
    unshard.add_argument(
        "--to", choices=["torch", "safetensors"], default="torch", help="output format"
    )
    unshard.add_argument(
        "--dtype",
        type=_dtype_name,
        help="cast floating tensors: bfloat16 (bf16), float16 (fp16, half), float32 (fp32)…",
    )
    unshard.add_argument(
        "--max-shard-size",
        type=_shard_size,
        metavar="SIZE",
        help="split safetensors output into shards of at most SIZE, with a unit: 5GB, 500MiB",
    )
    _add_names_argument(unshard)
    unshard.set_defaults(run=_unshard)


def _add_convert(commands) -> None:
    convert = _command(
        commands,
        "convert",
        "rewrite a checkpoint as DCP (or unshard it)",
        "  ckptkit convert run/step3 slim/ --to dcp --groups model   # drop the optimizer\n"
        "  ckptkit convert model.safetensors dcp_out/ --to dcp",
    )
    _add_transfer_arguments(convert)
    convert.add_argument(
        "--to", choices=["dcp", "torch", "safetensors"], required=True, help="output format"
    )
    _add_names_argument(convert)
    convert.set_defaults(run=_convert)


def _add_names_argument(parser: argparse.ArgumentParser) -> None:
    """``--names``: one file per group, or transformers' file names for the model group."""
    parser.add_argument(
        "--names",
        choices=["groups", "transformers"],
        default="groups",
        help="output names: one file per group (default), or 'transformers': the model group "
        "alone as save_pretrained names it (model.safetensors, or model-0000i-of-0000n "
        "shards + model.safetensors.index.json; --to safetensors), for from_pretrained",
    )


def _add_merge_lora(commands) -> None:
    merge = _command(
        commands,
        "merge-lora",
        "merge a PEFT LoRA adapter into its base model, as PEFT's merge_and_unload does",
        "  ckptkit merge-lora Llama-3-8B/ my-lora/ merged/\n"
        "  ckptkit merge-lora base/ adapter/ merged/ --dtype bf16 --max-shard-size 5GB",
    )
    merge.add_argument("base", help="the base checkpoint: path or fsspec URL")
    merge.add_argument(
        "adapter",
        help="the folder PEFT's save_pretrained wrote (adapter_config.json + adapter_model.*)",
    )
    merge.add_argument("dst", help="output directory (path or fsspec URL)")
    merge.add_argument(
        "--to", choices=["safetensors", "torch"], default="safetensors", help="output format"
    )
    merge.add_argument(
        "--dtype",
        type=_dtype_name,
        help="write floating tensors in this dtype (merged first in the base's own)",
    )
    merge.add_argument(
        "--max-shard-size",
        type=_shard_size,
        metavar="SIZE",
        help="split safetensors output into shards of at most SIZE, with a unit: 5GB, 500MiB",
    )
    merge.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _add_progress_arguments(merge)
    _add_remote_arguments(merge)
    merge.set_defaults(run=_merge_lora)


def _add_diff(commands) -> None:
    diff = _command(
        commands,
        "diff",
        "compare two checkpoints key by key (exit 0: equal within tolerance, 1: different)",
        "  ckptkit diff run/step1 run/step3\n"
        "  ckptkit diff run/step3 out/ --keys 'model.*' --json\n"
        "  ckptkit diff hf/ out/ --key-map pytorch_model.=model. --rtol 1e-2   # bf16 vs fp32",
    )
    diff.add_argument("a", help="checkpoint path or fsspec URL")
    diff.add_argument("b", help="checkpoint path or fsspec URL")
    diff.add_argument(
        "--keys", action="append", metavar="GLOB", help="only keys matching GLOB (repeatable)"
    )
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
        action="append",
        metavar="OLD=NEW",
        help="rename a key prefix on both sides before matching (repeatable), e.g. "
        "pytorch_model.=model.",
    )
    diff.add_argument(
        "--all",
        action="store_true",
        help=f"list every key (default: keys that are not equal, {DIFF_LIST_CAP} per status)",
    )
    diff.add_argument("--json", action="store_true", help="machine-readable output")
    _add_wide_argument(diff)
    _add_workers_argument(diff)
    _add_progress_arguments(diff)
    _add_remote_arguments(diff)
    diff.set_defaults(run=_diff)


def _add_sizes(commands) -> None:
    sizes = _command(
        commands,
        "sizes",
        "bytes on disk of checkpoints side by side, by group, dtype and overhead",
        "  ckptkit sizes run/step3 out_torch/ out_safetensors/\n"
        "  ckptkit sizes a/ b/ --labels dcp --labels safetensors --json",
    )
    sizes.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint paths or URLs")
    sizes.add_argument(
        "--labels", action="append", metavar="LABEL", help="row name (repeatable; default: paths)"
    )
    sizes.add_argument("--json", action="store_true", help="machine-readable output")
    _add_wide_argument(sizes)
    _add_remote_arguments(sizes)
    sizes.set_defaults(run=_sizes)


def _add_verify(commands) -> None:
    verify = _command(
        commands,
        "verify",
        "read everything and report damage (exit 0: sound, 1: damage found, 2: not a checkpoint "
        "or an unsupported layout)",
        "  ckptkit verify run/step3\n  ckptkit verify s3://bucket/run/step3 --json",
    )
    verify.add_argument("path", help="checkpoint path or fsspec URL")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    _add_wide_argument(verify)
    verify.add_argument(
        "--no-verify-crc",
        "--no-crc",  # its earlier name
        dest="crc",
        action="store_false",
        help="skip CRC-32 checks (faster; sizes and structure are still checked)",
    )
    _add_workers_argument(verify)
    _add_remote_arguments(verify)
    verify.set_defaults(run=_verify)


def _add_stats(commands) -> None:
    stats = _command(
        commands,
        "stats",
        "per-tensor min, max, mean, std, L2 norm, zero/NaN/Inf fractions (one pass)",
        "  ckptkit stats run/step3 --groups model\n"
        "  ckptkit stats out/model.safetensors --fingerprint --csv > stats.csv",
    )
    stats.add_argument("path", help="checkpoint path or fsspec URL")
    _add_selection_arguments(stats, exclude=False)
    stats.add_argument(
        "--fingerprint",
        action="store_true",
        help="also hash every tensor: per-tensor fingerprints and the checkpoint's, equal "
        "across formats and world sizes for equal contents",
    )
    output = stats.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument("--csv", action="store_true", help="one CSV row per tensor")
    _add_wide_argument(stats)
    _add_progress_arguments(stats)
    _add_remote_arguments(stats)
    stats.set_defaults(run=_stats)


def _add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--anon``, passed to fsspec; and
    ``--allow-root DIR`` (repeatable), a folder local links may lead into."""
    parser.add_argument(
        "--allow-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder symlinks in a local checkpoint may lead into (repeatable), e.g. where a "
        "step folder was moved and linked; by default links may lead only inside the checkpoint",
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec storage option (repeatable), e.g. endpoint_url=http://localhost:9000 "
        "or profile=research; VALUE is read as JSON when it parses (true, 3), else as text",
    )
    parser.add_argument(
        "--anon", action="store_true", help="anonymous access (public buckets), as anon=true"
    )


def _add_wide_argument(parser: argparse.ArgumentParser) -> None:
    """``--wide``: text output whole, every column and key, however wide the terminal."""
    parser.add_argument(
        "--wide",
        action="store_true",
        help="show every column and whole keys (default: fit the terminal's width, long keys "
        "cut in the middle with …)",
    )


def _add_progress_arguments(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--quiet``: a progress bar on stderr; by default only on a terminal."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--progress", action="store_true", default=None, help="show a progress bar, always"
    )
    group.add_argument(
        "--quiet", dest="progress", action="store_false", help="no progress bar, ever"
    )


def _add_selection_arguments(parser: argparse.ArgumentParser, *, exclude: bool) -> None:
    """Repeatable ``--keys`` / ``--groups`` (and ``--exclude``): one value per flag, so they
    never swallow the positional arguments."""
    parser.add_argument(
        "--keys", action="append", metavar="GLOB", help="only keys matching GLOB (repeatable)"
    )
    parser.add_argument(
        "--groups",
        action="append",
        metavar="GROUP",
        help="only this group, e.g. model (repeatable)",
    )
    if exclude:
        parser.add_argument(
            "--exclude",
            action="append",
            metavar="GLOB",
            help="leave out keys matching GLOB (repeatable), e.g. 'optim.*'",
        )


def _add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """``--workers N``: threads in this process (under torchrun, in each rank)."""
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="work on N threads at once (default 1); under torchrun the work is also spread "
        "over the ranks",
    )


def _add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint path or fsspec URL")
    parser.add_argument("dst", help="output directory (path or fsspec URL)")
    _add_selection_arguments(parser, exclude=True)
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _add_workers_argument(parser)
    _add_progress_arguments(parser)
    _add_remote_arguments(parser)
    parser.add_argument(
        "--no-verify-crc",
        dest="verify_crc",
        action="store_false",
        help="skip checking what is read against the stored CRC-32 (faster)",
    )
    parser.add_argument(
        "--objects",
        choices=["keep", "drop", "error"],
        default=None,
        help="objects whose pickle names globals not known to be harmless: write them back "
        "as pickled (keep, the default; loading the output imports or calls those globals, and "
        "torch.load(weights_only=True) refuses it), leave them out (drop) or stop (error); "
        "tensors left as objects (DTensors outside a set of rank files) stop the command unless "
        "keep is given",
    )


#: Short dtype names people type, and the names ckptkit (and torch) use.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "fp64": "float64", "double": "float64"}  # fmt: skip


def _dtype_name(text: str) -> str:
    """``--dtype``: a floating dtype name or alias; the valid ones listed when it is neither."""
    from .dtypes import BY_NAME

    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    dt = BY_NAME.get(name)
    if dt is None or not dt.is_floating:
        valid = sorted(n for n, d in BY_NAME.items() if d.is_floating)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a floating dtype; valid: {', '.join(valid)} "
            f"(or {', '.join(sorted(DTYPE_ALIASES))})"
        )
    return name


#: ``--max-shard-size`` without a unit is bytes; smaller than this it is surely a mistake.
MIN_SHARD_BYTES = 1 << 20


def _shard_size(text: str) -> int:
    """``--max-shard-size``: ``5GB``, ``500MiB``…; a bare number under 1 MiB is refused (``5``
    meant 5 GB, not 5 bytes and thousands of files)."""
    from .units import parse_size

    try:
        size = parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_SHARD_BYTES and text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size} bytes; give a unit, e.g. {text.strip()}GB or {text.strip()}MiB"
        )
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return size


def _storage_options(args: argparse.Namespace) -> dict | None:
    """The fsspec options of ``--storage-option`` / ``--anon`` (None when there are none)."""
    options: dict = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    if args.anon:
        options["anon"] = True
    return options or None


def _progress(args: argparse.Namespace, *, machine_output: bool = False) -> bool:
    """Whether to draw a progress bar: as asked, else only when stderr is a terminal and the
    output is for people."""
    if args.progress is not None:
        return args.progress
    return not machine_output and sys.stderr.isatty()


def _source(args: argparse.Namespace):
    """The source checkpoint, opened with the CRC setting of ``--no-verify-crc``."""
    return open_checkpoint(
        args.src,
        verify_crc=args.verify_crc,
        storage_options=_storage_options(args),
        allow_roots=args.allow_root,
    )


def _opened(args: argparse.Namespace, path: str, **kwargs: Any) -> Any:
    """``path`` itself, or the checkpoint there opened with the ``--allow-root`` folders when
    any are given (operations take an opened checkpoint as it is)."""
    if not args.allow_root:
        return path
    return open_checkpoint(
        path, storage_options=_storage_options(args), allow_roots=args.allow_root, **kwargs
    )


def _key_map(args: argparse.Namespace) -> dict[str, str] | None:
    """The prefix renames of ``--key-map OLD=NEW`` (None when there are none)."""
    if not args.key_map:
        return None
    pairs = [item.split("=", 1) for item in args.key_map]
    if any(len(pair) != 2 for pair in pairs):
        raise UsageError(f"--key-map takes OLD=NEW prefixes, got {args.key_map}")
    return dict(pairs)


def _print_json(document: dict, *, allow_nan: bool = True) -> None:
    """Write a ``--json`` document to stdout, one line (NaN refused where ``allow_nan`` is
    False: the renderer should have mapped it)."""
    json.dump(document, sys.stdout, allow_nan=allow_nan)
    sys.stdout.write("\n")


def _inspect(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(
        args.path, storage_options=_storage_options(args), allow_roots=args.allow_root
    )
    if args.json:
        _print_json(inspect_json(ckpt, top=args.top))
    else:
        print(inspect_text(ckpt, top=10 if args.top is None else args.top, wide=args.wide))
    return 0


def _unshard(args: argparse.Namespace) -> int:
    from .ops.convert import unshard

    result = unshard(
        _source(args),
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=_progress(args),
        objects=args.objects,
        exclude=args.exclude,
        workers=args.workers,
        storage_options=_storage_options(args),
        names=args.names,
    )
    print(unshard_text(result))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .ops.convert import convert

    result = convert(
        _source(args),
        args.dst,
        to=args.to,
        keys=args.keys,
        groups=args.groups,
        overwrite=args.overwrite,
        progress=_progress(args),
        objects=args.objects,
        exclude=args.exclude,
        workers=args.workers,
        storage_options=_storage_options(args),
        names=args.names,
    )
    print(unshard_text(result))
    return 0


def _merge_lora(args: argparse.Namespace) -> int:
    from .ops.lora import merge_lora

    result = merge_lora(
        _opened(args, args.base),
        args.adapter,
        args.dst,
        to=args.to,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=_progress(args),
        storage_options=_storage_options(args),
    )
    print(unshard_text(result))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .ops.diff import SAME, diff

    frame = diff(
        _opened(args, args.a),
        _opened(args, args.b),
        keys=args.keys,
        key_map=_key_map(args),
        rtol=args.rtol,
        atol=args.atol,
        progress=_progress(args, machine_output=args.json),
        workers=args.workers,
        storage_options=_storage_options(args),
    )
    for note in frame.attrs.get("notes", ()):  # keys lined up, hints: beside the report
        print(f"ckptkit: note: {printable(note)}", file=sys.stderr)
    same = bool(frame["status"].isin(SAME).all())
    if args.json:
        _print_json(diff_json(frame, same), allow_nan=False)
    else:
        print(diff_text(frame, same, show_all=args.all, wide=args.wide))
    return 0 if same else EXIT_FOUND


def _sizes(args: argparse.Namespace) -> int:
    from .ops.sizes import compare_sizes

    frame = compare_sizes(
        *(_opened(args, path) for path in args.paths),
        labels=args.labels,
        storage_options=_storage_options(args),
    )
    if args.json:
        _print_json(sizes_json(frame))
    else:
        print(sizes_text(frame, wide=args.wide))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .ops.verify import verify

    frame = verify(
        _opened(args, args.path, verify_crc=args.crc),
        crc=args.crc,
        workers=args.workers,
        storage_options=_storage_options(args),
    )
    if args.json:
        _print_json(verify_json(args.path, frame))
    else:
        print(verify_text(args.path, frame, wide=args.wide))
    return 0 if frame.empty else EXIT_FOUND


def _stats(args: argparse.Namespace) -> int:
    from .ops.stats import stats

    frame = stats(
        _opened(args, args.path),
        keys=args.keys,
        groups=args.groups,
        fingerprints=args.fingerprint,
        progress=_progress(args, machine_output=args.json or args.csv),
        storage_options=_storage_options(args),
    )
    if not args.fingerprint:
        frame = frame.drop(columns="fingerprint")
    if args.json:
        _print_json(stats_json(frame), allow_nan=False)
    elif args.csv:
        sys.stdout.write(stats_csv(frame))
    else:
        print(stats_text(frame, wide=args.wide))
    return 0


if __name__ == "__main__":
    sys.exit(main())
