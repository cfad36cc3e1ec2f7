"""Unsharding into S3: ckptkit's upload parts sent while the file is written, against staging
the whole file on local disk first.

The source is bench_remote's cached checkpoint (192 MiB fp32 DCP written by torch's ``dcp.save``
from 2 gloo ranks), on local disk. The test-suite's loopback S3 server (moto, in a process of
its own) receives, in fresh processes, medians of interleaved rounds:

- ``ckptkit.unshard(source, "s3://…", to="safetensors")`` with ``workers=1`` and ``2``: every
  16 MiB part goes up as soon as its bytes are written, nothing is staged on local disk;
- the torch way: ``dcp_to_torch_save`` into a local ``model.pt``, then s3fs ``put_file``;
- the floor: s3fs ``put_file`` of the unsharded ``model.safetensors`` already on local disk.

Printed: the time inside the child (imports excluded), its ratio to the torch way and to the
floor, peak RSS, and the bytes the child wrote to local disk (``/proc/self/io``
``write_bytes``). Usage: ``python benchmarks/bench_upload.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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
from bench_remote import S3_ENV, ensure_source, s3_server  # noqa: E402

WORK = OUT_DIR / "upload_work"
BUCKET = "bench-upload"
TORCH = "torch: dcp_to_torch_save, then put_file"
FLOOR = "floor: put_file of the finished file"

_TIMED = """
t0 = time.perf_counter()
{body}
op_s = time.perf_counter() - t0
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
_report(op_s=op_s, disk_write_bytes=int(io["write_bytes"]))
"""


def child_argv(tool: str, source: Path, url: str, scratch: Path, floor_file: Path) -> list[str]:
    """The child running ``tool``: imports first, then the timed body alone."""
    if tool == TORCH:
        imports = "import fsspec, torch\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save"
        body = (
            f"dcp_to_torch_save({str(source)!r}, {str(scratch / 'model.pt')!r})\n"
            f"fsspec.filesystem('s3').put_file({str(scratch / 'model.pt')!r}, {url + '/model.pt'!r})"
        )
    elif tool == FLOOR:
        imports = "import fsspec"
        body = (
            f"fsspec.filesystem('s3').put_file({str(floor_file)!r}, {url + '/model.safetensors'!r})"
        )
    else:
        workers = int(tool.rsplit("=", 1)[1])
        imports = "import ckptkit, torch"
        body = (
            f"ckptkit.unshard({str(source)!r}, {url!r}, to='safetensors', workers={workers}, "
            "progress=False)"
        )
    code = "import warnings\nwarnings.simplefilter('ignore')\n" + imports + _TIMED.format(body=body)
    return python_argv(code)


def jobs(source: Path, floor_file: Path, env: dict[str, str]) -> dict[str, Callable[[], Run]]:
    """Each run writes to a fresh prefix and starts from an empty scratch folder."""
    out: dict[str, Callable[[], Run]] = {}
    for tool in ("ckptkit workers=1", "ckptkit workers=2", TORCH, FLOOR):

        def measure(tool=tool) -> Run:
            scratch = WORK / "scratch"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
            result = run(child_argv(tool, source, url, scratch, floor_file), env=env)
            shutil.rmtree(scratch, ignore_errors=True)
            return result

        out[tool] = measure
    return out


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "op_s": median([r.report["op_s"] for r in results]),
            "op_s_runs": [r.report["op_s"] for r in results],
            "process_wall_s": median([r.wall_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
            "disk_write_mib": median([r.report["disk_write_bytes"] for r in results]) / 2**20,
        }
        for name, results in runs.items()
    }


def report(stats: dict[str, dict[str, Any]], repeat: int, total_mib: float) -> str:
    headers = ["measurement", "op s", "/ torch way", "/ floor", "peak RSS MiB", "local disk MiB"]
    rows = [
        [
            name,
            f"{s['op_s']:.2f}",
            ratio(s["op_s"], stats[TORCH]["op_s"]),
            ratio(s["op_s"], stats[FLOOR]["op_s"]),
            f"{s['peak_rss_mib']:.0f}",
            f"{s['disk_write_mib']:.0f}",
        ]
        for name, s in stats.items()
    ]
    return "\n".join(
        [
            f"Source: {total_mib:.0f} MiB fp32 DCP (2 ranks) on local disk; destination: moto's S3 "
            "server on 127.0.0.1.",
            f"Medians of {repeat} fresh processes each, round-robin. `op s` times the job inside "
            "the child (imports excluded).",
            "`local disk MiB`: bytes the child wrote to local storage (/proc/self/io write_bytes).",
            "",
            markdown_table(headers, rows),
            "",
            "- The server is a Python process on the same 2 cores: it bounds every row, the floor",
            "  included, so the ratios say more than the seconds.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args()
    before = environment()
    source = ensure_source()
    total_mib = sum(p.stat().st_size for p in source.iterdir() if p.name != "params.json") / 2**20
    floor_dir = WORK / "floor"
    shutil.rmtree(floor_dir, ignore_errors=True)
    run(
        python_argv(
            f"import ckptkit\nckptkit.unshard({str(source)!r}, {str(floor_dir)!r}, "
            "to='safetensors', progress=False)"
        )
    )
    with s3_server() as endpoint:
        env = child_env(**S3_ENV, AWS_ENDPOINT_URL=endpoint)
        run(python_argv(f"import fsspec\nfsspec.filesystem('s3').mkdir({BUCKET!r})"), env=env)
        progress(f"S3 server at {endpoint}")
        try:
            runs = repeat_interleaved(
                jobs(source, floor_dir / "model.safetensors", env), args.repeat
            )
        finally:
            shutil.rmtree(WORK, ignore_errors=True)
    stats = summarize(runs)
    print(report(stats, args.repeat, total_mib))
    print()
    print(load_line(before))
    write_json(
        OUT_DIR / "bench_upload.json",
        {"environment": before, "stats": stats, "runs": runs_json(runs)},
    )


if __name__ == "__main__":
    main()
