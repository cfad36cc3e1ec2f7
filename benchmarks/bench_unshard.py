"""Unshard a 1.5 GiB DCP (world size 2) with ckptkit vs torch's ``dcp_to_torch_save`` vs the
plain Python copy of the same bytes (and ``cp -r``).

Generates (once, cached in ``benchmarks/out/``) DCP checkpoints of 24 x [16384, 1024] tensors
(``--tensors N`` for another count) written by torch's own ``dcp.save`` from 2 spawned gloo
ranks holding DTensors: fp32 row-sharded (``Shard(0)``, case ``rows``), fp32 column-sharded
(``Shard(1)``, ``cols``) and bf16 row-sharded (``rows-bf16``). Then measures in fresh
processes: ``cp -r`` of the directory (in-kernel copy), the plain Python copy (a fresh
interpreter ``readinto`` a reused 16 MiB buffer + ``write``: the user-space floor every target
is compared with), ``dcp_to_torch_save`` (anchor), ``ckptkit.unshard(to="safetensors")``, the
same into 256 MiB shards (``max_shard_size``: ``model-0000i-of-0000n.safetensors`` + index)
and ``ckptkit.unshard(to="torch")``; checks once that ckptkit's outputs are bit-equal to torch's.
The default run (3 cases x 1.5 GiB, 3 rounds) takes ~6 min on an idle 2-core machine.
``--large`` adds the case ``rows-large``: the cached 4 GiB fp32 row-sharded source bench_scale
also measures (``--large N`` for N tensors), off by default because it adds ~3 min
per round and 16 GiB of outputs kept for the check.
``--chunks 100000 500000`` measures the per-chunk cost instead (or as well, with ``--layouts``):
DCPs of that many small chunks (row-sharded [4, 8] fp32 DTensors, 2 gloo ranks, ``dcp.save``),
µs per chunk for ckptkit → safetensors / → torch against the goal, beside ``dcp_to_torch_save``
(stopped after ``ANCHOR_LIMIT_S`` and reported as skipped).
Usage: ``python benchmarks/bench_unshard.py [--repeat N] [--layouts rows cols rows-bf16]
[--tensors N] [--large [N]] [--work-root DIR] [--chunks N ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    REPO_ROOT,
    REPORT_MARKER,
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

N_TENSORS = 24
SHAPE = (16384, 1024)  # float32: 64 MiB per tensor, 1.5 GiB in all
WORLD_SIZE = 2
#: case name -> (the dimension DTensors are sharded along, their dtype)
LAYOUTS = {"rows": (0, "float32"), "cols": (1, "float32"), "rows-bf16": (0, "bfloat16")}
#: The optional large case (``--large``): a ``rows`` checkpoint of this many tensors (4 GiB),
#: the same cached source bench_scale measures, so it is generated once.
LARGE = "rows-large"
LARGE_TENSORS = 64
SHARD_SIZE = "256MiB"  # the sharded safetensors target
ITEMSIZE = {"float32": 4, "bfloat16": 2}
GENERATOR_VERSION = 1
GOAL_VS_TORCH = 0.15  # ckptkit wall <= 0.15 x dcp_to_torch_save
GOAL_VS_COPY = 1.25  # ckptkit wall <= 1.25 x the plain Python copy of the same bytes
GOAL_HEADROOM_MIB = 64  # peak RSS above the baseline <= largest tensor + 64 MiB
COPY_BUFFER_MIB = 16  # the plain Python copy's one reused buffer
#: Outputs of the measured runs, deleted after each one (``--work-root DIR`` puts them in a
#: folder of DIR instead, e.g. on a tmpfs to take the disk out: ckptkit's commit fsyncs its
#: files, the plain copy and torch's save do not).
WORK = OUT_DIR / "unshard_work"

CP = "cp -r (in-kernel copy)"
PY_COPY = f"plain python copy (readinto {COPY_BUFFER_MIB} MiB + write)"
TORCH = "torch dcp_to_torch_save"
SAFETENSORS = "ckptkit unshard to=safetensors"
SHARDED = f"ckptkit unshard to=safetensors max_shard_size={SHARD_SIZE}"
TORCH_SAVE = "ckptkit unshard to=torch"
TOOLS = [CP, PY_COPY, TORCH, SAFETENSORS, SHARDED, TORCH_SAVE]
CKPTKIT_TOOLS = (SAFETENSORS, SHARDED, TORCH_SAVE)  # the rows with goals
BASE_CKPTKIT = "baseline: import ckptkit + open"
BASE_CKPTKIT_TORCH = "baseline: import ckptkit, torch + open"
BASE_TORCH = "baseline: import torch.distributed.checkpoint"
BASELINES = [BASE_CKPTKIT, BASE_CKPTKIT_TORCH, BASE_TORCH]


# -- input -----------------------------------------------------------------------------------


def key_name(i: int) -> str:
    """The key of tensor ``i`` inside the ``model`` group."""
    return f"layers.{i}.weight"


def layout_of(case: str) -> str:
    """The layout (``LAYOUTS`` key) of a case: itself, or ``rows`` for the large case."""
    return "rows" if case == LARGE else case


def tensor_mib(layout: str) -> float:
    """MiB of one tensor of case ``layout`` (the largest: all are the same)."""
    return SHAPE[0] * SHAPE[1] * ITEMSIZE[LAYOUTS[layout_of(layout)][1]] / 2**20


def full_tensor(i: int, dtype: str = "float32"):
    """Tensor ``i`` in full: seeded normal values, so every run generates the same checkpoint."""
    import torch

    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(getattr(torch, dtype))


def _save_rank(
    rank: int,
    world_size: int,
    path: str,
    shard_dim: int,
    n_tensors: int = N_TENSORS,
    dtype: str = "float32",
) -> None:
    """Rank body of :func:`write_source`: DTensors scattered from rank 0, saved by ``dcp.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(n_tensors):
        # distribute_tensor scatters rank 0's values; the other ranks only supply the shape
        empty = torch.empty(SHAPE, dtype=getattr(torch, dtype))
        full = full_tensor(i, dtype) if rank == 0 else empty
        model[key_name(i)] = distribute_tensor(full, mesh, [Shard(shard_dim)])
        del full
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_source(
    path: Path, shard_dim: int, n_tensors: int = N_TENSORS, dtype: str = "float32"
) -> None:
    """Write one benchmark checkpoint with torch's DCP from ``WORLD_SIZE`` spawned gloo ranks."""
    from ckptkit.examples import _spawn

    _spawn(_save_rank, WORLD_SIZE, str(path), shard_dim, n_tensors, dtype)


