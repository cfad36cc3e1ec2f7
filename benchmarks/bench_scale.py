"""Scale-out: unshard a ~4 GiB DCP with 1, 2 and 4 torchrun ranks and with ``workers=1,2,4``.

Generates (once, cached in ``benchmarks/out/``) fp32 DCP checkpoints of ``--tensors`` x
[16384, 1024] tensors (64 MiB each; 64 → 4 GiB) written by torch's own ``dcp.save`` from 2 gloo
ranks holding DTensors, row-sharded (``Shard(0)``) and column-sharded (``Shard(1)``). Each is
unsharded to safetensors in 512 MiB shards (8 files: the work items) by ``ckptkit unshard``
in a fresh process with ``--workers N``, and under ``torchrun --nproc-per-node N``; optionally
(``--s3``) from the loopback moto S3 server. Prints wall, CPU, bytes moved (read + written),
peak RSS above the interpreter per rank, and the speed-up and scaling efficiency (speed-up ÷
workers or ranks) against 1 worker measured in the same run, interleaved.

Single-output scenario (``--single-output`` runs it alone; the default runs both): the rows
source unsharded into ONE ``model.safetensors`` (no ``--max-shard-size``: a single work item)
by ``ckptkit unshard SRC DST --to safetensors --workers 1`` and ``--workers 2``, beside the
plain Python copy of the same bytes (bench_unshard's floor) and a copy of those bytes into one
file by 1 and by 2 threads (byte ranges, ``pwrite``, then ``fsync`` as ckptkit's commit does):
whether 2 threads copy faster at all says whether the disk is the limit. Every ckptkit
output is hashed (SHA-256) to check that workers=2 writes the same bytes as workers=1. Goal
(issue 28): workers=2 ≥ 1.6× workers=1 where the disk is not the limit, bit-identical.
Usage: ``python benchmarks/bench_scale.py [--tensors 64] [--repeat 3] [--s3]
[--single-output] [--work-root DIR]`` (dev runs: ``--tensors 8 --repeat 1``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    Run,
    child_env,
    environment,
    load_line,
    markdown_table,
    median,
    progress,
    python_argv,
    repeat_interleaved,
    run,
    runs_json,
    write_json,
)
from bench_remote import S3_ENV, SERVER  # noqa: E402 - moto in a process of its own
from bench_unshard import COPY_BUFFER_MIB, PY_COPY, ensure_source, remove, tool_argv  # noqa: E402
from bench_unshard import _child as timed_child  # noqa: E402

SHAPE = (16384, 1024)  # float32: 64 MiB per tensor
LAYOUTS = {"rows": 0, "cols": 1}
SHARD = "512MiB"
COUNTS = (1, 2, 4)
WORK = OUT_DIR / "scale_work"
SINGLE_COUNTS = (1, 2)  # --workers for the single-output scenario
GOAL_SINGLE_SPEEDUP = 1.6  # one model.safetensors: workers=2 >= 1.6 x workers=1
GOAL_TEXT = "workers=2 ≥ 1.6× workers=1 where the disk is not the limit"

#: Run by every rank (or the single process): the CLI, then this process's own peak RSS and
#: the time ``main`` took (imports excluded) into ``$BENCH_RANKS/rank{r}.json`` (ranks share
#: one stdout, where their lines would interleave), so each rank's memory is measured, not
#: torchrun's.
CLI_CHILD = """
import os, resource, sys, json, time
from ckptkit.cli import main
t0 = time.perf_counter()
code = main(sys.argv[1:])
op_s = time.perf_counter() - t0
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["BENCH_RANKS"], f"rank{rank}.json"), "w") as handle:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    json.dump({"maxrss_kib": maxrss, "op_s": op_s}, handle)
sys.exit(code)
"""


def unshard_args(src: str, dst: Path, workers: int, shard: str | None = SHARD) -> list[str]:
    """The CLI's arguments; ``shard=None`` writes one file per group (no ``--max-shard-size``)."""
    split = [] if shard is None else ["--max-shard-size", shard]
    return [
        "unshard", src, str(dst), "--to", "safetensors", *split,
        "--workers", str(workers), "--quiet",
    ]  # fmt: skip


