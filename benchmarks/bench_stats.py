"""Per-tensor statistics and fingerprints of a 1.5 GiB DCP in one streaming pass vs ``cp -r``.

Input: bench_unshard's row-sharded DCP (24 float32 [16384, 1024] tensors, 64 MiB each, saved
by ``dcp.save`` from 2 spawned gloo ranks; generated once and cached in ``benchmarks/out/``,
shared with bench_unshard). After one warm-up ``cp -r`` (page cache), measures in fresh
processes, round-robin: ``cp -r`` of the directory (the goal's anchor), ``cat`` of its files
to /dev/null (the read floor), a baseline (import ckptkit + pandas, open), and
``ckptkit.stats`` with fingerprints (the one pass the goal is about), without fingerprints,
and ``ckptkit.fingerprint`` alone. Checks once that the statistics of two tensors equal
torch's on the fully loaded tensors. Goals: stats wall <= 1.5 x cp; peak RSS above the
baseline <= largest tensor + 64 MiB. Two more rows open the checkpoint with
``verify_crc=False``: what checking the stored CRC-32 of every record costs (it stays on by
default: a corrupt record must raise a typed error, and a fingerprint detects nothing alone).
Usage: ``python benchmarks/bench_stats.py [--repeat N] [--small]`` (``--small``: a 4 x
[1024, 1024] input of its own, to check the script works in seconds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_unshard  # noqa: E402
from _measure import (  # noqa: E402
    OUT_DIR,
    Run,
    cached_input,
    environment,
    load_line,
    markdown_table,
    median,
    progress,
    python_argv,
    ratio,
    repeat_interleaved,
    run,
    runs_json,
    write_json,
)

GOAL_VS_CP = 1.5  # stats wall <= 1.5 x cp -r
RSS_SLACK_MIB = 64  # peak RSS above baseline <= largest tensor + 64 MiB
SMALL = (4, (1024, 1024))  # --small: tensors, shape
WORK = OUT_DIR / "stats_work"  # cp -r destinations, deleted after each run

CP = "cp -r (anchor)"
CAT = "cat > /dev/null (read floor)"
BASELINE = "baseline: import ckptkit, pandas + open"
STATS = "ckptkit.stats (+ fingerprints)"
STATS_ONLY = "ckptkit.stats(fingerprints=False)"
FINGERPRINT = "ckptkit.fingerprint"
STATS_NO_CRC = "ckptkit.stats (+ fingerprints), verify_crc=False"
STATS_ONLY_NO_CRC = "ckptkit.stats(fingerprints=False), verify_crc=False"
JOBS = [CP, CAT, BASELINE, STATS, STATS_ONLY, FINGERPRINT, STATS_NO_CRC, STATS_ONLY_NO_CRC]
CHECKED = [0, 23]  # tensors whose statistics are compared with torch's


# -- input -----------------------------------------------------------------------------------


def _save_small_rank(rank: int, world_size: int, path: str, n: int, shape: list[int]) -> None:
    """Rank body of the --small input: bench_unshard's layout at another size."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(n):
        full = (
            torch.randn(shape, generator=torch.Generator().manual_seed(i))
            if rank == 0
            else torch.empty(shape)
        )
        model[bench_unshard.key_name(i)] = distribute_tensor(full, mesh, [Shard(0)])
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def ensure_source(small: bool) -> tuple[Path, int, tuple[int, int]]:
    """The input directory, its tensor count and shape: bench_unshard's cached 1.5 GiB DCP, or
    the small one of --small."""
    if not small:
        return bench_unshard.ensure_source("rows"), bench_unshard.N_TENSORS, bench_unshard.SHAPE
    n, shape = SMALL
    params = {"tensors": n, "shape": list(shape), "world_size": bench_unshard.WORLD_SIZE}
    generate = f"""
        from ckptkit.examples import _spawn
        from bench_stats import _save_small_rank
        _spawn(_save_small_rank, {bench_unshard.WORLD_SIZE}, str(out), {n}, {list(shape)})
        """
    directory = cached_input(
        OUT_DIR / f"stats_small_{n}x{shape[0]}x{shape[1]}", params, generate, "small DCP"
    )
    return directory, n, shape


def data_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.iterdir() if p.is_file())


# -- measurements ----------------------------------------------------------------------------