def ensure_source(layout: str, n_tensors: int = N_TENSORS) -> Path:
    """The cached checkpoint for case ``layout`` of ``n_tensors`` tensors, generated in a
    child process if missing (fp32 ones keep the names and parameters bench_stats shares; the
    large case is the ``rows`` one of more tensors, which bench_scale uses too)."""
    if layout == LARGE:
        return ensure_source(layout_of(layout), n_tensors)
    shard_dim, dtype = LAYOUTS[layout]
    params: dict[str, Any] = {
        "tensors": n_tensors,
        "shape": list(SHAPE),
        "shard_dim": shard_dim,
        "world_size": WORLD_SIZE,
        "generator": GENERATOR_VERSION,
    }
    if dtype != "float32":
        params["dtype"] = dtype
    return cached_input(
        OUT_DIR / f"unshard_{layout}_{n_tensors}x{SHAPE[0]}x{SHAPE[1]}",
        params,
        "from bench_unshard import write_source\n"
        f"write_source(out, {shard_dim}, {n_tensors}, {dtype!r})",
        f"dcp.save of {n_tensors} {dtype} tensors from {WORLD_SIZE} ranks",
    )


#: Small-chunk scenario: DTensors of this shape, each row-sharded over ``WORLD_SIZE`` ranks,
#: so a checkpoint of ``n`` chunks holds ``n / WORLD_SIZE`` tensors of 2 chunks each.
SMALL_SHAPE = (4, 8)
SMALL_GENERATOR_VERSION = 1


def small_key(i: int) -> str:
    """The key of small tensor ``i`` inside the ``model`` group."""
    return f"blocks.{i // 100}.weight_{i % 100}"