def argv_for(mode: str, count: int, src: str, dst: Path, shard: str | None = SHARD) -> list[str]:
    """``workers``: one process with ``count`` threads; ``ranks``: torchrun with ``count``."""
    script = python_argv(CLI_CHILD)
    if mode == "workers":
        return [*script, *unshard_args(src, dst, count, shard)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", str(count), "--no-python", sys.executable]
    return [*launcher, *script[1:], *unshard_args(src, dst, 1, shard)]


def measure(
    mode: str,
    count: int,
    src: str,
    env: dict[str, str],
    shard: str | None = SHARD,
    inspect: Callable[[Path], dict[str, Any]] | None = None,
) -> Run:
    """One unshard in fresh processes; ``inspect(dst)`` (e.g. hashing the output) runs on the
    output before it is deleted and adds to the run's report."""
    dst, ranks = WORK / f"{mode}{count}", WORK / f"{mode}{count}.ranks"
    for stale in (dst, ranks):
        shutil.rmtree(stale, ignore_errors=True)
    ranks.mkdir(parents=True)
    result = run(argv_for(mode, count, src, dst, shard), env={**env, "BENCH_RANKS": str(ranks)})
    reports = [json.loads(path.read_text()) for path in sorted(ranks.glob("rank*.json"))]
    result.report = {
        "per_rank_maxrss_kib": [r["maxrss_kib"] for r in reports],
        "op_s": max(r["op_s"] for r in reports),
    }
    if inspect is not None:
        result.report.update(inspect(dst))
    for done in (dst, ranks):
        remove(done)  # and sync: no writeback left pending for the next run
    return result


def baseline_rss_kib(env: dict[str, str], mode: str) -> int:
    """Peak RSS of the interpreter after the CLI's imports: each process's floor (a rank also
    imports torch.distributed for its process group; a plain run does not import torch)."""
    extra = ", torch.distributed" if mode == "ranks" else ""
    code = f"import ckptkit, ckptkit.cli{extra}\n_report()"
    return run(python_argv(code), env=env).report["maxrss_kib"]


def report(runs: dict[str, list[Run]], source_bytes: int, baselines: dict[str, int]) -> list[list]:
    """One row per run kind; speed-up against ``workers=1`` on the same source."""
    rows = []
    walls = {name: median([r.wall_s for r in results]) for name, results in runs.items()}
    for name, results in runs.items():
        place, mode, count = name.split(":")
        wall = walls[name]
        cpu = median([r.cpu_s for r in results])
        rss = max(max(r.report["per_rank_maxrss_kib"]) for r in results) - baselines[mode]
        speedup = walls[f"{place}:workers:1"] / wall
        rows.append(
            [
                place,
                f"{mode}={count}",
                f"{wall:.2f}",
                f"{cpu:.2f}",
                f"{2 * source_bytes / 2**30:.2f}",
                f"{source_bytes / 2**20 / wall:.0f}",
                f"{rss / 1024:.0f}",
                f"{speedup:.2f}x",
                f"{speedup / int(count):.2f}",
            ]
        )
    return rows


# -- one output file -------------------------------------------------------------------------


def copy_ranges(src: str, dst: str, threads: int, buffer_mib: int = COPY_BUFFER_MIB) -> None:
    """Copy the bytes of ``src``'s files, concatenated, into the one file ``dst``, by
    ``threads`` threads that each ``readinto`` a buffer of their own and ``pwrite`` one
    contiguous byte range, then ``fsync`` (ckptkit's commit fsyncs too): the plainest way two
    threads can fill one file, so how much faster 2 threads are than 1 shows whether the disk
    (or memory bandwidth), rather than the CPU, sets the pace."""
    files = [os.path.join(src, name) for name in sorted(os.listdir(src))]
    sizes = [os.path.getsize(path) for path in files]
    total = sum(sizes)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(out, total)

    def copy(lo: int, hi: int) -> None:
        buffer = memoryview(bytearray(buffer_mib << 20))
        base = 0
        for path, size in zip(files, sizes, strict=True):
            pos, end = max(lo, base), min(hi, base + size)
            if pos < end:
                with open(path, "rb", buffering=0) as f:
                    f.seek(pos - base)
                    while pos < end:
                        n = f.readinto(buffer[: min(len(buffer), end - pos)])
                        if not n:
                            raise EOFError(path)
                        done = 0
                        while done < n:
                            done += os.pwrite(out, buffer[done:n], pos + done)
                        pos += n
            base += size

    bounds = [total * t // threads for t in range(threads + 1)]
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, bounds[:-1], bounds[1:]))
        os.fsync(out)
    finally:
        os.close(out)


