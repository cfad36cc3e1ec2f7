"""Metadata at scale: read a 2,000-key x 256-rank DCP ``.metadata`` (512k chunks) vs torch.

Generates (once, cached in ``benchmarks/out/``) a ``.metadata`` pickled from torch's own DCP
classes, then measures in fresh processes: torch's ``pickle.load`` and
``FileSystemReader.read_metadata`` (anchors) and ``ckptkit.open(dir).tensors`` / ``.chunks``
with torch made unimportable. Usage: ``python benchmarks/bench_metadata.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
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

N_KEYS = 2000
N_RANKS = 256
SHAPE = (4096, 1024)  # float32, sharded along dim 0 into N_RANKS chunks
GENERATOR_VERSION = 1
GOAL_TOTAL_S = 4.0
GOAL_PEAK_MIB = 600.0
ELSEWHERE = "pickle.load with torch's classes: 17 s / 1.3 GB (measured elsewhere)"


def key_name(k: int) -> str:
    """The fully qualified name of synthetic tensor ``k``."""
    return f"model.layers.{k // 10}.block.weight_{k % 10}"


def write_synthetic_metadata(directory: Path, n_keys: int, n_ranks: int) -> None:
    """Pickle a DCP ``Metadata`` built from torch's own classes into ``directory/.metadata``.

    Mirrors ``FileSystemWriter.finish``: ``storage_data`` is filled rank by rank and the file
    is written with ``pickle.dump`` (protocol 4, the default on Python 3.11). No .distcp files.
    """
    import uuid

    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows, cols = SHAPE
    if rows % n_ranks:
        raise ValueError(f"{rows} rows do not split evenly over {n_ranks} ranks")
    per_rank = rows // n_ranks
    # a torch.save zip record of one [per_rank, cols] float32 chunk: data plus framing
    record_length = per_rank * cols * 4 + 1_227

    state_dict_metadata: dict[str, TensorStorageMetadata] = {}
    planner_data: dict[str, tuple[str, ...]] = {}
    for k in range(n_keys):
        fqn = key_name(k)
        chunks = [
            ChunkStorageMetadata(
                offsets=torch.Size([r * per_rank, 0]), sizes=torch.Size([per_rank, cols])
            )
            for r in range(n_ranks)
        ]
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([rows, cols]),
            chunks=chunks,
        )
        planner_data[fqn] = tuple(fqn.split("."))

    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for r in range(n_ranks):  # torch merges the ranks' write results one rank after another
        # torch's writer hands every item of a file the same storage-key string, which the
        # pickle then stores once: build one per file here too
        file_name = f"__{r}_0.distcp"
        for k, (fqn, item) in enumerate(state_dict_metadata.items()):
            index = MetadataIndex(fqn, item.chunks[r].offsets, index=r)
            storage_data[index] = _StorageInfo(file_name, k * record_length, record_length)

    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=directory, save_id=str(uuid.uuid4())),
        version=CURRENT_DCP_VERSION,
    )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f, protocol=4)
    os.replace(tmp, directory / ".metadata")


def ensure_metadata(n_keys: int, n_ranks: int) -> Path:
    """The cached synthetic checkpoint directory, generated in a child process if missing."""
    params = {"n_keys": n_keys, "n_ranks": n_ranks, "shape": list(SHAPE)}
    params["generator"] = GENERATOR_VERSION
    return cached_input(
        OUT_DIR / f"metadata_{n_keys}x{n_ranks}",
        params,
        f"from bench_metadata import write_synthetic_metadata\n"
        f"write_synthetic_metadata(out, {n_keys}, {n_ranks})",
        "a .metadata pickled with torch's own classes",
    )


def jobs(directory: Path) -> dict[str, Any]:
    """The child processes to measure, by name."""
    path = str(directory / ".metadata")
    codes = {
        "baseline: import torch.distributed.checkpoint": """
            t0, c0 = time.perf_counter(), time.process_time()
            import torch.distributed.checkpoint
            _report(import_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
            """,
        "baseline: import ckptkit, pandas (no torch)": """
            t0, c0 = time.perf_counter(), time.process_time()
            import ckptkit, pandas
            _report(import_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
            """,
        "anchor A: pickle.load (torch classes)": f"""
            t0 = time.perf_counter()
            import pickle
            import torch.distributed.checkpoint
            t1, c1 = time.perf_counter(), time.process_time()
            with open({path!r}, "rb") as f:
                md = pickle.load(f)
            t2, c2 = time.perf_counter(), time.process_time()
            n_chunks = sum(len(v.chunks) for v in md.state_dict_metadata.values())
            _report(import_s=t1 - t0, load_s=t2 - t1, cpu_s=c2 - c1,
                    keys=len(md.state_dict_metadata), chunks=n_chunks)
            """,
        "anchor B: FileSystemReader.read_metadata": f"""
            t0 = time.perf_counter()
            from torch.distributed.checkpoint import FileSystemReader
            t1, c1 = time.perf_counter(), time.process_time()
            md = FileSystemReader({str(directory)!r}).read_metadata()
            t2, c2 = time.perf_counter(), time.process_time()
            _report(import_s=t1 - t0, load_s=t2 - t1, cpu_s=c2 - c1,
                    keys=len(md.state_dict_metadata))
            """,
        "ckptkit: open + .tensors": f"""
            t0 = time.perf_counter()
            import ckptkit
            t1, c1 = time.perf_counter(), time.process_time()
            ckpt = ckptkit.open({str(directory)!r})
            t2 = time.perf_counter()
            frame = ckpt.tensors
            t3, c3 = time.perf_counter(), time.process_time()
            _report(import_s=t1 - t0, open_s=t2 - t1, tensors_s=t3 - t2, total_s=t3 - t1,
                    cpu_s=c3 - c1, rows=len(frame),
                    torch_loaded=sys.modules.get("torch") is not None)
            """,
        "ckptkit: open + .chunks": f"""
            import ckptkit
            t1, c1 = time.perf_counter(), time.process_time()
            ckpt = ckptkit.open({str(directory)!r})
            t2 = time.perf_counter()
            frame = ckpt.chunks
            t3, c3 = time.perf_counter(), time.process_time()
            _report(open_s=t2 - t1, chunks_s=t3 - t2, total_s=t3 - t1, cpu_s=c3 - c1,
                    rows=len(frame), torch_loaded=sys.modules.get("torch") is not None)
            """,
    }
    # ckptkit children run with torch blocked: proof that it is not needed
    return {
        name: (lambda code=code, block="ckptkit" in name: run(python_argv(code, block_torch=block)))
        for name, code in codes.items()
    }


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Median of every reported number (and of peak RSS in MiB) per measurement."""
    out: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        keys = [k for k, v in results[0].report.items() if isinstance(v, (int, float))]
        stats = {k: median([r.report[k] for r in results]) for k in keys if k != "maxrss_kib"}
        stats["peak_rss_mib"] = median([r.peak_rss_mib for r in results])
        stats["process_wall_s"] = median([r.wall_s for r in results])
        out[name] = stats
    return out


def report(stats: dict[str, dict[str, float]], repeat: int) -> tuple[str, dict[str, Any]]:
    """The markdown table and goal lines, plus the goal verdicts."""
    base_torch = stats["baseline: import torch.distributed.checkpoint"]
    base_ckpt = stats["baseline: import ckptkit, pandas (no torch)"]
    anchor = stats["anchor A: pickle.load (torch classes)"]
    a_s, a_rss = anchor["load_s"], anchor["peak_rss_mib"]
    tens = stats["ckptkit: open + .tensors"]
    chunks = stats["ckptkit: open + .chunks"]

    def row(label: str, wall: float, stat: dict[str, float] | None, base: float | None) -> list:
        """Table row; ``stat`` (the whole measurement) adds CPU, RSS and the RSS ratio."""
        compare = base is not None
        return [
            label,
            f"{wall:.2f}",
            "—" if stat is None else f"{stat['cpu_s']:.2f}",
            "—" if stat is None else f"{stat['peak_rss_mib']:.0f}",
            "—" if stat is None or base is None else f"{stat['peak_rss_mib'] - base:.0f}",
            ratio(wall, a_s) if compare or stat is None else "—",
            "—" if stat is None else ratio(stat["cpu_s"], anchor["cpu_s"]) if compare else "—",
            ratio(stat["peak_rss_mib"], a_rss) if compare and stat is not None else "—",
        ]

    b = stats["anchor B: FileSystemReader.read_metadata"]
    torch_rss, ckpt_rss = base_torch["peak_rss_mib"], base_ckpt["peak_rss_mib"]
    rows = [
        row("baseline: import torch.distributed.checkpoint", base_torch["import_s"], base_torch,
            None),
        row("baseline: import ckptkit + pandas (torch blocked)", base_ckpt["import_s"], base_ckpt,
            None),
        row("anchor A: pickle.load with torch classes", a_s, anchor, torch_rss),
        row("anchor B: FileSystemReader(dir).read_metadata()", b["load_s"], b, torch_rss),
        row("ckptkit.open(dir)", tens["open_s"], None, None),
        row(f"  .tensors ({int(tens['rows']):,} rows; imports pandas)", tens["tensors_s"], None,
            None),
        row("**ckptkit open + .tensors (total)**", tens["total_s"], tens, ckpt_rss),
        row(f"ckptkit open + .chunks ({int(chunks['rows']):,} rows)", chunks["total_s"], chunks,
            ckpt_rss),
        row("  of which .chunks", chunks["chunks_s"], None, None),
    ]  # fmt: skip
    headers = [
        "measurement",
        "wall s",
        "CPU s",
        "peak RSS MiB",
        "RSS over import baseline MiB",
        "wall / anchor A",
        "CPU / anchor A",
        "RSS / anchor A",
    ]
    goals = {
        "total_s": {"goal": GOAL_TOTAL_S, "value": tens["total_s"]},
        "peak_rss_mib": {"goal": GOAL_PEAK_MIB, "value": tens["peak_rss_mib"]},
    }
    for goal in goals.values():
        goal["met"] = goal["value"] <= goal["goal"]
    lines = [
        f"Medians of {repeat} fresh processes each, run round-robin on a shared machine. Wall s",
        "and CPU s (process_time, less sensitive to other users' load) time only the named step",
        "inside the child (imports excluded; .tensors includes the lazy pandas import). Peak RSS",
        "is the child's ru_maxrss (imports included). MiB = 2^20 B.",
        "",
        markdown_table(headers, rows),
        "",
        f"Goal: ckptkit open + .tensors <= {GOAL_TOTAL_S:g} s: "
        f"{'MET' if goals['total_s']['met'] else 'MISSED'} ({tens['total_s']:.2f} s wall, "
        f"{tens['cpu_s']:.2f} s CPU)",
        f"Goal: ckptkit peak RSS <= {GOAL_PEAK_MIB:g} MiB: "
        f"{'MET' if goals['peak_rss_mib']['met'] else 'MISSED'} ({tens['peak_rss_mib']:.0f} MiB)",
        f"For reference, {ELSEWHERE}.",
    ]
    return "\n".join(lines), goals


def main() -> None:
    """Generate the metadata if needed, measure, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--keys", type=int, default=N_KEYS)
    parser.add_argument("--ranks", type=int, default=N_RANKS)
    args = parser.parse_args()

    env_before = environment()
    directory = ensure_metadata(args.keys, args.ranks)
    size_mb = (directory / ".metadata").stat().st_size / 2**20
    progress(f"{directory}/.metadata: {size_mb:.1f} MiB")
    runs = repeat_interleaved(jobs(directory), args.repeat)

    tens = runs["ckptkit: open + .tensors"]
    chunks = runs["ckptkit: open + .chunks"]
    if any(r.report["torch_loaded"] for r in tens + chunks):
        raise SystemExit("torch was loaded by ckptkit")
    n_chunks = runs["anchor A: pickle.load (torch classes)"][0].report["chunks"]
    if tens[0].report["rows"] != args.keys or chunks[0].report["rows"] != n_chunks:
        raise SystemExit("ckptkit row counts disagree with torch's metadata")

    stats = summarize(runs)
    text, goals = report(stats, args.repeat)
    print(
        f"## bench_metadata: {args.keys:,} keys x {args.ranks} ranks = {n_chunks:,} chunks, "
        f".metadata {size_mb:.1f} MiB\n"
    )
    print(text)
    print(load_line(env_before))
    write_json(
        OUT_DIR / "bench_metadata.json",
        {
            "benchmark": "bench_metadata",
            "params": {"keys": args.keys, "ranks": args.ranks, "chunks": n_chunks},
            "metadata_mib": size_mb,
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "medians": stats,
            "goals": goals,
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_metadata.json'}")


if __name__ == "__main__":
    main()
