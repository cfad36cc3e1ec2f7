"""Remote reads: bytes fetched from a loopback S3 server, ckptkit vs torch's ``FsspecReader``.

Generates (once, cached in ``benchmarks/out/``) an fp32 DCP checkpoint written by torch's own
``dcp.save`` from 2 spawned gloo ranks: 12 layers of a row-sharded [4096, 1024] weight (8 MiB
per rank) plus a small bias and norm (replicated), 192 MiB in all. Starts moto's S3 server on
127.0.0.1 in a process of its own (the test-suite's ``tests/s3server.py``, whose middleware
logs every request with its response body bytes), uploads the checkpoint, then measures in
fresh processes:

- one tensor (the first layer's weight): ``ckptkit.open(url).read(key)`` vs
  ``dcp.load({key: empty}, storage_reader=FsspecReader(url))``;
- everything: ``ckptkit.unshard(url, dir)`` vs what ``dcp_to_torch_save`` does, with
  ``FsspecReader`` instead of ``FileSystemReader`` (``_load_state_dict`` with the empty-state-
  dict planner, then ``torch.save``).

"fetched" counts the body bytes the server sent for the data files (``.distcp``); "needed" is
the sum of the byte records the job must read (from the metadata). Usage: ``python
benchmarks/bench_remote.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SERVER = HERE.parent / "tests" / "s3server.py"  # the test-suite's counting S3 server
CONTROL = "/__traffic__"  # its request log (GET) / reset (DELETE)
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

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
    ratio,
    repeat_interleaved,
    run,
    runs_json,
    write_json,
)

N_LAYERS = 12
SHAPE = (4096, 1024)  # float32 weight per layer, sharded along dim 0 over the ranks
WORLD_SIZE = 2
GENERATOR_VERSION = 1
SOURCE = OUT_DIR / f"remote_{N_LAYERS}x{SHAPE[0]}x{SHAPE[1]}"
WORK = OUT_DIR / "remote_work"
GOAL_RATIO = 1.02
ELSEWHERE = "torch FsspecReader over s3fs, measured when the issue was filed: 9.4x / 2.25x"
KEY = "model.layers.0.weight"

ONE = "one tensor"
ALL = "full unshard"
CKPTKIT = "ckptkit"
TORCH = "torch FsspecReader"


# -- input -----------------------------------------------------------------------------------


def _save_rank(rank: int, world_size: int, path: str) -> None:
    """Rank body of :func:`write_source`: DTensors scattered from rank 0, saved by ``dcp.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(N_LAYERS):
        gen = torch.Generator().manual_seed(i)
        full = torch.randn(SHAPE, generator=gen)
        model[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
        model[f"layers.{i}.bias"] = distribute_tensor(
            torch.randn(SHAPE[0], generator=gen), mesh, [Replicate()]
        )
        model[f"layers.{i}.norm"] = distribute_tensor(torch.ones(SHAPE[1]), mesh, [Replicate()])
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_source(path: Path) -> None:
    """Write the benchmark checkpoint with torch's DCP from ``WORLD_SIZE`` spawned gloo ranks."""
    from ckptkit.examples import _spawn

    _spawn(_save_rank, WORLD_SIZE, str(path))


def ensure_source() -> Path:
    """The cached checkpoint, generated in a child process if missing or stale."""
    params = {"layers": N_LAYERS, "shape": list(SHAPE), "ranks": WORLD_SIZE, "v": GENERATOR_VERSION}
    return cached_input(
        SOURCE,
        params,
        "from bench_remote import write_source\nwrite_source(out)",
        f"dcp.save from {WORLD_SIZE} ranks",
    )


def needed_bytes(source: Path) -> dict[str, int]:
    """Bytes of the distinct records each job must read, from ckptkit's catalog."""
    import ckptkit

    catalog = ckptkit.open(str(source)).catalog

    def records(entries) -> int:
        return sum(
            {
                (c.record.file, c.record.offset): c.record.length
                for e in entries
                for c in e.chunks
                if c.record is not None
            }.values()
        )

    return {ONE: records([catalog.entries[KEY]]), ALL: records(catalog.entries.values())}


# -- measurements ----------------------------------------------------------------------------

_TIMED = """
t0 = time.perf_counter()
{body}
_report(op_s=time.perf_counter() - t0)
"""


def child_argv(job: str, tool: str, url: str, out: Path) -> list[str]:
    """The child measuring ``tool`` on ``job``: imports first, then the timed body alone."""
    if tool == CKPTKIT:
        imports = "import ckptkit, torch"
        body = (
            f"ckptkit.open({url!r}).read({KEY!r})"
            if job == ONE
            else f"ckptkit.unshard({url!r}, {str(out)!r}, progress=False)"
        )
    elif job == ONE:
        imports = "import torch, torch.distributed.checkpoint as dcp\nfrom torch.distributed.checkpoint._fsspec_filesystem import FsspecReader"
        body = (
            f"template = {{{KEY!r}: torch.empty({list(SHAPE)!r})}}\n"
            f"dcp.load(template, storage_reader=FsspecReader({url!r}))"
        )
    else:
        imports = (
            "import os, torch\n"
            "from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader\n"
            "from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner\n"
            "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict"
        )
        body = (
            "sd = {}\n"
            f"_load_state_dict(sd, storage_reader=FsspecReader({url!r}), "
            "planner=_EmptyStateDictLoadPlanner(), no_dist=True)\n"
            f"os.makedirs({str(out)!r}, exist_ok=True)\n"
            f"torch.save(sd, {str(out / 'model.pt')!r})"
        )
    code = "import warnings\nwarnings.simplefilter('ignore')\n" + imports + _TIMED.format(body=body)
    return python_argv(code)


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """The test-suite's S3 server in a process of its own, on 127.0.0.1: its endpoint; it
    stops on leaving (when its stdin closes)."""
    server = subprocess.Popen(
        [sys.executable, str(SERVER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(**S3_ENV, AWS_ENDPOINT_URL=None),
        text=True,
    )
    try:
        yield server.stdout.readline().strip()
    finally:
        server.stdin.close()
        server.wait(timeout=60)


class TrafficLog:
    """The server process's request log, over HTTP."""

    def __init__(self, endpoint: str) -> None:
        self.url = endpoint + CONTROL

    def _call(self, method: str) -> list[dict[str, Any]]:
        with urllib.request.urlopen(urllib.request.Request(self.url, method=method)) as response:
            return json.loads(response.read())

    def reset(self) -> None:
        self._call("DELETE")

    def snapshot(self) -> list[dict[str, Any]]:
        return self._call("GET")


def jobs(traffic: TrafficLog, url: str, env: dict[str, str]) -> dict[str, Callable[[], Run]]:
    """Each job resets the server's log, runs its child and attaches what the server sent."""
    prefix = "/" + url.removeprefix("s3://")
    out: dict[str, Callable[[], Run]] = {}
    for job in (ONE, ALL):
        for tool in (CKPTKIT, TORCH):

            def measure(job=job, tool=tool) -> Run:
                target = WORK / f"{job}-{tool}".replace(" ", "_")
                shutil.rmtree(target, ignore_errors=True)
                traffic.reset()
                result = run(child_argv(job, tool, url, target), env=env)
                log = [r for r in traffic.snapshot() if r["path"].startswith(prefix)]
                gets = [r for r in log if r["method"] == "GET"]
                data = [r for r in gets if r["path"].endswith(".distcp")]
                result.report["data_bytes"] = sum(r["nbytes"] for r in data)
                result.report["data_gets"] = len(data)
                result.report["metadata_bytes"] = sum(
                    r["nbytes"] for r in gets if r["path"].endswith("/.metadata")
                )
                result.report["requests"] = len(log)
                shutil.rmtree(target, ignore_errors=True)
                return result

            out[f"{job}: {tool}"] = measure
    return out


# -- report ----------------------------------------------------------------------------------


def summarize(runs: dict[str, list[Run]], needed: dict[str, int]) -> dict[str, dict[str, Any]]:
    stats = {}
    for name, results in runs.items():
        job = name.split(":")[0]
        fetched = [r.report["data_bytes"] for r in results]
        stats[name] = {
            "job": job,
            "needed_bytes": needed[job],
            "data_bytes": median(fetched),
            "data_bytes_runs": fetched,
            "ratio": median(fetched) / needed[job],
            "metadata_bytes": median([r.report["metadata_bytes"] for r in results]),
            "data_gets": median([r.report["data_gets"] for r in results]),
            "requests": median([r.report["requests"] for r in results]),
            "op_s": median([r.report["op_s"] for r in results]),
            "process_wall_s": median([r.wall_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
        }
    return stats


def report(stats: dict[str, dict[str, Any]], repeat: int, total_mib: float) -> tuple[str, dict]:
    headers = [
        "measurement",
        "data fetched MiB",
        "needed MiB",
        "fetched / needed",
        "data GETs",
        "all requests",
        ".metadata MiB",
        "wall s",
        "wall / torch",
        "peak RSS MiB",
    ]
    rows, lines, goals = [], [], {}
    mib = 2**20
    for name, s in stats.items():
        anchor = stats[f"{s['job']}: {TORCH}"]
        rows.append(
            [
                name,
                f"{s['data_bytes'] / mib:.1f}",
                f"{s['needed_bytes'] / mib:.1f}",
                f"{s['ratio']:.3f}x",
                f"{s['data_gets']:.0f}",
                f"{s['requests']:.0f}",
                f"{s['metadata_bytes'] / mib:.3f}",
                f"{s['op_s']:.2f}",
                ratio(s["op_s"], anchor["op_s"]),
                f"{s['peak_rss_mib']:.0f}",
            ]
        )
        if name.endswith(CKPTKIT):
            met = s["ratio"] <= GOAL_RATIO
            goals[name] = {"ratio": s["ratio"], "goal": GOAL_RATIO, "met": met}
            lines.append(
                f"- {name}: fetched / needed {s['ratio']:.4f} (goal <= {GOAL_RATIO}: "
                f"{'MET' if met else 'MISSED'}); torch {anchor['ratio']:.2f}x"
            )
    text = [
        f"Checkpoint: {N_LAYERS} x fp32 [{SHAPE[0]}, {SHAPE[1]}] row-sharded over {WORLD_SIZE} ranks "
        f"+ replicated bias/norm, {total_mib:.0f} MiB, in moto's S3 server on 127.0.0.1.",
        f"Medians of {repeat} fresh processes each, round-robin. `wall s` times the job inside the",
        "child (imports excluded; ckptkit's includes `open`, torch's its metadata read). Bytes are",
        "response bodies counted by the server; `needed` = the job's distinct records.",
        "",
        markdown_table(headers, rows),
        "",
        *lines,
        f"- Elsewhere: {ELSEWHERE}.",
        "- Wall times here favour few large requests: moto copies the whole object for every",
        "  ranged GET (its `_handle_range_header` slices `key.value`), so each request costs the",
        f"  server time in proportion to the file ({total_mib / WORLD_SIZE:.0f} MiB), not the range;",
        "  S3 itself serves a range in proportion to its length.",
    ]
    return "\n".join(text), goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    args = parser.parse_args()
    before = environment()
    source = ensure_source()
    needed = needed_bytes(source)
    total_mib = sum(p.stat().st_size for p in source.iterdir() if p.name != "params.json") / 2**20

    with s3_server() as endpoint:
        env = child_env(**S3_ENV, AWS_ENDPOINT_URL=endpoint)
        progress(f"uploading {total_mib:.0f} MiB to the S3 server at {endpoint}")
        upload = run(
            python_argv(
                f"""
                import fsspec, os
                fs = fsspec.filesystem("s3")
                fs.mkdir("bench")
                for name in sorted(os.listdir({str(source)!r})):
                    if name != "params.json":
                        fs.put_file(os.path.join({str(source)!r}, name), "bench/ckpt/" + name)
                """
            ),
            env=env,
        )
        progress(f"uploaded in {upload.wall_s:.1f} s")
        try:
            runs = repeat_interleaved(
                jobs(TrafficLog(endpoint), "s3://bench/ckpt", env), args.repeat
            )
        finally:
            shutil.rmtree(WORK, ignore_errors=True)
    stats = summarize(runs, needed)
    text, goals = report(stats, args.repeat, total_mib)
    print(text)
    print()
    print(load_line(before))
    write_json(
        OUT_DIR / "bench_remote.json",
        {
            "environment": before,
            "needed_bytes": needed,
            "stats": stats,
            "goals": goals,
            "runs": runs_json(runs),
        },
    )


if __name__ == "__main__":
    main()