def output_digests(dst: Path) -> dict[str, Any]:
    """SHA-256 of every file an unshard wrote (the one ``model.safetensors``), for the check
    that workers=2 writes the same bytes as workers=1."""
    digests = {}
    for path in sorted(p for p in dst.iterdir() if p.is_file()):
        with open(path, "rb") as f:
            digests[path.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digests}


FLOOR = f"{PY_COPY} (floor)"


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (``ext4``, ``tmpfs``…), from the longest
    matching mount point in ``/proc/mounts``; ``unknown`` where there is none."""
    target, best, kind = str(path.resolve()).rstrip("/") + "/", "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                mount, fstype = line.split()[1:3]
                if target.startswith(mount.rstrip("/") + "/") and len(mount) >= len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def one_file_copy(threads: int) -> str:
    """The name of the :func:`copy_ranges` row for ``threads`` threads."""
    return f"python copy into one file, {threads} thread{'s' if threads > 1 else ''} + fsync"


def copy_job(src: Path, threads: int | None) -> Run:
    """One copy of ``src`` in a fresh python child: the floor (``threads=None``: bench_unshard's
    plain copy, file by file) or :func:`copy_ranges` on ``threads`` threads; the output is
    deleted (and synced) after."""
    dst = WORK / "copy"
    remove(dst)
    dst.mkdir(parents=True)
    if threads is None:
        argv = tool_argv(PY_COPY, src, dst)
    else:
        here = str(Path(__file__).resolve().parent)
        argv = timed_child(
            f"sys.path.insert(0, {here!r})\nfrom bench_scale import copy_ranges",
            f"copy_ranges({str(src)!r}, {str(dst / 'all.bin')!r}, {threads})",
        )
    result = run(argv)
    remove(dst)
    return result


def single_jobs(src: Path, env: dict[str, str]) -> dict[str, Callable[[], Run]]:
    """The single-output scenario's measurements, by name, in the order they run each round."""
    jobs: dict[str, Callable[[], Run]] = {FLOOR: lambda: copy_job(src, None)}
    for n in SINGLE_COUNTS:
        jobs[one_file_copy(n)] = lambda n=n: copy_job(src, n)
    for n in SINGLE_COUNTS:
        jobs[f"ckptkit --workers {n}"] = lambda n=n: measure(
            "workers", n, str(src), env, shard=None, inspect=output_digests
        )
    return jobs


