"""Streaming diff of two ~1 GB checkpoints (DCP vs safetensors): peak RSS and time vs torch.

Generates (once, cached in ``benchmarks/out/``) a DCP checkpoint written by torch's ``dcp.save``
from 2 spawned gloo ranks (row-sharded DTensors: 7 float32 [8192, 4096] tensors of 128 MiB and
one bfloat16 of 64 MiB, 960 MiB) and a safetensors file of the same tensors, half of them
bit-identical, a quarter scaled by 1 + 1e-6 (``close``) and a quarter with noise added
(``different``), see ``CHANGES``. Then measures in fresh processes: a baseline
(import ckptkit + pandas, open both), ``ckptkit.diff(dcp, safetensors)``, ``ckptkit.diff(dcp,
dcp)`` (every tensor bit-identical), and the anchor: torch loading both completely
(``_load_state_dict_from_keys`` + ``safetensors.torch.load_file``) and comparing in float64.
Goal: peak RSS of the diff, above the baseline, <= 2 x largest tensor + 64 MiB.
Usage: ``python benchmarks/bench_diff.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

SHAPE = (8192, 4096)
N_TENSORS = 8
BF16 = {7}  # tensor indices stored as bfloat16
#: index % 4 → how the safetensors copy differs: 0, 2 bit-identical; 1 × (1 + 1e-6) (close);
#: 3 + 1e-3·noise (different)
CHANGES = {0: "equal", 1: "close", 2: "equal", 3: "different"}
WORLD_SIZE = 2
GENERATOR_VERSION = 1
MIB = 2**20
LARGEST_MIB = SHAPE[0] * SHAPE[1] * 4 / MIB
TOTAL_MIB = sum(SHAPE[0] * SHAPE[1] * (2 if i in BF16 else 4) for i in range(N_TENSORS)) / MIB
GOAL_RSS_MIB = 2 * LARGEST_MIB + 64

BASELINE = "baseline: import ckptkit, pandas + open both"
DIFF = "ckptkit.diff(dcp, safetensors)"
SELF = "ckptkit.diff(dcp, dcp) (all bit-identical)"
ANCHOR = "anchor: torch loads both fully + compares"
JOBS = [BASELINE, DIFF, SELF, ANCHOR]


# -- input -----------------------------------------------------------------------------------


def key_name(i: int) -> str:
    return f"layers.{i}.weight"


def row_block(i: int, rank: int):
    """Rows ``rank`` of ``WORLD_SIZE`` of tensor ``i``: seeded normal values."""
    import torch

    rows = SHAPE[0] // WORLD_SIZE
    block = torch.randn(rows, SHAPE[1], generator=torch.Generator().manual_seed(1000 * i + rank))
    return block.to(torch.bfloat16) if i in BF16 else block


def _save_rank(rank: int, world_size: int, path: str) -> None:
    """Rank body of the DCP writer: each rank builds its own row shard, ``dcp.save`` writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = {
        key_name(i): DTensor.from_local(row_block(i, rank), mesh, [Shard(0)], run_check=False)
        for i in range(N_TENSORS)
    }
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_changed_copy(path: Path) -> None:
    """The same tensors as one safetensors file ``model.safetensors``, changed per ``CHANGES``."""
    import safetensors.torch
    import torch

    tensors = {}
    for i in range(N_TENSORS):
        full = torch.cat([row_block(i, r) for r in range(WORLD_SIZE)])
        change = CHANGES[i % 4]
        if change == "close":
            full = (full.double() * (1 + 1e-6)).to(full.dtype)
        elif change == "different":
            noise = torch.randn(full.shape, generator=torch.Generator().manual_seed(i))
            full = (full.float() + 1e-3 * noise).to(full.dtype)
        tensors[key_name(i)] = full
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))


def ensure_inputs() -> tuple[Path, Path]:
    """The cached DCP directory and safetensors directory, generated in a child process."""
    params = {
        "tensors": N_TENSORS,
        "shape": list(SHAPE),
        "bf16": sorted(BF16),
        "changes": {str(k): v for k, v in CHANGES.items()},
        "world_size": WORLD_SIZE,
        "generator": GENERATOR_VERSION,
    }
    generate = f"""
        from ckptkit.examples import _spawn
        from bench_diff import _save_rank, write_changed_copy
        _spawn(_save_rank, {WORLD_SIZE}, str(out / "dcp"))
        (out / "safetensors").mkdir()
        write_changed_copy(out / "safetensors")
        """
    root = cached_input(
        OUT_DIR / f"diff_{N_TENSORS}x{SHAPE[0]}x{SHAPE[1]}",
        params,
        generate,
        f"{TOTAL_MIB:.0f} MiB DCP + a changed safetensors copy",
    )
    return root / "dcp", root / "safetensors"