def stats_argv(src: Path, call: str, *, verify_crc: bool = True) -> list[str]:
    """A child that imports ckptkit and pandas, opens ``src``, then times ``call`` alone."""
    return python_argv(
        f"""
        import ckptkit, pandas
        ckpt = ckptkit.open({str(src)!r}, verify_crc={verify_crc!r})
        ckpt.catalog
        t0, c0 = time.perf_counter(), time.process_time()
        result = {call}
        t1, c1 = time.perf_counter(), time.process_time()
        rows = len(result) if hasattr(result, "__len__") and not isinstance(result, str) else 1
        _report(op_s=t1 - t0, op_cpu_s=c1 - c0, rows=rows,
                torch_loaded=sys.modules.get("torch") is not None)
        """
    )


def jobs(src: Path) -> dict[str, Any]:
    def cp() -> Run:
        dst = WORK / "copy"
        shutil.rmtree(dst, ignore_errors=True)
        try:
            return run(["cp", "-r", str(src), str(dst)])
        finally:
            shutil.rmtree(dst, ignore_errors=True)

    baseline = python_argv(
        f"""
        import ckptkit, pandas
        ckptkit.open({str(src)!r}).catalog
        _report(torch_loaded=sys.modules.get("torch") is not None)
        """
    )
    return {
        CP: cp,
        CAT: lambda: run(["sh", "-c", 'cat "$@" > /dev/null', "cat", *data_files(src)]),
        BASELINE: lambda: run(baseline),
        STATS: lambda: run(stats_argv(src, "ckptkit.stats(ckpt)")),
        STATS_ONLY: lambda: run(stats_argv(src, "ckptkit.stats(ckpt, fingerprints=False)")),
        FINGERPRINT: lambda: run(stats_argv(src, "ckptkit.fingerprint(ckpt)")),
        STATS_NO_CRC: lambda: run(stats_argv(src, "ckptkit.stats(ckpt)", verify_crc=False)),
        STATS_ONLY_NO_CRC: lambda: run(
            stats_argv(src, "ckptkit.stats(ckpt, fingerprints=False)", verify_crc=False)
        ),
    }


def check_against_torch(src: Path, n: int) -> dict[str, Any]:
    """The statistics of two tensors vs torch on the fully loaded tensors (float64)."""
    keys = [f"model.{bench_unshard.key_name(i)}" for i in CHECKED if i < n]
    code = f"""
        import math, torch, ckptkit
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
        frame = ckptkit.stats({str(src)!r}, keys={keys!r}).set_index("key")
        loaded = _load_state_dict_from_keys(set({keys!r}), checkpoint_id={str(src)!r})
        bad = []
        for key in {keys!r}:
            t = loaded["model"][key.removeprefix("model.")].double()
            row = frame.loc[key]
            want = {{"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(),
                     "std": t.std().item(), "l2": t.norm().item()}}
            for column, value in want.items():
                if not math.isclose(row[column], value, rel_tol=1e-9, abs_tol=1e-300):
                    bad.append((key, column, row[column], value))
        _report(checked=len({keys!r}), bad=bad)
        """
    return run(python_argv(code)).report