def single_report(
    runs: dict[str, list[Run]], source_bytes: int, baseline_kib: int, fstype: str
) -> tuple[list[list[str]], list[str], dict[str, Any]]:
    """Table rows, verdict lines and the JSON summary of the single-output scenario. Times are
    the work inside each child (ckptkit: the CLI's ``main``; copies: the copy), medians."""
    op = {name: median([r.report["op_s"] for r in results]) for name, results in runs.items()}
    floor = op[FLOOR]
    rows = []
    for name, results in runs.items():
        is_ckptkit = name.startswith("ckptkit")
        if is_ckptkit:
            peak = max(max(r.report["per_rank_maxrss_kib"]) for r in results) / 1024
            over = f"{peak - baseline_kib / 1024:.0f}"
            first = {n: op[n] for n in runs if n.startswith("ckptkit")}
        else:
            peak = max(r.peak_rss_mib for r in results)
            over = "—"
            first = {n: op[n] for n in runs if n.startswith("python copy into")}
        base = next(iter(first.values())) if name in first else None
        digests = {json.dumps(r.report.get("sha256"), sort_keys=True) for r in results}
        rows.append(
            [
                name,
                f"{op[name]:.2f}",
                f"{median([r.wall_s for r in results]):.2f}",
                f"{median([r.cpu_s for r in results]):.2f}",
                f"{peak:.0f}",
                over,
                f"{source_bytes / 2**20 / op[name]:.0f}",
                f"{op[name] / floor:.2f}x",
                "—" if base is None else f"{base / op[name]:.2f}x",
                _digest_cell(digests) if is_ckptkit else "—",
            ]
        )
    speedup = op["ckptkit --workers 1"] / op["ckptkit --workers 2"]
    copy_gain = op[one_file_copy(1)] / op[one_file_copy(2)]
    all_digests = {
        json.dumps(r.report["sha256"], sort_keys=True)
        for name, results in runs.items()
        if name.startswith("ckptkit")
        for r in results
    }
    identical = len(all_digests) == 1
    disk_limited = copy_gain < GOAL_SINGLE_SPEEDUP
    in_memory = fstype in ("tmpfs", "ramfs")
    if not disk_limited:
        verdict = (
            f"the write path does not look like the limit (a plain copy gains ≥ "
            f"{GOAL_SINGLE_SPEEDUP}x from a second thread), so the goal applies to this run."
        )
    elif in_memory:
        verdict = (
            f"no disk is involved (outputs on {fstype}), yet a plain copy gains < "
            f"{GOAL_SINGLE_SPEEDUP}x from a second thread: memory bandwidth or a second core "
            "busy with other jobs (see the load average) is the limit, so this run cannot "
            "show the goal."
        )
    else:
        verdict = (
            f"the disk ({fstype}) looks like the limit (< {GOAL_SINGLE_SPEEDUP}x even for a "
            "plain copy), so this run cannot show the goal; `--work-root /dev/shm` takes the "
            "disk out."
        )
    met = speedup >= GOAL_SINGLE_SPEEDUP
    lines = [
        f"Goal (issue 28): {GOAL_TEXT}, outputs bit-identical.",
        f"- ckptkit workers=2 vs workers=1, one model.safetensors: {speedup:.2f}x "
        f"(goal ≥ {GOAL_SINGLE_SPEEDUP}x: {'MET' if met else 'MISSED'}).",
        f"- Is the disk the limit? The same bytes copied into one file (ending in fsync, as "
        f"ckptkit's commit) go {copy_gain:.2f}x faster on 2 threads than on 1: {verdict}",
        f"- ckptkit workers=1 / plain python copy (floor): "
        f"{op['ckptkit --workers 1'] / floor:.2f}x; workers=2 / floor: "
        f"{op['ckptkit --workers 2'] / floor:.2f}x.",
        "- Bit-identical: "
        + (
            f"yes, every workers=1 and workers=2 output has SHA-256 {_digest_cell(all_digests)}."
            if identical
            else f"NO: {len(all_digests)} different outputs: {sorted(all_digests)}."
        ),
    ]
    summary = {
        "speedup_workers2_vs_1": speedup,
        "copy_gain_2_threads_vs_1": copy_gain,
        "write_path_is_the_limit": disk_limited,
        "output_filesystem": fstype,
        "goal": {"value": speedup, "goal": GOAL_SINGLE_SPEEDUP, "met": met},
        "bit_identical": identical,
        "sha256": sorted(all_digests),
        "op_s_medians": op,
    }
    return rows, lines, summary


def _digest_cell(digests: set[str]) -> str:
    """A table cell for the SHA-256 digests of a set of runs: the one digest, shortened, or
    how many different outputs there were."""
    if len(digests) != 1:
        return f"{len(digests)} different!"
    found = json.loads(next(iter(digests)))
    return ", ".join(f"{name} {digest[:12]}…" for name, digest in found.items())


def main_single(args: argparse.Namespace, env: dict[str, str]) -> None:
    """The single-output scenario: measure, check the digests, print, write the JSON."""
    before = environment()
    src = ensure_source(args.layouts[0], args.tensors)
    source_bytes = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    progress(f"warm-up: reading {src.name} ({source_bytes / 2**30:.2f} GiB) into the page cache")
    for f in src.iterdir():
        with open(f, "rb") as handle:
            while handle.read(16 << 20):
                pass
    baseline = baseline_rss_kib(env, "workers")
    # one warm-up round, so no measured run pays first-time costs (cold imports, first writes)
    runs = repeat_interleaved(single_jobs(src, env), args.repeat, warmup=True)
    fstype = filesystem(WORK)
    rows, lines, summary = single_report(runs, source_bytes, baseline, fstype)
    headers = ["run", "wall s", "process wall s", "CPU s", "peak RSS MiB", "RSS+ MiB",
               "MiB/s", "/ python copy", "speed-up vs 1 thread", "output sha256"]  # fmt: skip
    print(
        f"\n### Single output file: {args.tensors} x {SHAPE} fp32 ({args.layouts[0]}, "
        f"{source_bytes / 2**30:.2f} GiB) into one model.safetensors, outputs in {WORK} "
        f"({fstype})\n"
    )
    print(f"Medians of {args.repeat} interleaved rounds; {load_line(before)}")
    print(
        "`wall s` is the work inside each fresh child (ckptkit: the CLI's main, imports "
        "excluded; copies: the copy); `process wall s` and `CPU s` are the whole process. "
        "RSS+ is above `import ckptkit, ckptkit.cli`. Speed-up is against the 1-thread row of "
        "the same kind.\n"
    )
    print(markdown_table(headers, rows))
    print()
    print("\n".join(lines))
    write_json(
        OUT_DIR / "bench_scale_single.json",
        {
            "environment": before,
            "after_loadavg": list(os.getloadavg()),
            "params": {"tensors": args.tensors, "layout": args.layouts[0], "work": str(WORK)},
            "source_bytes": source_bytes,
            "headers": headers,
            "table": rows,
            "summary": summary,
            "runs": runs_json(runs),
        },
    )
    if not summary["bit_identical"]:
        raise SystemExit("single output: workers=1 and workers=2 wrote different bytes")


