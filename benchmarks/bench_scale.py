"""Scale-out: unshard a ~4 GiB DCP with 1, 2 and 4 torchrun ranks and with ``workers=1,2,4``.

Generates (once, cached in ``benchmarks/out/``) fp32 DCP checkpoints of ``--tensors`` x
[16384, 1024] tensors (64 MiB each; 64 → 4 GiB) written by torch's own ``dcp.save`` from 2 gloo
ranks holding DTensors, row-sharded (``Shard(0)``) and column-sharded (``Shard(1)``). Each is
unsharded to safetensors in 512 MiB shards (8 files: the work items) by ``ckptkit unshard``
in a fresh process with ``--workers N``, and under ``torchrun --nproc-per-node N``; optionally
(``--s3``) from the loopback moto S3 server. Prints wall, CPU, bytes moved (read + written),
peak RSS above the interpreter per rank, and the speed-up and scaling efficiency (speed-up ÷
workers or ranks) against 1 worker measured in the same run, interleaved.
Usage: ``python benchmarks/bench_scale.py [--tensors 64] [--repeat 3] [--s3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    Run,
    cached_input,
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

SHAPE = (16384, 1024)  # float32: 64 MiB per tensor
WORLD_SIZE = 2  # ranks that wrote the source
LAYOUTS = {"rows": 0, "cols": 1}
SHARD = "512MiB"
COUNTS = (1, 2, 4)
WORK = OUT_DIR / "scale_work"
GENERATOR_VERSION = 1

#: Run by every rank (or the single process): the CLI, then this process's own peak RSS into
#: ``$BENCH_RANKS/rank{r}.json`` (ranks share one stdout, where their lines would interleave),
#: so each rank's memory is measured, not torchrun's.
CLI_CHILD = """
import os, resource, sys, json
from ckptkit.cli import main
code = main(sys.argv[1:])
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["BENCH_RANKS"], f"rank{rank}.json"), "w") as handle:
    json.dump({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, handle)
sys.exit(code)
"""


def _save_rank(rank: int, world_size: int, path: str, shard_dim: int, n_tensors: int) -> None:
    """Rank body of :func:`write_source`: seeded tensors scattered from rank 0 as DTensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(n_tensors):
        gen = torch.Generator().manual_seed(i)
        full = torch.randn(SHAPE, generator=gen) if rank == 0 else torch.empty(SHAPE)
        model[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(shard_dim)])
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_source(path: Path, shard_dim: int, n_tensors: int) -> None:
    from ckptkit.examples import _spawn

    _spawn(_save_rank, WORLD_SIZE, str(path), shard_dim, n_tensors)


def ensure_source(layout: str, n_tensors: int) -> Path:
    params = {"tensors": n_tensors, "shape": list(SHAPE), "layout": layout, "v": GENERATOR_VERSION}
    return cached_input(
        OUT_DIR / f"scale_{layout}_{n_tensors}x{SHAPE[0]}x{SHAPE[1]}",
        params,
        f"from bench_scale import write_source\nwrite_source(out, {LAYOUTS[layout]}, {n_tensors})",
        f"dcp.save from {WORLD_SIZE} ranks",
    )


def unshard_args(src: str, dst: Path, workers: int) -> list[str]:
    return [
        "unshard",
        src,
        str(dst),
        "--to",
        "safetensors",
        "--max-shard-size",
        SHARD,
        "--workers",
        str(workers),
        "--quiet",
    ]


def argv_for(mode: str, count: int, src: str, dst: Path) -> list[str]:
    """``workers``: one process with ``count`` threads; ``ranks``: torchrun with ``count``."""
    script = python_argv(CLI_CHILD)
    if mode == "workers":
        return [*script, *unshard_args(src, dst, count)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", str(count), "--no-python", sys.executable]
    return [*launcher, *script[1:], *unshard_args(src, dst, 1)]


def measure(mode: str, count: int, src: str, env: dict[str, str]) -> Run:
    dst, ranks = WORK / f"{mode}{count}", WORK / f"{mode}{count}.ranks"
    for stale in (dst, ranks):
        shutil.rmtree(stale, ignore_errors=True)
    ranks.mkdir(parents=True)
    result = run(argv_for(mode, count, src, dst), env={**env, "BENCH_RANKS": str(ranks)})
    reports = [json.loads(path.read_text()) for path in sorted(ranks.glob("rank*.json"))]
    result.report = {"per_rank_maxrss_kib": [r["maxrss_kib"] for r in reports]}
    for done in (dst, ranks):
        shutil.rmtree(done, ignore_errors=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64, help="64 MiB tensors (64 = 4 GiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--s3", action="store_true", help="also read the rows source from S3")
    args = parser.parse_args()
    before = environment()
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
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