# -- report ----------------------------------------------------------------------------------


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Medians per job: the timed call (python children) or the whole process (cp, cat)."""
    out = {}
    for name, results in runs.items():
        timed = bool(results[0].report.get("op_s"))
        out[name] = {
            "op_s": median([r.report["op_s"] if timed else r.wall_s for r in results]),
            "op_cpu_s": median([r.report["op_cpu_s"] if timed else r.cpu_s for r in results]),
            "process_wall_s": median([r.wall_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
            "torch_loaded": any(r.report.get("torch_loaded") for r in results),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--small", action="store_true", help="a small input, to test the script")
    args = parser.parse_args()

    env_before = environment()
    start = time.perf_counter()
    src, n, shape = ensure_source(args.small)
    tensor_mib = shape[0] * shape[1] * 4 / 2**20
    goal_rss = tensor_mib + RSS_SLACK_MIB
    size_mib = sum(os.path.getsize(f) for f in data_files(src)) / 2**20
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    try:
        progress(f"warm-up: cp -r {src.name} ({size_mib:.0f} MiB)")
        subprocess.run(["cp", "-r", str(src), str(WORK / "warmup")], check=True)
        shutil.rmtree(WORK / "warmup")
        runs = repeat_interleaved(jobs(src), args.repeat)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    check = check_against_torch(src, n)
    if check["bad"]:
        raise SystemExit(f"statistics differ from torch's: {check['bad']}")

    stats = summarize(runs)
    cp, base = stats[CP], stats[BASELINE]
    headers = ["measurement", "wall s", "process wall s", "CPU s", "peak RSS MiB",
               "RSS over baseline MiB", "wall / cp", "GB/s"]  # fmt: skip
    rows = []
    for name in JOBS:
        s = stats[name]
        python_job = name not in (CP, CAT)
        s["rss_over_baseline_mib"] = (
            s["peak_rss_mib"] - base["peak_rss_mib"] if python_job else None
        )
        rows.append(
            [
                name,
                "—" if name == BASELINE else f"{s['op_s']:.2f}",
                f"{s['process_wall_s']:.2f}",
                f"{s['op_cpu_s']:.2f}",
                f"{s['peak_rss_mib']:.0f}",
                f"{s['rss_over_baseline_mib']:.0f}" if python_job and name != BASELINE else "—",
                "—" if name == BASELINE else ratio(s["op_s"], cp["op_s"]),
                "—" if name == BASELINE else f"{size_mib * 2**20 / s['op_s'] / 1e9:.2f}",
            ]
        )
    vs_cp = stats[STATS]["op_s"] / cp["op_s"]
    over = stats[STATS]["rss_over_baseline_mib"]
    goals = {
        "vs_cp": {"value": vs_cp, "goal": GOAL_VS_CP, "met": vs_cp <= GOAL_VS_CP},
        "rss_over_baseline_mib": {"value": over, "goal": goal_rss, "met": over <= goal_rss},
    }
    verdict = {True: "MET", False: "MISSED"}
    print(
        f"## bench_stats: {n} x fp32 {list(shape)} = {n * tensor_mib:.0f} MiB, DCP from "
        f"{bench_unshard.WORLD_SIZE} ranks (row shards, {size_mib:.0f} MiB on disk)\n"
    )
    print(
        f"Medians of {args.repeat} fresh processes each, round-robin, after one warm-up `cp -r`\n"
        "(the source sits in the page cache). `wall s` / `CPU s` time the call alone inside the\n"
        "child (after imports and `open`); `cp` and `cat`: the whole process. RSS over baseline\n"
        "subtracts the `import ckptkit, pandas + open` child's peak RSS.\n"
    )
    print(markdown_table(headers, rows))
    print(
        f"\n- stats (+ fingerprints) wall / cp: {vs_cp:.2f} (goal <= {GOAL_VS_CP}: "
        f"{verdict[goals['vs_cp']['met']]}); RSS over baseline {over:.0f} MiB (goal <= largest "
        f"tensor {tensor_mib:.0f} + {RSS_SLACK_MIB} = {goal_rss:.0f} MiB: "
        f"{verdict[goals['rss_over_baseline_mib']['met']]})"
    )
    cores = os.cpu_count() or 1
    full, only = stats[STATS], stats[STATS_ONLY]
    print(
        f"- CPU-bound: stats (+ fingerprints) used {full['op_cpu_s']:.2f} CPU s, so on {cores} "
        f"cores its wall is at least {full['op_cpu_s'] / cores:.2f} s = "
        f"{full['op_cpu_s'] / cores / cp['op_s']:.2f} x cp; stats(fingerprints=False) wall / cp "
        f"{only['op_s'] / cp['op_s']:.2f} (CPU {only['op_cpu_s']:.2f} s)"
    )
    print(
        f"- not checking CRC-32 (verify_crc=False, not the default): stats (+ fingerprints) "
        f"{stats[STATS_NO_CRC]['op_s']:.2f} s ({stats[STATS_NO_CRC]['op_s'] / cp['op_s']:.2f} x "
        f"cp), stats(fingerprints=False) {stats[STATS_ONLY_NO_CRC]['op_s']:.2f} s "
        f"({stats[STATS_ONLY_NO_CRC]['op_s'] / cp['op_s']:.2f} x cp)"
    )
    print(
        f"- checked: the statistics of {check['checked']} tensors equal torch's on the loaded "
        f"tensors (rel 1e-9); torch imported by stats: {stats[STATS]['torch_loaded']}"
    )
    print(load_line(env_before))
    progress(f"total {time.perf_counter() - start:.0f} s")
    name = "bench_stats_small.json" if args.small else "bench_stats.json"
    write_json(
        OUT_DIR / name,
        {
            "benchmark": "bench_stats",
            "params": {"tensors": n, "shape": list(shape), "source": str(src), "mib": size_mib},
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "medians": stats,
            "goals": goals,
            "check": check,
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / name}")


if __name__ == "__main__":
    main()