def main() -> None:
    """Parse the options, then run the sharded scenario, the single-output one, or both."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64, help="64 MiB tensors (64 = 4 GiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--s3", action="store_true", help="also read the rows source from S3")
    parser.add_argument(
        "--single-output", action="store_true",
        help="run only the single-output scenario (one model.safetensors, workers 1 vs 2)",
    )  # fmt: skip
    parser.add_argument(
        "--work-root", type=Path, default=None,
        help="write the measured outputs under this folder (e.g. /dev/shm: no disk)",
    )  # fmt: skip
    args = parser.parse_args()
    global WORK
    if args.work_root is not None:
        WORK = args.work_root / "bench_scale_work"
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        if not args.single_output:
            main_shards(args, env)
        main_single(args, env)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def main_shards(args: argparse.Namespace, env: dict[str, str]) -> None:
    """The sharded scenario: 8 output files, ``--workers 1/2/4`` and torchrun ranks 2/4."""
    before = environment()
    sources = {layout: str(ensure_source(layout, args.tensors)) for layout in args.layouts}
    source_bytes = sum(
        f.stat().st_size for f in Path(sources[args.layouts[0]]).iterdir() if f.is_file()
    )
    server = None
    if args.s3:  # in a process of its own: its memory must not show in the children's RSS
        server = subprocess.Popen(
            [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        env = {**env, **S3_ENV, "AWS_ENDPOINT_URL": server.stdout.readline().strip()}
        sources["rows@s3"] = upload(sources[args.layouts[0]], env)
    jobs = {
        f"{place}:{mode}:{count}": (lambda m=mode, c=count, s=src: measure(m, c, s, env))
        for place, src in sources.items()
        for mode in ("workers", "ranks")
        for count in COUNTS
        if not (mode == "ranks" and count == 1)
    }
    WORK.mkdir(parents=True, exist_ok=True)
    baselines = {mode: baseline_rss_kib(env, mode) for mode in ("workers", "ranks")}
    runs = repeat_interleaved(jobs, args.repeat)
    rows = report(runs, source_bytes, baselines)
    headers = ["source", "run", "wall s", "CPU s", "GiB moved", "MiB/s", "RSS+ MiB/rank"]
    headers += ["speed-up", "efficiency"]
    table = markdown_table(headers, rows)
    print(f"{args.tensors} x {SHAPE} fp32 ({source_bytes / 2**30:.2f} GiB), {SHARD} shards")
    print(f"medians of {args.repeat} interleaved rounds; {load_line(before)}")
    print(table)
    print(
        f"cores: {os.cpu_count()}; speed-up is against workers=1 on the same source, efficiency "
        "= speed-up / (workers or ranks)"
    )
    write_json(
        OUT_DIR / "bench_scale.json",
        {"environment": before, "table": rows, "headers": headers, "runs": runs_json(runs)},
    )
    if server is not None:
        server.stdin.close()
        server.wait()


def upload(local: str, env: dict[str, str]) -> str:
    """Copy ``local`` to the loopback S3 server (from a child process); its ``s3://`` URL."""
    progress("uploading the rows source to the loopback S3 server")
    code = f"""
import fsspec
fs = fsspec.filesystem("s3")
fs.mkdir("bench-scale")
fs.put({local!r}, "bench-scale/rows", recursive=True)
"""
    run(python_argv(code), env=env)
    return "s3://bench-scale/rows"


if __name__ == "__main__":
    main()
