"""Cold start: ``ckptkit inspect PATH --json`` on a small FSDP2 checkpoint vs torch's reader.

Writes the sample checkpoint (world size 2) to ``benchmarks/out/sample_ckpt`` if absent, then
times fresh processes: the CLI, torch's ``FileSystemReader.read_metadata()`` (anchor) and
``python -c pass`` (interpreter floor); one more run checks that the CLI never imports torch.
Usage: ``python benchmarks/bench_inspect.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
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
    ratio,
    repeat_interleaved,
    run,
    runs_json,
    write_json,
)

SAMPLE = OUT_DIR / "sample_ckpt"
PYCACHE = OUT_DIR / "pycache"
GOAL_S = 1.0
CLI = "cli"
CLI_CACHED = "cli_cached"
ANCHOR = "anchor"
FLOOR = "floor"


def ensure_sample() -> Path:
    """The sample checkpoint, written by ``ckptkit.examples.write_sample`` if absent."""
    if (SAMPLE / ".metadata").exists():
        return SAMPLE
    tmp = SAMPLE.with_name(SAMPLE.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"writing sample checkpoint to {SAMPLE} (world size 2)")
    start = time.perf_counter()
    run(
        python_argv(
            f"""
            from ckptkit.examples import write_sample
            write_sample({str(tmp)!r}, world_size=2)
            """
        )
    )
    os.replace(tmp, SAMPLE)
    progress(f"written in {time.perf_counter() - start:.1f} s")
    return SAMPLE


def cli_command() -> tuple[list[str], str]:
    """argv prefix for the CLI: the venv's console script if installed, else ``-m``."""
    script = Path(sys.executable).with_name("ckptkit")
    if script.exists():
        return [str(script)], f"console script {script}"
    return [
        sys.executable,
        "-m",
        "ckptkit.cli",
    ], "python -m ckptkit.cli; no console script installed"


def check_torch_free(path: Path) -> dict[str, Any]:
    """Run the CLI's ``__main__`` in one process and report which heavy modules it loaded."""
    result = run(
        python_argv(
            f"""
            import contextlib, io, runpy
            sys.argv = ["ckptkit", "inspect", {str(path)!r}, "--json"]
            buffer = io.StringIO()
            code = 0
            with contextlib.redirect_stdout(buffer):
                try:
                    runpy.run_module("ckptkit.cli", run_name="__main__", alter_sys=True)
                except SystemExit as stop:
                    code = stop.code
            document = _json.loads(buffer.getvalue())
            _report(
                exit_code=code,
                torch_imported="torch" in sys.modules,
                pandas_imported="pandas" in sys.modules,
                numpy_imported="numpy" in sys.modules,
                fsspec_imported="fsspec" in sys.modules,
                modules_loaded=len(sys.modules),
                tensors=len(document["tensors"]),
                objects=len(document["objects"]),
                files=len(document["files"]),
            )
            """
        )
    )
    return result.report


def jobs(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The commands to time, by key, and a label for each."""
    cli, how = cli_command()
    inspect = [*cli, "inspect", str(path), "--json"]
    anchor_code = (
        "from torch.distributed.checkpoint import FileSystemReader; "
        f"FileSystemReader({str(path)!r}).read_metadata()"
    )
    # PYTHONDONTWRITEBYTECODE is set in this environment, so ckptkit's own modules (not
    # installed, no __pycache__) are compiled on every start; a pycache prefix under out/
    # shows the start-up an installed copy (with .pyc files) would have.
    cached_env = child_env(PYTHONDONTWRITEBYTECODE=None, PYTHONPYCACHEPREFIX=str(PYCACHE))
    labels = {
        CLI: f"ckptkit inspect --json ({how})",
        CLI_CACHED: "ckptkit inspect --json, bytecode cached (PYTHONPYCACHEPREFIX)",
        ANCHOR: "anchor: FileSystemReader(p).read_metadata()",
        FLOOR: "floor: python -c pass",
    }
    commands = {
        CLI: lambda: run(inspect),
        CLI_CACHED: lambda: run(inspect, env=cached_env),
        ANCHOR: lambda: run([sys.executable, "-c", anchor_code]),
        FLOOR: lambda: run([sys.executable, "-c", "pass"]),
    }
    if "PYTHONDONTWRITEBYTECODE" not in os.environ:  # the two CLI rows would be the same
        del commands[CLI_CACHED], labels[CLI_CACHED]
    return commands, labels


def main() -> None:
    """Write the sample if needed, measure, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (median)")
    args = parser.parse_args()

    env_before = environment()
    path = ensure_sample()
    commands, labels = jobs(path)
    runs: dict[str, list[Run]] = repeat_interleaved(commands, args.repeat, warmup=True)
    output = json.loads(runs[CLI][0].stdout)
    check = check_torch_free(path)
    progress(f"torch-free check: {check}")

    wall = {k: median([r.wall_s for r in v]) for k, v in runs.items()}
    cpu = {k: median([r.cpu_s for r in v]) for k, v in runs.items()}
    rss = {k: median([r.peak_rss_mib for r in v]) for k, v in runs.items()}
    rows = [
        [
            labels[k],
            f"{wall[k]:.3f}",
            f"{wall[k] - wall[FLOOR]:.3f}",
            f"{cpu[k]:.3f}",
            f"{rss[k]:.0f}",
            ratio(wall[k], wall[ANCHOR]),
            ratio(cpu[k], cpu[ANCHOR]),
            ratio(rss[k], rss[ANCHOR]),
        ]
        for k in commands
    ]
    headers = ["command", "wall s", "wall over floor s", "CPU s", "peak RSS MiB",
               "wall / anchor", "CPU / anchor", "RSS / anchor"]  # fmt: skip
    met = wall[CLI] <= GOAL_S and not check["torch_imported"]
    print(
        f"## bench_inspect: cold start on {path} ({len(output['tensors'])} tensors, "
        f"{len(output['objects'])} objects, {len(output['files'])} files)\n"
    )
    print(
        f"Median of {args.repeat} fresh processes per command after one warm-up each, run\n"
        "round-robin on a shared machine; wall s is the whole process as seen by the parent;\n"
        "CPU s (user + system) and peak RSS come from wait4 (MiB = 2^20 B).\n"
    )
    print(markdown_table(headers, rows))
    print()
    print(
        f"torch imported by `ckptkit inspect --json`: {check['torch_imported']} "
        f"(pandas: {check['pandas_imported']}, numpy: {check['numpy_imported']}, "
        f"fsspec: {check['fsspec_imported']}; {check['modules_loaded']} modules)"
    )
    print(
        f"Goal: inspect <= {GOAL_S:g} s and torch never imported: "
        f"{'MET' if met else 'MISSED'} ({wall[CLI]:.3f} s)"
    )
    print(load_line(env_before))
    write_json(
        OUT_DIR / "bench_inspect.json",
        {
            "benchmark": "bench_inspect",
            "path": str(path),
            "cli": cli_command()[1],
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "labels": labels,
            "median_wall_s": wall,
            "median_cpu_s": cpu,
            "median_peak_rss_mib": rss,
            "torch_free_check": check,
            "goal": {"wall_s": GOAL_S, "value": wall[CLI], "met": met},
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_inspect.json'}")


if __name__ == "__main__":
    main()