def _save_small_rank(rank: int, world_size: int, path: str, n_tensors: int) -> None:
    """Rank body of :func:`write_small_source`: ``n_tensors`` row-sharded DTensors built from
    each rank's local rows (no scatter), saved by ``dcp.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    rows = SMALL_SHAPE[0] // world_size
    numel = rows * SMALL_SHAPE[1]
    base = torch.arange(numel, dtype=torch.float32).reshape(rows, SMALL_SHAPE[1])
    model = {}
    for i in range(n_tensors):
        local = base + float(i * SMALL_SHAPE[0] * SMALL_SHAPE[1] + rank * numel)
        model[small_key(i)] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_small_source(path: Path, n_chunks: int) -> None:
    """Write the small-chunk checkpoint of ``n_chunks`` chunks with torch's DCP from
    ``WORLD_SIZE`` spawned gloo ranks."""
    from ckptkit.examples import _spawn

    _spawn(_save_small_rank, WORLD_SIZE, str(path), n_chunks // WORLD_SIZE)


def ensure_small_source(n_chunks: int) -> Path:
    """The cached small-chunk checkpoint of ``n_chunks`` chunks, generated if missing."""
    params = {
        "chunks": n_chunks,
        "shape": list(SMALL_SHAPE),
        "world_size": WORLD_SIZE,
        "generator": SMALL_GENERATOR_VERSION,
    }
    return cached_input(
        OUT_DIR / f"unshard_chunks_{n_chunks}",
        params,
        f"from bench_unshard import write_small_source\nwrite_small_source(out, {n_chunks})",
        f"{n_chunks} small chunks, dcp.save from {WORLD_SIZE} ranks",
    )


def source_mib(directory: Path) -> float:
    """Bytes of the checkpoint's files, in MiB."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) / 2**20


# -- measurements ----------------------------------------------------------------------------

_TIMED = """
t0, c0 = time.perf_counter(), time.process_time()
{body}
t1, c1 = time.perf_counter(), time.process_time()
_report(op_s=t1 - t0, op_cpu_s=c1 - c0, torch_loaded=sys.modules.get("torch") is not None)
"""


def _child(imports: str, body: str) -> list[str]:
    """A python child that imports first, then times ``body`` alone."""
    return python_argv(imports + "\n" + _TIMED.format(body=body))


def tool_argv(tool: str, src: Path, dst: Path) -> list[str]:
    """The command measuring ``tool`` on checkpoint ``src``, writing into ``dst``."""
    if tool == CP:
        return ["cp", "-r", str(src), str(dst)]
    if tool == PY_COPY:
        here = str(Path(__file__).resolve().parent)
        return _child(
            f"sys.path.insert(0, {here!r})\nfrom bench_unshard import copy_files",
            f"copy_files({str(src)!r}, {str(dst)!r})",
        )
    if tool == TORCH:
        return _child(
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
            f"dcp_to_torch_save({str(src)!r}, {str(dst / 'model.pt')!r})",
        )
    target = "torch" if tool == TORCH_SAVE else "safetensors"
    shards = f", max_shard_size={SHARD_SIZE!r}" if tool == SHARDED else ""
    return _child(
        "import ckptkit",
        f"ckptkit.unshard({str(src)!r}, {str(dst)!r}, to={target!r}{shards}, progress=False)",
    )


def copy_files(src: str, dst: str, buffer_mib: int = COPY_BUFFER_MIB) -> None:
    """The plain Python copy, what any user-space converter must at least do: ``readinto`` one
    reused buffer and ``write`` it out, file by file (``cp`` itself goes faster: it copies in
    the kernel with ``copy_file_range``)."""
    buffer = bytearray(buffer_mib << 20)
    view = memoryview(buffer)
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as out:
            while n := f.readinto(buffer):
                out.write(view[:n])


def baseline_argv(name: str, src: Path) -> list[str]:
    """The interpreter state each tool starts from: its imports (and for ckptkit, ``open``)."""
    imports = {
        BASE_CKPTKIT: "import ckptkit",
        BASE_CKPTKIT_TORCH: "import ckptkit, torch",
        BASE_TORCH: "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
    }[name]
    body = "pass" if name == BASE_TORCH else f"ckptkit.open({str(src)!r}).catalog"
    return _child(imports, body)


def output_dir(layout: str, tool: str) -> Path:
    """Where ``tool`` writes for ``layout`` (kept after the last round for the check)."""
    return WORK / f"{layout}-{TOOLS.index(tool)}"


