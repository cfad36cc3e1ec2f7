"""What checking CRC-32 on read costs: reading every tensor with and without ``verify_crc``.

Writes (once, cached in ``benchmarks/out/crc_ckpt``) a DCP checkpoint of eight 32 MB float32
tensors with torch's own ``dcp.save``, then times fresh processes: ``zlib.crc32`` over the same
number of bytes in memory (the raw cost), ckptkit reading every tensor with ``verify_crc=True``
(the default) and with ``verify_crc=False``, and torch's ``dcp.load`` of the same state
(anchor). Throughputs are GB/s of tensor bytes (10^9). Usage:
``python benchmarks/bench_crc.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    Run,
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

CKPT = OUT_DIR / "crc_ckpt"
N_TENSORS, ROWS, COLS = 8, 2048, 4096  # 8 × 32 MiB
NBYTES = N_TENSORS * ROWS * COLS * 4


def ensure_checkpoint() -> Path:
    if (CKPT / ".metadata").exists():
        return CKPT
    tmp = CKPT.with_name(CKPT.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"writing {NBYTES / 1e9:.2f} GB checkpoint to {CKPT}")
    run(
        python_argv(
            f"""
            import torch, torch.distributed.checkpoint as dcp
            gen = torch.Generator().manual_seed(0)
            state = {{"model": {{f"w{{i}}": torch.randn({ROWS}, {COLS}, generator=gen)
                                for i in range({N_TENSORS})}}}}
            dcp.save(state, checkpoint_id={str(tmp)!r})
            """
        )
    )
    tmp.rename(CKPT)
    return CKPT


def jobs(path: Path) -> dict[str, Any]:
    read = """
        import time, ckptkit
        ckpt = ckptkit.open({path!r}, verify_crc={verify})
        keys = [e.key for e in ckpt.catalog.tensors()]
        for key in keys[:1]:
            ckpt.read_numpy(key)  # warm the page cache and imports
        start = time.perf_counter()
        n = sum(ckpt.read_numpy(key).nbytes for key in keys)
        _report(seconds=time.perf_counter() - start, nbytes=n)
        """
    codes = {
        "zlib.crc32 in memory": f"""
            import time, zlib, os
            data = os.urandom({NBYTES})
            start = time.perf_counter()
            zlib.crc32(data)
            _report(seconds=time.perf_counter() - start, nbytes=len(data))
            """,
        "ckptkit read, verify_crc=True": read.format(path=str(path), verify=True),
        "ckptkit read, verify_crc=False": read.format(path=str(path), verify=False),
        "anchor: torch dcp.load": f"""
            import time, torch, torch.distributed.checkpoint as dcp
            state = {{"model": {{f"w{{i}}": torch.empty({ROWS}, {COLS}) for i in range({N_TENSORS})}}}}
            dcp.load(state, checkpoint_id={str(path)!r})  # warm
            start = time.perf_counter()
            dcp.load(state, checkpoint_id={str(path)!r})
            _report(seconds=time.perf_counter() - start, nbytes={NBYTES})
            """,
    }
    return {name: (lambda code=code: run(python_argv(code))) for name, code in codes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    before = environment()
    path = ensure_checkpoint()
    runs: dict[str, list[Run]] = repeat_interleaved(jobs(path), args.repeat)
    stats = {
        name: {
            "seconds": median([r.report["seconds"] for r in results]),
            "gb_per_s": median([r.report["nbytes"] / r.report["seconds"] / 1e9 for r in results]),
        }
        for name, results in runs.items()
    }
    on, off = stats["ckptkit read, verify_crc=True"], stats["ckptkit read, verify_crc=False"]
    rows = [[name, f"{s['seconds']:.3f}", f"{s['gb_per_s']:.2f}"] for name, s in stats.items()]
    print(f"Reading {NBYTES / 1e9:.2f} GB of float32 tensors (median of {args.repeat}):\n")
    print(markdown_table(["measurement", "seconds", "GB/s"], rows))
    print(
        f"\nCRC checking costs {on['seconds'] - off['seconds']:+.3f} s "
        f"({on['seconds'] / off['seconds']:.2f}x the unchecked read); "
        f"ckptkit with CRC reads at {on['gb_per_s'] / stats['anchor: torch dcp.load']['gb_per_s']:.2f}x "
        "torch dcp.load's throughput."
    )
    print(load_line(before))
    write_json(
        OUT_DIR / "bench_crc.json",
        {
            "benchmark": "bench_crc",
            "nbytes": NBYTES,
            "repeat": args.repeat,
            "environment": {"before": before, "after_loadavg": environment()["loadavg"]},
            "medians": stats,
            "runs": runs_json(runs),
        },
    )


if __name__ == "__main__":
    main()