def jobs(dcp_dir: Path, st_dir: Path) -> dict[str, Any]:
    a, b = str(dcp_dir), str(st_dir)
    baseline = python_argv(
        f"""
        import ckptkit, pandas
        ckptkit.open({a!r}).tensors, ckptkit.open({b!r}).tensors
        _report(torch_imported="torch" in sys.modules)
        """
    )

    def diff_code(other: str) -> list[str]:
        return python_argv(
            f"""
            import ckptkit, pandas
            a, b = ckptkit.open({a!r}), ckptkit.open({other!r})
            a.tensors, b.tensors
            start = time.perf_counter()
            frame = ckptkit.diff(a, b)
            seconds = time.perf_counter() - start
            _report(
                seconds=seconds,
                statuses=dict(zip(frame["key"], frame["status"])),
                max_abs=dict(zip(frame["key"], frame["max_abs"].astype(float))),
                torch_imported="torch" in sys.modules,
            )
            """
        )

    anchor = python_argv(
        f"""
        import torch, safetensors.torch
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
        start = time.perf_counter()
        a = _load_state_dict_from_keys(checkpoint_id={a!r})["model"]
        b = safetensors.torch.load_file({b!r} + "/model.safetensors")
        max_abs = {{}}
        for key, x in a.items():
            y = b[key]
            max_abs["model." + key] = (x.double() - y.double()).abs().max().item()
        _report(seconds=time.perf_counter() - start, max_abs=max_abs)
        """
    )
    return {
        BASELINE: lambda: run(baseline),
        DIFF: lambda: run(diff_code(b)),
        SELF: lambda: run(diff_code(a)),
        ANCHOR: lambda: run(anchor),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per job (median)")
    args = parser.parse_args()

    env_before = environment()
    dcp_dir, st_dir = ensure_inputs()
    runs: dict[str, list[Run]] = repeat_interleaved(jobs(dcp_dir, st_dir), args.repeat)

    diff_report = runs[DIFF][0].report
    expected = {f"model.{key_name(i)}": CHANGES[i % 4] for i in range(N_TENSORS)}
    statuses_ok = diff_report["statuses"] == expected
    self_ok = set(runs[SELF][0].report["statuses"].values()) == {"equal"}
    anchor_max = runs[ANCHOR][0].report["max_abs"]
    max_abs_ok = all(
        abs(diff_report["max_abs"][k] - v) <= 1e-12 * max(1.0, v) for k, v in anchor_max.items()
    )
    progress(
        f"statuses as planted: {statuses_ok}; self all equal: {self_ok}; max_abs = torch's: {max_abs_ok}"
    )

    wall = {k: median([r.wall_s for r in v]) for k, v in runs.items()}
    inner = {k: median([r.report.get("seconds", float("nan")) for r in v]) for k, v in runs.items()}
    cpu = {k: median([r.cpu_s for r in v]) for k, v in runs.items()}
    rss = {k: median([r.peak_rss_mib for r in v]) for k, v in runs.items()}
    above = {k: rss[k] - rss[BASELINE] for k in runs}
    rows = [
        [
            k,
            f"{wall[k]:.2f}",
            "" if k == BASELINE else f"{inner[k]:.2f}",
            f"{cpu[k]:.2f}",
            f"{rss[k]:.0f}",
            "" if k == BASELINE else f"{above[k]:.0f}",
            ratio(inner[k], inner[ANCHOR]) if k != BASELINE else "",
            ratio(rss[k], rss[ANCHOR]),
        ]
        for k in JOBS
    ]
    headers = ["job", "wall s", "compare s", "CPU s", "peak RSS MiB", "RSS above baseline MiB",
               "compare s / anchor", "RSS / anchor"]  # fmt: skip
    worst = max(above[DIFF], above[SELF])
    met = worst <= GOAL_RSS_MIB and statuses_ok and self_ok and max_abs_ok
    print(
        f"## bench_diff: {N_TENSORS} tensors, {TOTAL_MIB:.0f} MiB per checkpoint "
        f"(largest {LARGEST_MIB:.0f} MiB), DCP ws={WORLD_SIZE} rows vs safetensors\n"
    )
    print(
        f"Median of {args.repeat} fresh processes per job, round-robin on a shared machine.\n"
        "compare s is timed inside the child (after imports and opening); peak RSS from the\n"
        "child's own ru_maxrss (MiB = 2^20 B); the baseline imports ckptkit + pandas and opens\n"
        "both checkpoints.\n"
    )
    print(markdown_table(headers, rows))
    print()
    print(
        f"Statuses as planted ({', '.join(sorted(set(CHANGES.values())))}): {statuses_ok}; "
        f"dcp vs itself all equal: {self_ok}; max |a-b| equals torch's: {max_abs_ok}; "
        f"torch imported by the diff: {diff_report['torch_imported']}"
    )
    print(
        f"Goal: peak RSS above baseline <= 2 x {LARGEST_MIB:.0f} + 64 = {GOAL_RSS_MIB:.0f} MiB: "
        f"{'MET' if met else 'MISSED'} (worst {worst:.0f} MiB; absolute {max(rss[DIFF], rss[SELF]):.0f} MiB)"
    )
    print(load_line(env_before))
    write_json(
        OUT_DIR / "bench_diff.json",
        {
            "benchmark": "bench_diff",
            "inputs": {"dcp": str(dcp_dir), "safetensors": str(st_dir)},
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "median_wall_s": wall,
            "median_compare_s": inner,
            "median_cpu_s": cpu,
            "median_peak_rss_mib": rss,
            "rss_above_baseline_mib": above,
            "checks": {"statuses": statuses_ok, "self_equal": self_ok, "max_abs": max_abs_ok},
            "goal": {"rss_above_baseline_mib": GOAL_RSS_MIB, "value": worst, "met": met},
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_diff.json'}")


if __name__ == "__main__":
    main()