def remove(path: Path) -> None:
    """Delete a measured output and flush, so the next run starts with no writeback pending."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def jobs(sources: dict[str, Path], repeat: int) -> dict[str, Callable[[], Run]]:
    """The child processes to measure, by name; each cleans up its output after itself,
    except on its last round, whose outputs :func:`verify` compares."""
    out: dict[str, Callable[[], Run]] = {}
    calls: dict[str, int] = {}
    for name in BASELINES:
        out[name] = lambda name=name: run(baseline_argv(name, next(iter(sources.values()))))
    for layout, src in sources.items():
        for tool in TOOLS:
            name = f"{layout}: {tool}"

            def job(name=name, layout=layout, src=src, tool=tool) -> Run:
                calls[name] = calls.get(name, 0) + 1
                dst = output_dir(layout, tool)
                remove(dst)
                if tool != CP:
                    dst.mkdir(parents=True)
                result = run(tool_argv(tool, src, dst))
                if tool in (CP, PY_COPY) or calls[name] < repeat:
                    remove(dst)
                return result

            out[name] = job
    return out


def verify(layout: str) -> dict[str, Any]:
    """Compare ckptkit's outputs of the last round with ``dcp_to_torch_save``'s, in a child;
    the sharded target through its index (or its one file, when everything fit in a shard)."""
    torch_out = output_dir(layout, TORCH) / "model.pt"
    pt = output_dir(layout, TORCH_SAVE) / "model.pt"
    st = output_dir(layout, SAFETENSORS) / "model.safetensors"
    sharded = output_dir(layout, SHARDED)
    code = f"""
        import os
        import torch
        from safetensors import safe_open
        expected = torch.load({str(torch_out)!r}, mmap=True, weights_only=True)["model"]
        ours = torch.load({str(pt)!r}, mmap=True, weights_only=True)
        index = os.path.join({str(sharded)!r}, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = _json.load(f)["weight_map"]
        else:
            weight_map = dict.fromkeys(expected, "model.safetensors")
        files = sorted(set(weight_map.values()))
        written = sorted(n for n in os.listdir({str(sharded)!r}) if n.endswith(".safetensors"))
        assert files == written, f"index {{files}} != files {{written}}"
        shards = {{n: safe_open(os.path.join({str(sharded)!r}, n), "pt") for n in files}}
        assert sum(len(s.keys()) for s in shards.values()) == len(expected), "shard keys"
        checked, bad = 0, []
        with safe_open({str(st)!r}, framework="pt") as st:
            assert set(st.keys()) == set(ours) == set(expected) == set(weight_map), "keys differ"
            for key, want in expected.items():
                for got in (ours[key], st.get_tensor(key), shards[weight_map[key]].get_tensor(key)):
                    same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
                        got.view(torch.uint8), want.view(torch.uint8))
                    if not same:
                        bad.append(key)
                    checked += 1
        _report(checked=checked, bad=bad, keys=len(expected), shard_files=files)
        """
    result = run(python_argv(code)).report
    for tool in (TORCH, *CKPTKIT_TOOLS):
        remove(output_dir(layout, tool))
    return result


# -- report ----------------------------------------------------------------------------------


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Medians per measurement: timed step (python children; cp: the whole process), CPU, RSS."""
    stats: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        is_python = bool(results[0].report)
        stats[name] = {
            "op_s": median([r.report["op_s"] if is_python else r.wall_s for r in results]),
            "process_wall_s": median([r.wall_s for r in results]),
            "op_cpu_s": median([r.report["op_cpu_s"] if is_python else r.cpu_s for r in results]),
            "process_cpu_s": median([r.cpu_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
        }
        if is_python:
            stats[name]["torch_loaded"] = any(r.report["torch_loaded"] for r in results)
    return stats


def baseline_for(tool: str, stats: dict[str, dict[str, float]], torch_loaded: bool) -> str | None:
    """The baseline row ``tool`` starts from: its imports (torch's too when the run imported
    it: ``to="torch"`` pickles torch's own rebuild functions), before touching tensor data."""
    if tool in (CP, PY_COPY):
        return None
    if tool == TORCH:
        return BASE_TORCH
    return BASE_CKPTKIT_TORCH if torch_loaded else BASE_CKPTKIT


def report(
    stats: dict[str, dict[str, float]], layouts: list[str], repeat: int, counts: dict[str, int]
) -> tuple[str, dict]:
    """The markdown table and the goal lines, plus goal verdicts per layout and target: every
    row as a ratio to the plain Python copy of the same bytes and to ``dcp_to_torch_save``."""
    headers = [
        "measurement",
        "wall s",
        "process wall s",
        "CPU s",
        "peak RSS MiB",
        "RSS over baseline MiB",
        "wall / python copy",
        "wall / dcp_to_torch_save",
        "wall / cp",
        "CPU / python copy",
        "CPU / dcp_to_torch_save",
    ]
    rows = []
    for name in BASELINES:
        s = stats[name]
        rows.append(
            [name, "—", f"{s['process_wall_s']:.2f}", f"{s['process_cpu_s']:.2f}",
             f"{s['peak_rss_mib']:.0f}", "—", "—", "—", "—", "—", "—"]
        )  # fmt: skip
    goals: dict[str, Any] = {}
    lines = []
    for layout in layouts:
        cp, copy = stats[f"{layout}: {CP}"], stats[f"{layout}: {PY_COPY}"]
        anchor = stats[f"{layout}: {TORCH}"]
        goal_rss = tensor_mib(layout) + GOAL_HEADROOM_MIB
        for tool in TOOLS:
            s = stats[f"{layout}: {tool}"]
            base = baseline_for(tool, stats, bool(s.get("torch_loaded")))
            over = None if base is None else s["peak_rss_mib"] - stats[base]["peak_rss_mib"]
            s["baseline"] = base
            s["rss_over_baseline_mib"] = over
            rows.append(
                [
                    f"{layout}: {tool}",
                    f"{s['op_s']:.2f}",
                    f"{s['process_wall_s']:.2f}",
                    f"{s['op_cpu_s']:.2f}",
                    f"{s['peak_rss_mib']:.0f}",
                    "—" if over is None else f"{over:.0f}",
                    ratio(s["op_s"], copy["op_s"]),
                    ratio(s["op_s"], anchor["op_s"]),
                    ratio(s["op_s"], cp["op_s"]),
                    ratio(s["op_cpu_s"], copy["op_cpu_s"]),
                    ratio(s["op_cpu_s"], anchor["op_cpu_s"]),
                ]
            )
            if tool not in CKPTKIT_TOOLS:
                continue
            vs_torch = s["op_s"] / anchor["op_s"]
            vs_copy = s["op_s"] / copy["op_s"]
            process_vs_copy = s["process_wall_s"] / copy["process_wall_s"]
            g = {
                "vs_dcp_to_torch_save": {"value": vs_torch, "goal": GOAL_VS_TORCH},
                "vs_python_copy": {"value": vs_copy, "goal": GOAL_VS_COPY},
                "rss_over_baseline_mib": {"value": over, "goal": goal_rss},
            }
            for item in g.values():
                item["met"] = item["value"] <= item["goal"]
            goals[f"{layout}: {tool}"] = g
            g["cpu_vs_dcp_to_torch_save"] = {"value": s["op_cpu_s"] / anchor["op_cpu_s"]}
            g["cpu_vs_python_copy"] = {"value": s["op_cpu_s"] / copy["op_cpu_s"]}
            g["process_wall_vs_python_copy"] = {"value": process_vs_copy}
            g["vs_cp"] = {"value": s["op_s"] / cp["op_s"]}

            def verdict(item: dict) -> str:
                return "MET" if item["met"] else "MISSED"

            lines.append(
                f"- {layout}, {tool}: wall / python copy {vs_copy:.2f} (goal <= {GOAL_VS_COPY}: "
                f"{verdict(g['vs_python_copy'])}; CPU ratio "
                f"{g['cpu_vs_python_copy']['value']:.2f}; whole processes, imports included: "
                f"{process_vs_copy:.2f}); wall / dcp_to_torch_save {vs_torch:.3f} (goal <= "
                f"{GOAL_VS_TORCH}: {verdict(g['vs_dcp_to_torch_save'])}; CPU ratio "
                f"{g['cpu_vs_dcp_to_torch_save']['value']:.3f}); RSS over baseline {over:.0f} MiB "
                f"over `{base.removeprefix('baseline: ')}` (goal <= {goal_rss:.0f}: "
                f"{verdict(g['rss_over_baseline_mib'])})"
            )
            if base != BASE_CKPTKIT:
                plain = s["peak_rss_mib"] - stats[BASE_CKPTKIT]["peak_rss_mib"]
                lines.append(
                    f"  (over `import ckptkit + open` alone: {plain:.0f} MiB, the torch import "
                    "included)"
                )
        total_mib = counts[layout] * tensor_mib(layout)
        torch_over = anchor["peak_rss_mib"] - stats[BASE_TORCH]["peak_rss_mib"]
        lines.append(
            f"- {layout}, torch dcp_to_torch_save: RSS over its baseline {torch_over:.0f} MiB "
            f"= {torch_over / total_mib:.2f} x the checkpoint ({total_mib:.0f} MiB)"
        )
    text = [
        f"Medians of {repeat} fresh processes each, run round-robin after one warm-up `cp -r`",
        "per layout (so the sources sit in the page cache). Outputs go to",
        f"`{WORK}` and are deleted after each run; ckptkit's commit fsyncs its files (the",
        "copies and torch's save do not), so on a disk its rows include writing it out, on a",
        "tmpfs (`--work-root /dev/shm`) no row touches the disk. `wall s` / `CPU s` time only the",
        "conversion inside the child (imports excluded; `cp`: the whole process, which copies in",
        "the kernel with copy_file_range); `process wall s` includes interpreter start and",
        "imports. The plain python copy is a fresh interpreter `readinto` one reused",
        f"{COPY_BUFFER_MIB} MiB buffer + `write`, file by file: the same bytes, the floor of any",
        "user-space converter. On a busy machine wall time mostly measures the wait for a CPU:",
        "the CPU ratios are the steadier reading. Peak RSS is the child's ru_maxrss; RSS over",
        "baseline subtracts the matching baseline row: `import ckptkit + open`, plus torch for",
        "ckptkit runs that imported torch; torch's own import for dcp_to_torch_save. Goal RSS =",
        f"largest tensor + {GOAL_HEADROOM_MIB} MiB.",
        "",
        markdown_table(headers, rows),
        "",
        *lines,
    ]
    return "\n".join(text), goals


# -- small chunks ----------------------------------------------------------------------------

GOAL_US_PER_CHUNK = 20.0
#: dcp_to_torch_save is stopped (and reported as skipped) after this many seconds.
ANCHOR_LIMIT_S = 300.0
CHUNK_TOOLS = [CP, TORCH, SAFETENSORS, TORCH_SAVE]


def run_limited(argv: list[str], limit_s: float) -> Run | None:
    """:func:`_measure.run` with a time limit: None (the child killed) when it runs longer."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=child_env(), cwd=REPO_ROOT)  # fmt: skip
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > limit_s:
                proc.kill()
                os.wait4(proc.pid, 0)
                return None
            time.sleep(0.05)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode:
        raise RuntimeError(f"benchmark child failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    report = next(
        (json.loads(line[len(REPORT_MARKER) :]) for line in stdout.splitlines()
         if line.startswith(REPORT_MARKER)),
        {},
    )  # fmt: skip
    cpu = usage.ru_utime + usage.ru_stime
    return Run(argv, wall, usage.ru_maxrss, cpu, proc.returncode, stdout, stderr, report)


def verify_small(directory: Path, n_chunks: int) -> dict[str, Any]:
    """Check ckptkit's safetensors and torch outputs of the small-chunk checkpoint against the
    values the generator wrote (tensor ``i`` is ``arange(numel) + i * numel`` in row-major
    order), in a child."""
    code = f"""
        import torch
        from safetensors.torch import load_file
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from bench_unshard import SMALL_SHAPE, small_key
        numel = SMALL_SHAPE[0] * SMALL_SHAPE[1]
        n = {n_chunks} // {WORLD_SIZE}
        expected = torch.arange(n * numel, dtype=torch.float32).reshape(n, *SMALL_SHAPE)
        bad = []
        for name, loaded in (
            ("safetensors", load_file({str(directory / "st" / "model.safetensors")!r})),
            ("torch", torch.load({str(directory / "pt" / "model.pt")!r}, weights_only=True)),
        ):
            if len(loaded) != n:
                bad.append(f"{{name}}: {{len(loaded)}} tensors")
            got = torch.stack([loaded[small_key(i)] for i in range(n)])
            if not torch.equal(got, expected):
                bad.append(f"{{name}}: values differ")
        _report(keys=n, bad=bad)
        """
    return run(python_argv(code)).report


def measure_chunks(n_chunks: int, repeat: int) -> dict[str, Any]:
    """Every tool on the small-chunk checkpoint of ``n_chunks`` chunks (``repeat`` rounds;
    dcp_to_torch_save once, skipped past :data:`ANCHOR_LIMIT_S`); medians, and the checks."""
    src = ensure_small_source(n_chunks)
    work = WORK / f"chunks_{n_chunks}"
    results: dict[str, list[Run]] = {name: [] for name in [BASE_CKPTKIT, *CHUNK_TOOLS]}
    remove(work)
    progress(f"warm-up: cp -r {src.name}")
    subprocess.run(["cp", "-r", str(src), str(work)], check=True)
    remove(work)
    work.mkdir(parents=True)
    skipped = None
    for round_no in range(1, repeat + 1):
        results[BASE_CKPTKIT].append(run(baseline_argv(BASE_CKPTKIT, src)))
        for tool in CHUNK_TOOLS:
            if tool == TORCH and (round_no > 1 or skipped):
                continue
            dst = work / {CP: "cp", TORCH: "anchor", SAFETENSORS: "st", TORCH_SAVE: "pt"}[tool]
            remove(dst)
            if tool != CP:
                dst.mkdir(parents=True)
            found = run_limited(tool_argv(tool, src, dst), ANCHOR_LIMIT_S)
            if found is None:
                skipped = f"stopped after {ANCHOR_LIMIT_S:.0f} s"
                progress(f"{n_chunks} chunks: {tool} {skipped}")
                continue
            results[tool].append(found)
            progress(f"round {round_no}/{repeat}: {n_chunks} chunks: {tool}: {found.wall_s:.1f} s")
            if tool in (CP, TORCH):
                remove(dst)
    progress(f"verifying the {n_chunks}-chunk outputs against the generated values")
    check = verify_small(work, n_chunks)
    remove(work)
    if check["bad"]:
        raise SystemExit(f"{n_chunks} chunks: outputs differ: {check}")
    stats = summarize({name: runs for name, runs in results.items() if runs})
    return {"chunks": n_chunks, "stats": stats, "anchor_skipped": skipped, "check": check}


def report_chunks(found: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The table of one small-chunk scenario: µs per chunk against the goal, the unshard's
    wall (open included) and with ``open`` (the metadata alone, its baseline row) taken off."""
    n, stats = found["chunks"], found["stats"]
    open_s = stats[BASE_CKPTKIT]["op_s"]
    headers = ["measurement", "wall s", "CPU s", "peak RSS MiB", "µs/chunk wall",
               "µs/chunk CPU", "µs/chunk wall after open", "goal"]  # fmt: skip
    rows = [[f"{BASE_CKPTKIT} (open: metadata only)", f"{open_s:.2f}",
             f"{stats[BASE_CKPTKIT]['op_cpu_s']:.2f}", f"{stats[BASE_CKPTKIT]['peak_rss_mib']:.0f}",
             f"{open_s / n * 1e6:.1f}", "", "", ""]]  # fmt: skip
    goals = {}
    for tool in CHUNK_TOOLS:
        s = stats.get(tool)
        if s is None:
            rows.append([tool, f"skipped: {found['anchor_skipped']}", "", "", "", "", "", ""])
            continue
        per_chunk = s["op_s"] / n * 1e6
        after_open = (s["op_s"] - open_s) / n * 1e6 if tool in (SAFETENSORS, TORCH_SAVE) else None
        verdict = ""
        if after_open is not None:
            met = per_chunk <= GOAL_US_PER_CHUNK
            goals[tool] = {"us_per_chunk": per_chunk, "after_open": after_open, "met": met}
            verdict = f"<= {GOAL_US_PER_CHUNK:.0f}: {'MET' if met else 'MISSED'}"
        rows.append([tool, f"{s['op_s']:.2f}", f"{s['op_cpu_s']:.2f}",
                     f"{s['peak_rss_mib']:.0f}", f"{per_chunk:.1f}",
                     f"{s['op_cpu_s'] / n * 1e6:.1f}",
                     "" if after_open is None else f"{after_open:.1f}", verdict])  # fmt: skip
    title = f"### {n:,} chunks ({n // WORLD_SIZE:,} DTensors {list(SMALL_SHAPE)} fp32, 2 ranks)"
    return "\n".join([title, "", markdown_table(headers, rows)]), goals


def main() -> None:
    """Generate the inputs if needed, measure, verify, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None)
    parser.add_argument(
        "--tensors", type=int, default=N_TENSORS,
        help=f"tensors of {list(SHAPE)} per checkpoint (default {N_TENSORS}; 12: 768 MiB fp32)",
    )  # fmt: skip
    parser.add_argument(
        "--large", type=int, nargs="?", const=LARGE_TENSORS, default=0, metavar="N",
        help=f"add the case {LARGE}: the fp32 rows source of N tensors (default "
        f"{LARGE_TENSORS}: 4 GiB; ~3 min per round, 16 GiB of outputs kept for the check)",
    )  # fmt: skip
    parser.add_argument(
        "--work-root", type=Path, default=None,
        help="write the measured outputs under this folder (e.g. /dev/shm: no disk)",
    )  # fmt: skip
    parser.add_argument(
        "--chunks", nargs="+", type=int, default=[],
        help="small-chunk scenarios: checkpoints of this many chunks (e.g. 100000 500000)",
    )  # fmt: skip
    args = parser.parse_args()
    global WORK
    if args.work_root is not None:
        WORK = args.work_root / "bench_unshard_work"
    if args.layouts is None:
        args.layouts = [] if args.chunks else list(LAYOUTS)
    if args.chunks:
        main_chunks(args.chunks, args.repeat)
    counts = dict.fromkeys(args.layouts, args.tensors) | ({LARGE: args.large} if args.large else {})
    if not counts:
        return
    main_cases(counts, args.repeat)


def main_cases(counts: dict[str, int], repeat: int) -> None:
    """Measure every case (case name -> tensors), verify, print the table, write the JSON."""
    cases = list(counts)
    env_before = environment()
    start = time.perf_counter()
    sources = {case: ensure_source(case, n) for case, n in counts.items()}
    sizes = {layout: source_mib(path) for layout, path in sources.items()}
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    try:
        for layout, src in sources.items():  # warm the page cache with the sources
            progress(f"warm-up: cp -r {src.name} ({sizes[layout]:.0f} MiB)")
            remove(WORK / "warmup")
            subprocess.run(["cp", "-r", str(src), str(WORK / "warmup")], check=True)
            remove(WORK / "warmup")
        runs = repeat_interleaved(jobs(sources, repeat), repeat)
        checks = {}
        for layout in cases:
            progress(f"verifying {layout}: ckptkit outputs vs dcp_to_torch_save")
            checks[layout] = verify(layout)
            if checks[layout]["bad"] or checks[layout]["keys"] != counts[layout]:
                raise SystemExit(f"{layout}: outputs differ from dcp_to_torch_save: {checks}")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

    stats = summarize(runs)
    text, goals = report(stats, cases, repeat, counts)
    print(
        f"## bench_unshard: {list(SHAPE)} tensors, DCP from {WORLD_SIZE} ranks ("
        + ", ".join(
            f"{k}: {counts[k]} x {LAYOUTS[layout_of(k)][1]} {counts[k] * tensor_mib(k):.0f} MiB, "
            f"{sizes[k]:.0f} MiB on disk"
            for k in cases
        )
        + ")\n"
    )
    print(text)
    print(
        "\nChecked: "
        + "; ".join(
            f"{layout}: {c['keys']} tensors x (model.pt, model.safetensors, "
            f"{len(c['shard_files'])} {SHARD_SIZE} shard file(s)) bit-equal to dcp_to_torch_save"
            for layout, c in checks.items()
        )
    )
    torch_free = {name: not s["torch_loaded"] for name, s in stats.items() if SAFETENSORS in name}
    print(f"to=safetensors ran without importing torch: {torch_free}")
    print(load_line(env_before))
    progress(f"total {time.perf_counter() - start:.0f} s")
    write_json(
        OUT_DIR / "bench_unshard.json",
        {
            "benchmark": "bench_unshard",
            "params": {
                "tensors": counts,
                "shape": list(SHAPE),
                "world_size": WORLD_SIZE,
                "layouts": {k: LAYOUTS[layout_of(k)] for k in cases},
                "source_mib": sizes,
                "max_shard_size": SHARD_SIZE,
            },
            "repeat": repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "medians": stats,
            "goals": goals,
            "checks": checks,
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_unshard.json'}")


def main_chunks(counts: list[int], repeat: int) -> None:
    """Measure, check and print the small-chunk scenarios; their JSON beside the others'."""
    env_before = environment()
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        found = [measure_chunks(n, repeat) for n in counts]
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    goals = {}
    print(f"## bench_unshard --chunks: per-chunk cost, medians of {repeat} fresh processes\n")
    print(
        "`wall s` times `ckptkit.unshard` inside the child, `open` (reading the metadata into\n"
        "the catalog) included; `µs/chunk wall after open` takes the `open` row off, leaving\n"
        "the tensor work. The goal is the whole unshard per chunk. On a busy machine the CPU\n"
        "columns are the steadier reading.\n"
    )
    for result in found:
        text, goals[result["chunks"]] = report_chunks(result)
        print(text)
        print(f"\nChecked: {result['check']['keys']:,} tensors x (model.safetensors, model.pt) "
              "equal to the values the generator saved.\n")  # fmt: skip
    print(load_line(env_before))
    write_json(
        OUT_DIR / "bench_unshard_chunks.json",
        {
            "benchmark": "bench_unshard --chunks",
            "repeat": repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "scenarios": [{k: v for k, v in r.items()} for r in found],
            "goals": goals,
        },
    )


if __name__ == "__main__":
    main()
